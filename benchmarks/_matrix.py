"""`--parts matrix` of benchmarks/network.py: issue 51's whole matrix (worlds, link
rates, delays, modes) with one job per (world, mode), the bed reshaped under it.

The `train` part starts a job per (world, link, mode): on the 50 M-parameter model
each start (four host interpreters importing torch, building a 200 MB model, its
first steps) costs about a minute on this 2-core machine, and 48 rows cost most of
an hour before a step is measured. A mode's arithmetic does not depend on the link,
so here one job per (world, mode) trains through every link in turn: its steps fall
into one segment per link (benchmarks/_trainrank.py), each a warm-up on the new link
and then the measured steps, and between two segments rank 0 hands off to the driver,
which reshapes every host's link (`watcher`) while the other ranks wait in the job's
next exchange. No measured step spans two links.

- **Per link** (`schedule`): a mode without local steps warms up `link_warmup` steps
  and measures the rest of `link_steps` (its steps are all alike); local steps warm
  up one round and measure two (each window holds two rounds' ends).
- **Status**: rank 0 reads the status document's `network` at each segment's end,
  a moving average (weight 0.2 a step, runtime/train/records.py), so at most 0.8^n
  of it (n: the segment's steps) is the link before.
- **Loss**: each job's held-out loss after its last step (the same for every link);
  it is compared with synchronous fp32's where the two trained equal steps (the
  modes without local steps), not for the local jobs, which run longer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import _trainrank


def schedule(kwargs: dict, links: int, link_steps: int, link_warmup: int,
             sync_every: int) -> list[tuple[int, int]]:
    """(warm-up, measured) steps per link for the mode of ElasticJob `kwargs`."""
    if kwargs.get("sync") == "local":
        return [(sync_every, 2 * sync_every)] * links
    return [(link_warmup, link_steps - link_warmup)] * links


def segment_records(records: list[dict], index: int) -> list[dict]:
    """The ranks' records as the `train` part's would read for segment `index` alone
    (its window, waits, bytes and rank 0's status figures), the job's losses kept."""
    return [{**r, "status_network": None, **r["segments"][index]} for r in records]


def watcher(reshape: Callable[[int], None], handoff: Path, poll_s: float = 0.05):
    """What the driver runs while a job's ranks do (network.py `_run_job`'s `watch`):
    when rank 0 names segment i in `handoff`, `reshape(i)`, then acknowledge i. Returns
    why the job failed (a rank exited non-zero) or None once every rank has exited
    or the deadline has passed (the records' wait then says so)."""
    ack = _trainrank.ack_of(handoff)

    def watch(procs: Sequence, deadline: float) -> str | None:
        done = 0
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc, _log in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad:
                return f"a rank exited with status {bad[0]} before the job's end"
            if all(c == 0 for c in codes):
                return None
            try:
                want = int(handoff.read_text())
            except (FileNotFoundError, ValueError):  # not yet written, or being written
                want = done
            if want > done:
                reshape(want)
                ack.write_text(str(want))
                done = want
            time.sleep(poll_s)
        return None

    return watch

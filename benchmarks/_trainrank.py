"""One rank of one training job on the shaped bed (benchmarks/network.py's `train`
and `matrix` parts): it trains a real `ElasticJob` and prints one JSON record.

A job's steps fall into **segments**, one per link it trains on: each is a warm-up
(steps left out of the figures) and then the measured steps. The `train` part runs
one segment per job (`--warmup`, then the rest); the `matrix` part runs one job per
(world, mode) through every link, the driver reshaping the bed between segments
(benchmarks/_matrix.py). Between two segments rank 0 writes the next segment's index
to the `handoff` file and waits until the driver writes the same index to the file
beside it with `.ack` appended (the bed is then reshaped); the other ranks wait in
the job's next exchange, so no measured step spans two links.

Timing (what network.py's `utilization` reads), per segment: the window runs from
the end of the warm-up's last step to the end of the segment's last step
(`tx_bytes` read at both); the wait is the sum of the network waits the job's
gradient path measured in those steps (its `last_step_timing`, the figure behind
the status document's `network.wait_s`, here per step and unsmoothed), None if the
path measures none. Rank 0 also takes the status document's `network` at each
segment's end: what `eltctl status` would show on that link.

The held-out loss: rank 0 evaluates the model after the job's last step (local steps:
after the last round's averaging), so two jobs' losses compare where they trained
equal steps. Runs in the host interpreter inside a namespace: Python and torch only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import _bed
import _textlm

HANDOFF_TIMEOUT_S = 300.0  # the driver reshapes in well under a second; a driver that is gone ends the wait


def segments_of(spec: dict) -> list[tuple[int, int]]:
    """The job's (warm-up, measured) steps per segment: the spec's `segments`, or one
    of `warmup` and the rest of `steps`."""
    segs = spec.get("segments")
    if segs:
        return [(int(w), int(m)) for w, m in segs]
    return [(spec["warmup"], spec["steps"] - spec["warmup"])]


class Segments:
    """The running figures of the segment under way, closed into a list as each ends.
    Pure bookkeeping: `step(now, tx, timing)` after every committed step; True when
    that step ended a segment."""

    def __init__(self, plan: list[tuple[int, int]]) -> None:
        self.plan = plan
        self.done: list[dict] = []
        self._pos = 0
        self._open: dict | None = None

    @property
    def index(self) -> int:
        return len(self.done)

    def step(self, now: float, tx: int, timing) -> bool:
        warm, measured = self.plan[self.index]
        self._pos += 1
        if self._pos == warm:
            self._open = {"t0": now, "tx0": tx, "wait_s": 0.0, "job_bytes": 0, "job_bytes_per_step": None}
        elif self._pos > warm:
            o = self._open
            per = timing.bytes if timing is not None else None
            o["job_bytes_per_step"] = per
            o["wait_s"] = None if timing is None or o["wait_s"] is None else o["wait_s"] + timing.wait_s
            o["job_bytes"] = None if per is None or o["job_bytes"] is None else o["job_bytes"] + per
        if self._pos < warm + measured:
            return False
        o = self._open
        self.done.append({"measured_steps": measured, "window_s": now - o["t0"], "wait_s": o["wait_s"],
                          "tx_bytes": tx - o["tx0"], "job_bytes": o["job_bytes"],
                          "job_bytes_per_step": o["job_bytes_per_step"]})
        self._pos, self._open = 0, None
        return True

    @property
    def finished(self) -> bool:
        return self.index >= len(self.plan)


def ack_of(handoff: Path) -> Path:
    """Where the driver acknowledges what rank 0 wrote to `handoff` (benchmarks/_matrix.py)."""
    return Path(str(handoff) + ".ack")


def hand_off(path: Path, index: int, timeout_s: float = HANDOFF_TIMEOUT_S) -> None:
    """Rank 0 between segments: say segment `index` is next, wait for the driver's
    acknowledgement (the bed reshaped for it)."""
    ack = ack_of(path)
    path.write_text(str(index))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ack.read_text().strip() == str(index):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"the driver did not acknowledge segment {index} within {timeout_s:g} s ({ack})")


def train_worker(spec: dict) -> None:
    """One rank of one ElasticJob: train through the spec's segments, then print one
    JSON record on stdout (the module docstring says what it holds)."""
    import torch

    import eltctl_runtime as elt

    T = _textlm
    corpus, _shape, windows, model = T.rank_setup(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    heldout = T.heldout_batch(corpus, windows, spec["eval_samples"])
    first = spec["rank"] == 0
    eval_start = T.evaluate(model, heldout) if first else None
    kwargs = dict(spec["kwargs"])
    # --slow RANK=S: this rank is a slower machine, S more seconds of compute per sample
    slow = spec.get("slow_per_sample", 0.0) if spec["rank"] == spec.get("slow_rank", -1) else 0.0
    trained = {"steps": 0, "samples": 0}
    optimizer.register_step_post_hook(lambda *_: trained.__setitem__("steps", trained["steps"] + 1))

    def loss_of(batch):
        n = len(batch[1])
        trained["samples"] += n
        if slow:
            time.sleep(slow * n)
        return T.loss_fn(model, batch)

    if isinstance(kwargs.get("outer_optimizer"), dict):  # --outer-lr / --outer-momentum (outer_sgd)
        outer = kwargs["outer_optimizer"]
        kwargs["outer_optimizer"] = lambda params: torch.optim.SGD(params, **outer)
    plan = segments_of(spec)
    steps = sum(w + m for w, m in plan)
    try:
        job = elt.ElasticJob(model, optimizer, T.make_dataset(corpus, windows), global_batch_size=spec["batch"],
                             seed=spec["seed"], max_steps=steps, config=elt.RuntimeConfig.from_env(),
                             balance=spec["balance"], **kwargs)
    except (TypeError, ValueError) as e:
        print(json.dumps({"rank": spec["rank"], "skipped": f"ElasticJob refused {spec['kwargs']}: {e}"}), flush=True)
        return
    tx = _bed.tx_bytes_file()
    handoff = Path(spec["handoff"]) if first and spec.get("handoff") else None
    segs = Segments(plan)
    losses: list[float] = []
    with job:
        for batch in job:
            loss = job.step(lambda: loss_of(batch))
            if loss is None or segs.finished:
                continue  # a dropped step (no membership change is expected here)
            losses.append(loss)
            timing = job._grads.last_step_timing  # private: the benchmark reads the path's own figure
            # a window ends at its last step's end: what the job does after it (local steps'
            # last averaging) is neither in the time nor in the waits nor in the bytes
            if not segs.step(time.perf_counter(), int(tx.read_text()), timing):
                continue
            if first:  # what rank 0 puts in the status document (records.NetworkFigures) on this link
                segs.done[-1]["status_network"] = job._status.network.fields().get("network")
            if handoff is not None and not segs.finished:
                hand_off(handoff, segs.index)
        tail = losses[-min(10, len(losses)):]
        last = segs.done[-1]
        print(json.dumps({
            "rank": spec["rank"], "steps": len(losses), **last, "segments": segs.done,
            "start_loss": losses[0], "end_loss": sum(tail) / len(tail),
            "eval_loss_start": eval_start, "eval_loss": T.evaluate(model, heldout) if first else None,
            "status_network": last.get("status_network"),
            "optimizer_steps": trained["steps"], "samples_trained": trained["samples"],
        }), flush=True)

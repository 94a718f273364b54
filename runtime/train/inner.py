"""Local steps' inner steps of a fixed size: `ElasticJob(..., sync="local", sync_every=H,
inner_batch=b)`.

Without `inner_batch` a rank takes one inner step per job step, on its whole share of
the step; with speed-proportional shares (balance=True, the default) a faster rank's
share is larger, so on mixed hardware it takes the same number of inner steps as a
slower one, each on a bigger batch. With `inner_batch=b` a rank's share of a step is
taken in inner steps of at most b samples, so a faster rank (a bigger share) takes MORE
inner steps of the same size (DiLoCo's heterogeneous workers: dynamic local updates)
and every round still lasts H job steps of the balanced, equal duration: a round is
bounded in time and nobody waits for the slowest worker. The round's averaging already
weighs each rank's delta by the samples it trained on (local.py), so a rank that took
more steps on more samples weighs more.

A step of rank r with share n_r and the job's global batch G, with b = inner_batch::

    groups         n_r's indices cut into groups of b (the last may be smaller), each
                   group into micro-batches of the largest divisor of b within the usual
                   limit (micro_batch_size, a host's max_micro_batch, an out-of-memory
                   halving), so the input pipeline prepares them as ever
    each group     backward over its micro-batches (the job scales each loss by m / G)
                   -> the gradient times G / (the group's samples): the gradient of the
                   group's MEAN loss -> the inner step (unscale, clip, the script's hook,
                   the optimizer step: step.py's OptimizerStep through LocalPath)
    the last group its inner step is the job step's own: after the control tail's
                   all-reduce (LocalPath.finish), as without inner_batch

With equal speeds and b = G / W every rank takes one inner step per job step: the same
arithmetic as without inner_batch. The inner steps of the groups before the last run
before the step's tail is all-reduced; their time counts as this rank's compute (its
pace, so the balance gives a rank no more samples than its inner steps can take in a
step). What stays as it was: the round, its averaging and outer step, exactly-once
(the samples committed are the step's, whichever inner step took them), the roll-back
of an abort (to the round's start: an inner step of a dropped step is undone with the
round), a joiner's catch-up (it replays outer steps, not inner ones).

One exception, documented: a step redone after a rank ran out of memory (every rank
redoes it) trains again, locally, the groups whose inner steps this rank had taken
before the redo; the commit still counts each sample once (the audit's exactly-once is
about committed samples), the inner optimizer sees those samples twice.
"""

from __future__ import annotations

import time
from typing import Any


def check_inner_batch(inner_batch: Any, local: bool) -> int | None:
    """Validate ElasticJob's inner_batch (None: one inner step per job step). Pure."""
    if inner_batch is None:
        return None
    if not local:
        raise ValueError("inner_batch applies to local steps: pass sync='local', sync_every=H with it")
    if isinstance(inner_batch, bool) or not isinstance(inner_batch, int) or inner_batch < 1:
        raise ValueError(f"inner_batch must be a positive integer, the samples of one inner step (e.g. the global "
                         f"batch divided by the number of workers), got {inner_batch!r}")
    return inner_batch


def micro_limit(inner_batch: int | None, micro: int | None) -> int | None:
    """The micro-batch size with inner steps of `inner_batch`: the largest divisor of
    inner_batch that is at most `micro` (the usual limit; None: none), so every group of
    inner_batch samples is whole micro-batches and a share's chunks are the plain
    micro-batches the input pipeline prepares (pipeline.micro_chunks). Pure."""
    if not inner_batch:
        return micro
    m = min(micro or inner_batch, inner_batch)
    while inner_batch % m:
        m -= 1
    return m


def step_ends(n_chunks: int, inner_batch: int | None, micro: int | None) -> set[int]:
    """The numbers of the micro-batches (counted from 1) after which an inner step is
    taken before the step's last one, for a share cut into `n_chunks` micro-batches of
    `micro` (micro_limit's). Pure."""
    if not inner_batch or not micro:
        return set()
    per = inner_batch // micro
    return set(range(per, n_chunks, per))  # the last group's inner step is the job step's own


class InnerSteps:
    """A step's inner steps before its last (module docstring), for LocalPath."""

    __slots__ = ("inner_batch", "_ends", "_seen", "_group", "stepped")

    def __init__(self, inner_batch: int | None) -> None:
        self.inner_batch = inner_batch
        self._ends: set[int] = set()
        self._seen = 0  # micro-batches of the step through backward
        self._group = 0  # samples of the group in progress
        self.stepped = 0  # samples of this step already taken by an inner step

    def micro_limit(self, micro: int | None) -> int | None:
        """The step's micro-batch size (module function micro_limit)."""
        return micro_limit(self.inner_batch, micro)

    def begin_step(self, n_chunks: int, micro: int | None) -> None:
        """A new step, its share cut into `n_chunks` micro-batches of `micro` (micro_limit's)."""
        self._ends = step_ends(n_chunks, self.inner_batch, micro)
        self._seen = self._group = self.stepped = 0

    def micro_batch_done(self, path: Any, job: Any, n: int, global_count: int) -> None:
        """A micro-batch before the step's last went through backward with `n` samples:
        where it ends a group, that group's inner step (`path.inner_step`: LocalPath's),
        its time counted as this rank's compute.
        No step where a rank ran out of memory in this step (every rank redoes it)."""
        self._seen += 1
        self._group += n
        if self._seen not in self._ends:
            return
        m, self._group = self._group, 0
        if m <= 0 or job._shares.oom_retry:
            return
        t0 = time.perf_counter()
        path.inner_step(job, m, global_count)
        self.stepped += m
        job._shares.computed(time.perf_counter() - t0)

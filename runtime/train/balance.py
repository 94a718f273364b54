"""Speed-proportional shares: how a step's global batch is split among ranks.

Each rank times its own compute per sample (from the batch handed to the
script to the end of its backward, waits in collectives excluded) and smooths
it (`Pace`, an exponential moving average kept by the worker itself, so it
carries through resizes with the worker; a jump confirmed by a second step is
taken whole). The smoothed value rides in the
control tail of the step's all-reduce (one slot per rank), so at every commit
each rank holds the same floats for every rank and plans the same next split
(`Split.replanned`): shares proportional to speed (1 / seconds per sample).
Two bands keep noise from making the split oscillate: the split is looked at
again only when some rank's pace moved by more than `PACE_BAND` from the paces
it was last looked at with, and then changed only when the new split shortens
the predicted step by more than `DEAD_BAND`. A new generation starts
from equal shares (`Split()`) and is re-planned at its first commit from the
paces every member carried in.

Pure: every function here is a deterministic function of its arguments
(tested by table in tests/runtime/train/test_balance.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from .sampler import proportional_counts

# Weight of the newest measurement in a worker's smoothed pace.
EMA_ALPHA = 0.3
# A measurement this far (relative) from the smoothed pace is a jump: one alone is
# left out (a hiccup); a second in a row on the same side replaces the smoothed
# pace (the speed changed: an owner's process, throttling), so a 4x slowdown is
# taken whole after two steps instead of being approached over twenty.
JUMP = 0.5
# Look at the split again only when a rank's pace moved more than this (relative)
# since it was last looked at: measured on a loaded 2-core machine, 5 % bands on
# the predicted step alone let noise swap single samples back and forth.
PACE_BAND = 0.15
# Change it only when the new split is predicted to shorten the step by more than this.
DEAD_BAND = 0.05
# A worker whose speed is below this fraction of the median of the others' is a straggler.
STRAGGLER_SPEED = 0.25


@dataclass(frozen=True)
class Pace:
    """One worker's smoothed compute time per sample (None: not measured yet),
    and a jump seen at the last step, held back until a second confirms it."""

    seconds_per_sample: float | None = None
    jump: float | None = None

    def observed(self, seconds: float, samples: int) -> "Pace":
        """The pace after a step that computed `samples` in `seconds` (a step
        with no samples tells nothing and leaves it as it is): a moving
        average, except for jumps (JUMP)."""
        if samples <= 0 or not math.isfinite(seconds) or seconds < 0:
            return self
        x = max(seconds, 1e-9) / samples
        old = self.seconds_per_sample
        if old is None:
            return Pace(x)
        if abs(x - old) > JUMP * old:
            if self.jump is not None and (self.jump > old) == (x > old):
                return Pace(x)  # the second jump in a row, the same way: the speed changed
            return Pace(old, jump=x)
        return Pace(old + EMA_ALPHA * (x - old))

    @property
    def slot(self) -> float:
        """The value this rank puts in its tail slot (0.0: not measured)."""
        return self.seconds_per_sample or 0.0


def known_paces(slots: Sequence[float]) -> list[float] | None:
    """The tail's pace slots with unmeasured ranks (0, or garbage) given the
    mean of the measured ones; None when no rank has measured anything."""
    known = [x for x in slots if x > 0 and math.isfinite(x)]
    if not known:
        return None
    mean = math.fsum(known) / len(known)
    return [x if x > 0 and math.isfinite(x) else mean for x in slots]


def predicted_step_s(counts: Sequence[int], paces: Sequence[float]) -> float:
    """Compute time of a step split as `counts`: the slowest rank's."""
    return max((c * p for c, p in zip(counts, paces)), default=0.0)


@dataclass(frozen=True)
class Split:
    """The split in force: per-rank weights (speeds), or None for equal shares,
    and the paces it was last looked at with (None: not yet)."""

    weights: tuple[float, ...] | None = None
    basis: tuple[float, ...] | None = None
    minimum: int = 1  # the smallest share a rank gets (2 for a model with BatchNorm layers)

    def counts(self, total: int, world_size: int) -> list[int]:
        if self.weights is None or len(self.weights) != world_size:
            base, extra = divmod(total, world_size)
            return [base + (1 if r < extra else 0) for r in range(world_size)]
        return proportional_counts(total, self.weights, self.minimum)

    def replanned(self, slots: Sequence[float], total: int) -> "Split":
        """The split for the next steps, given every rank's pace (the tail's
        slots, identical on every rank) and the global batch. Unless some
        pace moved more than PACE_BAND since the split was last looked at, the
        same split; else looked at with these paces: shares proportional to
        speed when that is predicted to beat the current split by more than
        DEAD_BAND, else the current shares."""
        paces = known_paces(slots)
        if paces is None or total <= 0:
            return self
        if self.basis is not None and len(self.basis) == len(paces) and all(
                abs(p - b) <= PACE_BAND * b for p, b in zip(paces, self.basis)):
            return self
        basis = tuple(paces)
        speeds = tuple(1.0 / p for p in paces)
        new = proportional_counts(total, speeds, self.minimum)
        now = self.counts(total, len(paces))
        if new != now and predicted_step_s(new, paces) < (1.0 - DEAD_BAND) * predicted_step_s(now, paces):
            return Split(speeds, basis, self.minimum)
        return Split(self.weights, basis, self.minimum)


def speedup_without(slots: Sequence[float], total: int, rank: int) -> float:
    """How much faster (predicted compute time of a balanced step, >1: faster)
    the job would be without `rank`, the others taking its samples. 1.0 when it
    cannot be told (one rank, nothing measured)."""
    paces = known_paces(slots)
    if paces is None or len(paces) < 2 or total <= 0:
        return 1.0
    rest = [p for r, p in enumerate(paces) if r != rank]
    with_it = predicted_step_s(proportional_counts(total, [1 / p for p in paces]), paces)
    without = predicted_step_s(proportional_counts(total, [1 / p for p in rest]), rest)
    return with_it / without if without > 0 else 1.0


def relative_speed(slots: Sequence[float], rank: int) -> float | None:
    """Rank's speed as a fraction of the median speed of the others (None: unknown)."""
    paces = known_paces(slots)
    if paces is None or len(paces) < 2 or not (slots[rank] > 0):
        return None
    others = [1 / p for r, p in enumerate(paces) if r != rank]
    return (1 / paces[rank]) / statistics.median(others)


def worker_report(members: Sequence[str], counts: Sequence[int], slots: Sequence[float], total: int) -> dict:
    """Per worker, for rank 0's status document: {worker: {share, samples_per_s,
    relative_speed, speedup_without, straggler}}. samples_per_s is the worker's
    own compute speed (None until measured); a straggler runs at less than
    STRAGGLER_SPEED of the others' median speed, or holds the job back (the job
    would be faster without it)."""
    out = {}
    for r, w in enumerate(members):
        pace = slots[r] if r < len(slots) else 0.0
        rel = relative_speed(slots, r)
        gain = speedup_without(slots, total, r)
        out[w] = {
            "share": counts[r] if r < len(counts) else 0,
            "samples_per_s": round(1.0 / pace, 2) if pace > 0 and math.isfinite(pace) else None,
            "relative_speed": round(rel, 3) if rel is not None else None,
            "speedup_without": round(gain, 3),
            "straggler": (rel is not None and rel < STRAGGLER_SPEED) or gain > 1.0,
        }
    return out

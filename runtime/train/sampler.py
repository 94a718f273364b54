"""The elastic sampler: which sample indices each rank consumes at each step.

A pure value. The order of an epoch is a permutation fixed by (seed, epoch); the
only state is a committed position in that order. A step consumes the global
slice [position, position + global_batch) of the permutation (the last batch of
an epoch may be shorter), split into contiguous, possibly uneven, shares, one per
rank. The position advances only when a step commits, so whatever the world size
did between steps, every index of an epoch is consumed exactly once.

Shares are equal (`share_bounds`) or proportional to per-rank weights
(`proportional_counts`, the ranks' speeds: see balance.py); either way they are
contiguous, in rank order, and tile the slice.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Sequence

import torch


@lru_cache(maxsize=4)
def epoch_order(n_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The deterministic order of one epoch (same on every rank and every run)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF)
    return tuple(torch.randperm(n_samples, generator=g).tolist())


def share_bounds(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share of `total` items; the first
    total % world_size ranks get one more."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def proportional_counts(total: int, weights: Sequence[float], minimum: int = 1) -> list[int]:
    """Split `total` items into one count per weight (a rank's speed, items
    per second), proportional to the weights and summing to `total` exactly,
    rounded so that the slowest rank's time (count / weight) is as short as it
    can be. Every count is at least `minimum` when total allows it
    (minimum * len(weights) <= total; otherwise the equal split), so a slow
    rank keeps being measured. Deterministic (ties to the lower rank): the same
    on every rank given the same floats. Weights <= 0 or not finite are invalid
    (ValueError)."""
    n = len(weights)
    if n == 0:
        raise ValueError("no weights to split among")
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"weights must be positive and finite: {list(weights)}")
    if total < minimum * n:
        base, extra = divmod(total, n)
        return [base + (1 if r < extra else 0) for r in range(n)]
    # Greedy water-filling: each item goes to the rank that would finish it
    # soonest, which minimises the slowest rank's time. Every rank of that
    # allocation holds at least floor(free * w / sum) - 1 items, so start there
    # and hand out the last few (at most 2n) one by one.
    free = total - minimum * n
    s = math.fsum(weights)
    counts = [minimum + max(0, int(math.floor(free * w / s)) - 1) for w in weights]
    heap = [((c + 1) / w, r) for r, (c, w) in enumerate(zip(counts, weights))]
    heapq.heapify(heap)
    for _ in range(total - sum(counts)):
        _t, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, ((counts[r] + 1) / weights[r], r))
    return counts


def counts_bounds(counts: Sequence[int], rank: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share when the shares are `counts`, in rank order."""
    start = sum(counts[:rank])
    return start, start + counts[rank]


@dataclass(frozen=True)
class SamplerState:
    n_samples: int
    global_batch: int
    seed: int
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if self.n_samples <= 0 or self.global_batch <= 0:
            raise ValueError("n_samples and global_batch must be positive")

    def step_size(self) -> int:
        """Samples the next step consumes globally."""
        return min(self.global_batch, self.n_samples - self.position)

    def global_indices(self) -> list[int]:
        order = epoch_order(self.n_samples, self.seed, self.epoch)
        return list(order[self.position : self.position + self.step_size()])

    def share_counts(self, world_size: int, weights: Sequence[float] | None = None, minimum: int = 1) -> list[int]:
        """Samples each rank takes at the next step: equal shares, or
        proportional to `weights` (one per rank) when given, at least `minimum`
        each when the step has that many."""
        total = self.step_size()
        if weights is None:
            return [e - s for s, e in (share_bounds(total, r, world_size) for r in range(world_size))]
        if len(weights) != world_size:
            raise ValueError(f"{len(weights)} weights for {world_size} ranks")
        return proportional_counts(total, weights, minimum)

    def local_indices(self, rank: int, world_size: int, weights: Sequence[float] | None = None,
                      minimum: int = 1) -> list[int]:
        """Rank's share of the next step: equal, or proportional to `weights`."""
        if weights is None:
            start, end = share_bounds(self.step_size(), rank, world_size)
        else:
            start, end = counts_bounds(self.share_counts(world_size, weights, minimum), rank)
        order = epoch_order(self.n_samples, self.seed, self.epoch)
        return list(order[self.position + start : self.position + end])

    def advanced(self) -> "SamplerState":
        """The state after the next step commits."""
        position = self.position + self.step_size()
        if position >= self.n_samples:
            return replace(self, epoch=self.epoch + 1, position=0)
        return replace(self, position=position)


@dataclass(frozen=True)
class TrainingEnd:
    """Where the training ends: after `max_steps` committed steps, or once the sampler
    reaches epoch `epochs`, whichever comes first (at least one is given). Pure."""

    max_steps: int | None
    epochs: int | None

    def __post_init__(self) -> None:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("give max_steps or epochs (or both)")

    def reached(self, step: int, sampler: SamplerState) -> bool:
        if self.max_steps is not None and step >= self.max_steps:
            return True
        return self.epochs is not None and sampler.epoch >= self.epochs

    def steps_left(self, step: int) -> int | None:
        return None if self.max_steps is None else self.max_steps - step

    def progress(self, sampler: SamplerState) -> dict:
        """`eltctl status`'s progress: `total_steps`, the step the training ends at (max_steps
        or the epochs' steps, the fewer; null when neither bounds it), and `samples`, the
        samples committed since the training began (its samples/s: the controller's rate
        over recent commits, observe.py)."""
        s = sampler
        ends = [self.max_steps] if self.max_steps is not None else []
        if self.epochs is not None:
            ends.append(self.epochs * -(-s.n_samples // s.global_batch))
        return {"total_steps": min(ends) if ends else None, "samples": s.epoch * s.n_samples + s.position}

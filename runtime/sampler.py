"""The elastic sampler: which sample indices each rank consumes at each step.

A pure value. The order of an epoch is a permutation fixed by (seed, epoch); the
only state is a committed position in that order. A step consumes the global
slice [position, position + global_batch) of the permutation (the last batch of
an epoch may be shorter), split into contiguous, possibly uneven, shares, one per
rank. The position advances only when a step commits, so whatever the world size
did between steps, every index of an epoch is consumed exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

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

    def local_indices(self, rank: int, world_size: int) -> list[int]:
        start, end = share_bounds(self.step_size(), rank, world_size)
        order = epoch_order(self.n_samples, self.seed, self.epoch)
        return list(order[self.position + start : self.position + end])

    def advanced(self) -> "SamplerState":
        """The state after the next step commits."""
        position = self.position + self.step_size()
        if position >= self.n_samples:
            return replace(self, epoch=self.epoch + 1, position=0)
        return replace(self, position=position)

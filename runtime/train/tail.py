"""The control tail: what every rank tells every other at each step, summed in the
step's gradient all-reduce (gradients.py: it rides after the last float32 bucket).

Because these scalars ride with the gradients, every rank learns at the same step,
with no extra round trip, that membership changes after it, how the next steps are
split (balance.py), and whether the step is taken at all. This module owns the
layout: the step encodes this rank's `Control` into float32 (never fp16/bf16: it
carries sample counts and the loss sum), the gradient path sums it over the ranks,
and the step decodes the sum into a `Summed`. Each rank fills only its own
per-rank slots, so the sum is exact::

    index              field        this rank writes                      the sum means
    0                  join_ready   1: it sees a queued joiner and is      ranks ready: a join alone
                                    ready for it (ready_for_join)          needs all of them
    1                  stop         1: stop asked (or the store lost)      > 0: the job stops
    2                  samples      its samples in the step                the step's samples
    3                  loss_sum     its loss sum                           the global loss sum
    4                  checkpoint   1: a checkpoint is due (rank 0's       > 0: every rank takes part
                                    clock, or one owed)
    5                  leave_ready  1: ready for the held-back leave       ranks ready: a leave needs all
                                    (ready_for_leave)
    6                  restore_bad  1: a file of the checkpoint just       > 0: the step is not taken
                                    restored is damaged
    7                  averaging    1: its overlapped averaging (local     0: every rank's is done (the min
                                    steps, sync_overlap) is still on the   over the ranks of "done"): the
                                    wire; 0: done, or none in flight       merge at this step's boundary
    8 + r              leave[r]     1: rank r leaves                       who leaves
    8 + W + r          pace[r]      its smoothed seconds per sample        every rank's pace (0: unmeasured)
    8 + 2W + r         oom[r]       0, or the micro-batch size it          > 0 anywhere: the step is redone
                                    redoes the step with

The module buffers' updates (gradients.BufferSync) follow the control tail in the
same float32 tail. `averaging` is the only field the gradient path writes itself
(local.py's finish, `set_averaging`: whether its all-reduce completed is known only
there, just before the tail goes); the step's encode writes it 0 (Control's default),
so without local steps' overlap it costs one float of the tail. Encoding and decoding
are pure; the layout of a world size is computed once (`layout`), so a step pays one
list, one tensor and one `tolist`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

N_SCALARS = 8  # the scalars before the per-rank slots (the module docstring's table)
AVERAGING = 7  # the `averaging` scalar's index


class Control(NamedTuple):
    """This rank's part of the tail."""

    join_ready: bool
    stop: bool
    samples: int
    loss_sum: float
    checkpoint: bool
    leave_ready: bool
    restore_bad: bool
    leave: bool  # this rank's leave slot
    pace: float  # this rank's pace slot
    oom: int  # this rank's out-of-memory slot
    averaging: bool = False  # its overlapped averaging still on the wire (local.py writes it: set_averaging)


class Summed(NamedTuple):
    """The tail summed over the ranks (counts of ranks where a rank writes 1)."""

    join_ready: float
    stop: float
    samples: float
    loss_sum: float
    checkpoint: float
    leave_ready: float
    restore_bad: float
    leave: list[float]  # per rank
    pace: list[float]  # per rank
    oom: list[float]  # per rank
    averaging: float = 0.0  # ranks whose overlapped averaging is not done (0: all done)


class TailLayout:
    """Where each field of a world size's tail lies (the module docstring's table)."""

    __slots__ = ("world_size", "size", "_leave", "_pace", "_oom")

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"a control tail needs a world size of at least 1, got {world_size}")
        w = world_size
        self.world_size = w
        self.size = N_SCALARS + 3 * w  # the control scalars; the buffers' updates follow
        self._leave = slice(N_SCALARS, N_SCALARS + w)
        self._pace = slice(N_SCALARS + w, N_SCALARS + 2 * w)
        self._oom = slice(N_SCALARS + 2 * w, N_SCALARS + 3 * w)

    def encode(self, rank: int, c: Control) -> torch.Tensor:
        """Rank `rank`'s part as the float32 control tail (zeros in the others' slots)."""
        values = [1.0 if c.join_ready else 0.0, 1.0 if c.stop else 0.0, float(c.samples), float(c.loss_sum),
                  1.0 if c.checkpoint else 0.0, 1.0 if c.leave_ready else 0.0, 1.0 if c.restore_bad else 0.0,
                  1.0 if c.averaging else 0.0]
        values += [0.0] * (3 * self.world_size)
        values[self._leave.start + rank] = 1.0 if c.leave else 0.0
        values[self._pace.start + rank] = float(c.pace)
        values[self._oom.start + rank] = float(c.oom)
        return torch.tensor(values, dtype=torch.float32)

    def decode(self, tail: torch.Tensor) -> Summed:
        """The summed control tail (the first `size` elements of `tail`, a CPU tensor)."""
        v = tail[:self.size].tolist()
        return Summed(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[self._leave], v[self._pace], v[self._oom],
                      v[AVERAGING])


def set_averaging(tail: torch.Tensor, busy: bool) -> None:
    """Write this rank's `averaging` field into its encoded tail in place (local.py's
    finish, just before the tail's all-reduce: 1.0 while its overlapped averaging is on
    the wire)."""
    tail[AVERAGING] = 1.0 if busy else 0.0


@functools.lru_cache(maxsize=64)
def layout(world_size: int) -> TailLayout:
    """The layout of `world_size`'s tail, computed once per world size."""
    return TailLayout(world_size)

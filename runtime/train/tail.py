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

A new field is one line in `Control` (and its row in this table): see its docstring.
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


class Control(NamedTuple):
    """This rank's part of the tail: one entry per field of the module docstring's table.

    The tail is this class: a field added here (a name, a type, a default) is encoded,
    summed and decoded with the others (`Summed` has the same names), and the layout's
    size follows. A field named in PER_RANK gets a slot per rank (each rank writes its
    own, the sum keeps them apart); any other is one scalar, summed over the ranks. The
    step passes each field by name (job.py), so a new one is 0 until the code that knows
    its value passes it, and a rank reads the sum as `decode(...).<name>`. The wire order
    is the scalars in this order, then each per-rank field's W slots in this order."""

    join_ready: bool = False
    stop: bool = False
    samples: int = 0
    loss_sum: float = 0.0
    checkpoint: bool = False
    leave_ready: bool = False
    restore_bad: bool = False
    leave: bool = False  # this rank's leave slot
    pace: float = 0.0  # this rank's pace slot
    oom: int = 0  # this rank's out-of-memory slot
    averaging: bool = False  # its overlapped averaging still on the wire (local.py writes it: set_averaging)


PER_RANK = ("leave", "pace", "oom")  # the fields with a slot per rank
SCALARS = tuple(f for f in Control._fields if f not in PER_RANK)
N_SCALARS = len(SCALARS)  # the scalars before the per-rank slots
AVERAGING = SCALARS.index("averaging")  # the `averaging` scalar's index (set_averaging)
_SCALAR_AT = tuple(Control._fields.index(f) for f in SCALARS)  # a Control's entries, in wire order
_PER_RANK_AT = tuple(Control._fields.index(f) for f in PER_RANK)

# The tail summed over the ranks, by the same names: a scalar's sum (a count of ranks
# where a rank writes 1), or a per-rank field's list of every rank's slot.
Summed = NamedTuple("Summed", [(f, list[float] if f in PER_RANK else float) for f in Control._fields])


class TailLayout:
    """Where each field of a world size's tail lies (the module docstring's table)."""

    __slots__ = ("world_size", "size", "_decode")

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"a control tail needs a world size of at least 1, got {world_size}")
        w = world_size
        self.world_size = w
        self.size = N_SCALARS + len(PER_RANK) * w  # the control scalars; the buffers' updates follow
        where = {f: i for i, f in enumerate(SCALARS)}
        where.update({f: slice(N_SCALARS + k * w, N_SCALARS + (k + 1) * w) for k, f in enumerate(PER_RANK)})
        self._decode = tuple(where[f] for f in Control._fields)  # Summed's fields, in order

    def encode(self, rank: int, c: Control) -> torch.Tensor:
        """Rank `rank`'s part as the float32 control tail (zeros in the others' slots)."""
        w = self.world_size
        values = [float(c[i]) for i in _SCALAR_AT] + [0.0] * (len(PER_RANK) * w)
        for k, i in enumerate(_PER_RANK_AT):
            values[N_SCALARS + k * w + rank] = float(c[i])
        return torch.tensor(values, dtype=torch.float32)

    def decode(self, tail: torch.Tensor) -> Summed:
        """The summed control tail (the first `size` elements of `tail`, a CPU tensor)."""
        v = tail[:self.size].tolist()
        return Summed(*[v[at] for at in self._decode])


def set_averaging(tail: torch.Tensor, busy: bool) -> None:
    """Write this rank's `averaging` field into its encoded tail in place (local.py's
    finish, just before the tail's all-reduce: 1.0 while its overlapped averaging is on
    the wire)."""
    tail[AVERAGING] = 1.0 if busy else 0.0


@functools.lru_cache(maxsize=64)
def layout(world_size: int) -> TailLayout:
    """The layout of `world_size`'s tail, computed once per world size."""
    return TailLayout(world_size)

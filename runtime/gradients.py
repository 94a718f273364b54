"""The gradient all-reduce: flat buffers per dtype, one global bucket order, and buffers' agreement.

Gradients live in one flat buffer per parameter dtype (each parameter's `.grad`
is a view into its dtype's buffer, as DDP's gradient_as_bucket_view), in reverse
parameter order, the order backward produces them. The buckets are cut over all
dtypes in that one order: a bucket closes once it holds `bucket_bytes`, or where
the next gradient has another dtype (a bucket never spans dtypes). Every rank
launches the same buckets in the same order, whatever backward did on it.

The step's control scalars and the module buffers' updates form a float32 tail
(never fp16/bf16: it carries sample counts and the loss sum). It rides with the
last bucket when that bucket is float32 (the tail follows the float32
gradients in their buffer); otherwise it goes as one extra small float32
all-reduce after the last bucket.

Buffers (`BufferSync`): every rank starts a step from the same agreed buffers
(`mark`); the step's forward passes move them locally; each rank adds
`local_samples * (value - agreed)` to the tail, and afterwards every rank sets
`agreed + sum / global_samples`. For BatchNorm running statistics that is the
sample-weighted mean of the ranks' updates (a rank with no samples ran no
forward and adds nothing); a buffer no forward changes stays bit for bit what
it was. Non-floating buffers (`num_batches_tracked`) take rank 0's update.
A step that is dropped puts the agreed values back (`reset`).

The planning functions are pure and tested by tables.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable

import torch

N_CTRL = 4  # pending, stop, local sample count, local loss sum; then one leave flag per rank
TAIL_DTYPE = torch.float32
_TAIL_KIND = str(TAIL_DTYPE)


@dataclass(frozen=True)
class Slot:
    """Where one parameter's gradient lives: group (its dtype's buffer), offset, numel."""

    group: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """One all-reduce: [start, end) of its group's buffer and the parameters in it."""

    group: int
    start: int
    end: int
    members: tuple[int, ...]


@dataclass(frozen=True)
class GradLayout:
    groups: tuple[str, ...]  # the dtype (str(torch.dtype)) of each flat buffer
    lengths: tuple[int, ...]  # gradient elements in each group's buffer
    slots: tuple[Slot, ...]  # per parameter
    buckets: tuple[Bucket, ...]  # in launch order

    @property
    def tail_group(self) -> int | None:
        """The group whose buffer carries the tail after its gradients (the last
        bucket's, if it is float32), or None: the tail is an extra all-reduce."""
        if self.buckets and self.groups[self.buckets[-1].group] == _TAIL_KIND:
            return self.buckets[-1].group
        return None


def plan_layout(kinds: list[str], numels: list[int], elem_sizes: list[int], bucket_bytes: int) -> GradLayout:
    """The buffers and buckets for parameters of dtypes `kinds` (pure).

    Gradients are laid out in reverse parameter order; a bucket closes once it
    holds at least `bucket_bytes` bytes (the last may be smaller) or where the
    next gradient's dtype differs."""
    groups: list[str] = []
    lengths: list[int] = []
    slots: list[Slot | None] = [None] * len(numels)
    buckets: list[Bucket] = []
    open_group, start, size, members = -1, 0, 0, []

    def close() -> None:
        if members:
            buckets.append(Bucket(open_group, start, lengths[open_group], tuple(members)))

    for i in reversed(range(len(numels))):
        if kinds[i] not in groups:
            groups.append(kinds[i])
            lengths.append(0)
        g = groups.index(kinds[i])
        if g != open_group:
            close()
            open_group, start, size, members = g, lengths[g], 0, []
        slots[i] = Slot(g, lengths[g], numels[i])
        lengths[g] += numels[i]
        size += numels[i] * elem_sizes[i]
        members.append(i)
        if size >= bucket_bytes:
            close()
            start, size, members = lengths[g], 0, []
    close()
    return GradLayout(tuple(groups), tuple(lengths), tuple(slots), tuple(buckets))  # type: ignore[arg-type]


def bucket_layout(numels: list[int], bucket_elems: int) -> tuple[list[tuple[int, int]], list[tuple[int, int, tuple[int, ...]]]]:
    """The one-dtype case of plan_layout in plain tuples: (offset, numel) per
    parameter and (start, end, parameter indices) per bucket, in launch order
    (no parameters: one empty bucket)."""
    lay = plan_layout(["x"] * len(numels), numels, [1] * len(numels), bucket_elems)
    buckets = [(b.start, b.end, b.members) for b in lay.buckets] or [(0, 0, ())]
    return [(s.offset, s.numel) for s in lay.slots], buckets


def layout_for(params: list[torch.Tensor], bucket_mb: float) -> GradLayout:
    """The layout of `params`' gradients with buckets of about `bucket_mb` (0: one bucket per dtype)."""
    bucket_bytes = max(1, int(bucket_mb * 2**20)) if bucket_mb > 0 else sys.maxsize
    return plan_layout([str(p.dtype) for p in params], [p.numel() for p in params],
                       [p.element_size() for p in params], bucket_bytes)


class BufferSync:
    """Agreement on the module buffers through the gradient all-reduce's tail (module docstring)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        named = list(module.named_buffers())
        self._floats = [n for n, b in named if b.is_floating_point()]
        self._others = [n for n, b in named if not b.is_floating_point() and not b.is_complex()]
        sizes = dict((n, b.numel()) for n, b in named)
        self.n_float = sum(sizes[n] for n in self._floats)
        self.size = self.n_float + sum(sizes[n] for n in self._others)
        self._agreed: list[torch.Tensor] | None = None

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # Looked up each time: module.to() and load_state_dict(assign=True) replace them.
        b = dict(self._module.named_buffers())
        return [b[n] for n in self._floats], [b[n] for n in self._others]

    def mark(self) -> None:
        """The current buffers are the agreed ones (identical on every rank)."""
        floats, others = self._tensors()
        self._agreed = [t.detach().clone() for t in floats + others]

    def reset(self) -> None:
        """Back to the agreed buffers (a dropped step's forward moved them)."""
        if self._agreed is None:
            return
        floats, others = self._tensors()
        with torch.no_grad():
            for t, a in zip(floats + others, self._agreed):
                t.copy_(a)

    def write(self, out: torch.Tensor, local_samples: int, rank: int) -> None:
        """This rank's contribution into `out` (float32, `size` elements)."""
        if self.size == 0:
            return
        floats, others = self._tensors()
        agreed = self._agreed or [t.detach().clone() for t in floats + others]
        with torch.no_grad():
            pos = 0
            for t, a in zip(floats, agreed):
                k = t.numel()
                out[pos:pos + k].copy_(((t.detach() - a) * local_samples).reshape(-1))
                pos += k
            for t, a in zip(others, agreed[len(floats):]):
                k = t.numel()
                if rank == 0:
                    out[pos:pos + k].copy_((t.detach().to(torch.float64) - a.to(torch.float64)).reshape(-1))
                else:
                    out[pos:pos + k].zero_()
                pos += k

    def read(self, summed: torch.Tensor, global_samples: int) -> None:
        """Adopt the agreed update from the all-reduced tail section (on any
        device), and mark it."""
        if self.size == 0:
            return
        floats, others = self._tensors()
        agreed = self._agreed or [t.detach().clone() for t in floats + others]
        with torch.no_grad():
            pos = 0
            for t, a in zip(floats, agreed):
                k = t.numel()
                if global_samples > 0:
                    delta = summed[pos:pos + k].to(t.device, t.dtype).view_as(t) / global_samples
                    t.copy_(a + delta)
                else:
                    t.copy_(a)
                pos += k
            for t, a in zip(others, agreed[len(floats):]):
                k = t.numel()
                delta = summed[pos:pos + k].to(t.device, torch.float64).round().view_as(t)
                t.copy_((a.to(torch.float64) + delta).to(t.dtype))
                pos += k
        self.mark()


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True if no element is inf or NaN (one reduction per tensor)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())

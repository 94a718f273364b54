"""The gradient path: the seam between a step and how its gradients are reduced
and applied, and its replicated implementation (flat buffers per dtype, one global
bucket order, buffers' agreement).

The seam (`GradientPath`)
-------------------------
ElasticJob's step (job.py) calls only these methods, in this order, so the step
reads the same whatever the path (`ElasticJob(shard=None)`: `ReplicatedPath`,
here; a sharded path, runtime/train/zero/, implements the same class)::

    per generation   bind(pg, rank, members, abort)        the generation's group (before the state agrees)
                     settle(step_here, step_agreed)        once the ranks' steps are known, before any state
                                                           is sent: resolve a step dropped halfway (sharded:
                                                           undo or keep it; replicated: no-op)
                     reshard(old_members, new_members)     after the state agreed (replicated: no-op)
    per step         [begin_round() / finish_round()]      around each earlier micro-batch's backward,
                                                           [empty_round()] for each this rank lacks,
                                                           only where reduces_micro_batches (ZeRO-2)
                     begin(tail_size)                      before the last micro-batch's backward:
                                                           bind .grad, arm the hooks
                     grad_ready(index, param)              post-accumulate-grad hook of parameter `index`
                                                           (ElasticJob registers it): launch what is ready
                     end_backward()                        backward of the last micro-batch is over
                     tail()                                float32, tail_size elements: the step writes
                                                           its control tail (tail.py: the layout) and the
                                                           buffers' updates there
                     finish(abort) -> tail                 launch the rest, wait for all (Aborted on a
                                                           broken group); the SUM of every rank's tail,
                                                           a CPU copy
                     unscale_(scaler, optimizer)           GradScaler: unscale this rank's gradients
                     clip_grad_norm_(max_norm, abort)      the GLOBAL norm (across shards), clipped
                     step(optimizer, scaler, abort)        the optimizer step; True if skipped (inf/NaN
                                                           in ANY rank's gradients: every rank skips)
                     zero()                                gradients to zero (after a commit or a redo)
                     drop()                                a dropped step: never reuse the buffers
    state            capture(...) / apply(...) /           the full training state as data (state.py),
                     fingerprint(...)                      what a joiner receives and a checkpoint holds;
                                                           a sharded path gathers / scatters its shards

ElasticJob builds its path with `job._gradient_path(shard, ...)`: `shard=None` is
`ReplicatedPath(params, bucket_mb)`; "optimizer" / "gradients" import
`zero.sharded_path(shard, model, optimizer, params, bucket_mb) -> GradientPath`.
ElasticJob sets `path.device` once the model is on its device (before `bind`).

`finish`, `clip_grad_norm_` and `step` may raise collectives.Aborted (a broken
group): ElasticJob then drops the step (`drop`, the module buffers back to the
agreed ones) and the roll call follows, so a path that raises must leave the
parameters and the optimizer state as they were before the step.

Every rank calls the same methods in the same order; `finish` must issue the same
collectives on every rank whatever backward did there (unused parameters, a rank
with no samples). `params` are the model's parameters that require a gradient,
in model order (the index `grad_ready` receives).

The replicated path
-------------------
Gradients live in one flat buffer per parameter dtype (each parameter's `.grad`
is a view into its dtype's buffer, as DDP's gradient_as_bucket_view), in reverse
parameter order, the order backward produces them. The buckets are cut over all
dtypes in that one order: a bucket closes once it holds `bucket_bytes`, or where
the next gradient has another dtype (a bucket never spans dtypes). Every rank
launches the same buckets in the same order, whatever backward did on it.

The step's control scalars (tail.py owns their layout) and the module buffers'
updates form a float32 tail (never fp16/bf16: it carries sample counts and the loss sum). It rides with the
last bucket when that bucket is float32 (the tail follows the float32
gradients in their buffer); otherwise it goes as one extra small float32
all-reduce after the last bucket.

bf16 on the wire (`ElasticJob(grad_dtype="bf16")`): each float32 bucket is
copied into a bfloat16 buffer as it launches and that copy is all-reduced (half
the bytes); `finish` casts each summed bucket back into the float32 gradient
once, after the reduction, so the optimizer, clipping and the GradScaler's
check see float32 as ever. The backend sums in bfloat16 (the inputs' 8-bit
significands, and each partial sum rounded to one). The tail is never
compressed: it goes as its own float32 all-reduce. Nothing is kept from one step to
the next (no error feedback), so a resize, a drop or a restore has nothing of it
to move; sharded paths refuse it (job.py).

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

import math
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch

from ..member import collectives
from .zero import hostmem
from . import state as state_mod
from ..member.collectives import Aborted
from .tail import layout as tail_layout

TAIL_DTYPE = torch.float32
# Spare tail elements in the flat buffer that carries it (ReplicatedPath._reserve): the
# slots of 100 more ranks (tail.py: a few per rank) before a resize reallocates.
TAIL_ROOM = 1024
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


@dataclass(frozen=True)
class StepTiming:
    """One committed step's network figures, as the gradient path saw them (read-only).

    `wait_s`: the time `finish` spent on the step's all-reduces after backward, the
    part that overlapping them with backward did not hide; measured on the host
    (no device synchronize is added), it also holds the wait for the slowest rank and,
    on CUDA, the device's backward still queued when the host's backward returned.
    `bytes`: what this rank put into all-reduces in the step: every bucket's
    elements times its element size, plus the float32 tail."""

    wait_s: float
    bytes: int


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


GRAD_DTYPES = ("fp32", "bf16")  # ElasticJob(grad_dtype=): what float32 gradients travel as (None: "fp32")


def wire_dtype(grad_dtype: str | None) -> torch.dtype | None:
    """The dtype float32 buckets are all-reduced in for `grad_dtype`, None: as they are."""
    if grad_dtype not in (None, *GRAD_DTYPES):
        raise ValueError(f"grad_dtype must be None or one of {', '.join(map(repr, GRAD_DTYPES))}, "
                         f"got {grad_dtype!r}")
    return torch.bfloat16 if grad_dtype == "bf16" else None


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

    def _sections(self) -> Iterator[tuple[bool, torch.Tensor, torch.Tensor, slice]]:
        """(a float buffer?, the buffer, its agreed value, its slice of the tail
        section) for each buffer, the float ones first: the section's layout."""
        floats, others = self._tensors()
        agreed = self._agreed or [t.detach().clone() for t in floats + others]
        pos = 0
        for i, (t, a) in enumerate(zip(floats + others, agreed)):
            k = t.numel()
            yield i < len(floats), t, a, slice(pos, pos + k)
            pos += k

    def write(self, out: torch.Tensor, local_samples: int, rank: int) -> None:
        """This rank's contribution into `out` (float32, `size` elements)."""
        if self.size == 0:
            return
        with torch.no_grad():
            for is_float, t, a, at in self._sections():
                if is_float:
                    out[at].copy_(((t.detach() - a) * local_samples).reshape(-1))
                elif rank == 0:
                    out[at].copy_((t.detach().to(torch.float64) - a.to(torch.float64)).reshape(-1))
                else:
                    out[at].zero_()

    def read(self, summed: torch.Tensor, global_samples: int) -> None:
        """Adopt the agreed update from the all-reduced tail section (on any
        device), and mark it."""
        if self.size == 0:
            return
        with torch.no_grad():
            for is_float, t, a, at in self._sections():
                if not is_float:
                    delta = summed[at].to(t.device, torch.float64).round().view_as(t)
                    t.copy_((a.to(torch.float64) + delta).to(t.dtype))
                elif global_samples > 0:
                    t.copy_(a + summed[at].to(t.device, t.dtype).view_as(t) / global_samples)
                else:
                    t.copy_(a)
        self.mark()


NORM_PIECE = 1 << 21  # elements per float64 temporary of the clipping norm (16 MiB)


def add_squares(acc: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """`acc` (a float64 scalar on the tensors' device) += the sum of the squares of every
    element of `tensors`, accumulated in float64, piece by piece (NORM_PIECE elements: a
    bounded temporary). The clipping norm of both gradient paths, so that replicated and
    sharded training clip alike: torch's float32 norm on the CPU lost 0.4 % of the norm of
    50 M float32 elements here (torch.linalg.vector_norm, one thread; 1.1e-4 on the toy
    MLP's 8.6 M gradients), where clipping is meant to be exact."""
    for t in tensors:
        flat = t.reshape(-1)
        for i in range(0, flat.numel(), NORM_PIECE):
            acc += torch.sum(flat[i:i + NORM_PIECE].to(torch.float64, copy=True).square_())


def clip_coefficient(max_norm: float, sum_sq: float) -> tuple[float, float]:
    """The global norm from its sum of squares and the factor clipping multiplies every
    gradient by, as torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), at most 1.
    A non-finite sum (an inf or NaN gradient) gives the norm inf and the factor 0."""
    norm = math.sqrt(sum_sq) if math.isfinite(sum_sq) else float("inf")
    return norm, min(1.0, max_norm / (norm + 1e-6))


def clip_global_norm_(grads: list[torch.Tensor], max_norm: float) -> float:
    """Clip `grads` (one rank's whole gradient, all on one device) in place by their
    global norm (add_squares, clip_coefficient); returns the norm before clipping."""
    if not grads:
        return 0.0
    acc = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    with torch.no_grad():
        add_squares(acc, grads)
        norm, coef = clip_coefficient(max_norm, float(acc))
        for g in grads:
            g.mul_(coef)
    return norm


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True if no element is inf or NaN (one reduction per tensor)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())


# ---------------------------------------------------------------------------- the seam


class GradientPath(ABC):
    """How a step's gradients are reduced and applied (the module docstring gives
    the call order). Implementations: ReplicatedPath (here), the sharded one in
    zero/."""

    def bind(self, pg, rank: int, members: Sequence[str], abort: threading.Event) -> None:
        """The generation's group, this rank and the members in rank order (before
        the state is agreed in it)."""
        self.pg, self.rank, self.members, self.abort = pg, rank, tuple(members), abort

    gathers = False  # True: capture_full and fingerprint are collectives every rank calls (sharded)
    # True: each micro-batch before the step's last is reduced too (ZeRO-2 with
    # ElasticJob(reduce_each_micro_batch=True)): the job agrees on the step's number of
    # micro-batches and calls begin_round / finish_round around each backward before the
    # last, and empty_round for each micro-batch this rank has fewer than another.
    # False: the gradients of those micro-batches accumulate locally.
    reduces_micro_batches = False
    # The last finished step's network figures (StepTiming), for the status document's
    # `network`; None where the path does not measure them (the sharded path, zero/).
    last_step_timing: StepTiming | None = None

    def begin_round(self) -> None:
        """Before the backward of a micro-batch that is not the step's last (reduces_micro_batches)."""
        raise NotImplementedError("this gradient path accumulates micro-batches locally")

    def finish_round(self) -> None:
        """After that backward: reduce what it produced into this rank's part (every rank alike)."""
        raise NotImplementedError("this gradient path accumulates micro-batches locally")

    def empty_round(self) -> None:
        """A round without a backward: this rank's share has fewer micro-batches than another's."""
        self.begin_round()
        self.finish_round()

    def reshard(self, old_members: Sequence[str], new_members: Sequence[str]) -> None:
        """After a membership change, once the state is agreed: move what each rank
        owns to its new owners (old_members is empty for the first generation)."""

    def prepare_join(self, world: int, stop: threading.Event, prepared: threading.Event | None = None) -> None:
        """A joiner about to ask to be admitted to a job that will then have `world` members:
        prepare what its first layout needs (sharded: its host memory, zero/); runs on a
        helper thread, in slices until `stop` is set, sets `prepared` once it is ready (the
        joiner asks then) and holds what it prepared until `stop`. Replicated: nothing."""

    def ready_for_join(self, world: int) -> bool:
        """A joiner is queued and the next layout will have `world` members: False while
        this rank still prepares for it (sharded: touches the host memory of its move, on a
        helper thread, zero/); the job holds the join back meanwhile. Replicated: True."""
        return True

    def ready_for_leave(self, leaving: Sequence[str]) -> bool:
        """The last commit asked for `leaving` to leave (empty: no leave is known yet):
        False while this rank still prepares for the survivors' layout (sharded on the
        CPU: touches the host memory its hand-over allocates, on a helper thread started
        at the first call, zero/; with nothing known yet it cannot, so a leave waits
        one commit there); the job holds the leave back meanwhile. Replicated: True (a
        leave goes at the commit that first sees it)."""
        return True

    def hand_over(self, left: Sequence[str]) -> None:
        """A planned leave, over the old group, before it goes (every old member
        calls it, the leavers too): the leavers' part moves to the survivors."""

    def settle(self, committed_before: int, committed_now: int) -> None:
        """Once every rank's committed step is known (this rank is at `committed_before`,
        the newest holding the state at `committed_now`), before this rank's state is sent
        to anyone and before reshard: resolve a step this rank dropped halfway through its
        optimizer step (sharded: after the shard stepped, before the parameters were
        gathered; its GradScaler update is kept or undone with it). Replicated: nothing is
        ever halfway."""

    def state_lost(self, lost: Sequence[str]) -> bool:
        """True if the loss of `lost` (crashed, or back without their state) took part
        of the state with it (the newest checkpoint is restored instead)."""
        return False

    def state_key(self) -> int | None:
        """Which state this rank's part is, for the generation's agreement: ranks
        holding parts must hold parts of the same whole (job._sync_state); 0 where a
        rank holding the state holds all of it (replicated). None: this rank lacks
        its part (it must receive the state again). Sharded: ShardedPath.state_key."""
        return 0

    @abstractmethod
    def begin(self, tail_size: int) -> None: ...

    @abstractmethod
    def grad_ready(self, index: int, p: torch.Tensor) -> None: ...

    def failed(self) -> BaseException | None:
        """A reduction launched in this backward has already failed (checked without
        waiting): the step is doomed, so backward can stop (job._grad_ready)."""
        return None

    @abstractmethod
    def end_backward(self) -> None: ...

    @abstractmethod
    def tail(self) -> torch.Tensor: ...

    @abstractmethod
    def finish(self, abort: threading.Event) -> torch.Tensor: ...

    @abstractmethod
    def unscale_(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None: ...

    @abstractmethod
    def clip_grad_norm_(self, max_norm: float, abort: threading.Event) -> float: ...

    @abstractmethod
    def step(self, optimizer: torch.optim.Optimizer, scaler: Any, abort: threading.Event) -> bool: ...

    @abstractmethod
    def zero(self) -> None: ...

    @abstractmethod
    def drop(self) -> None: ...

    def capture(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: dict,
                extra: dict[str, Any]) -> dict:
        """The whole training state as data (state.capture)."""
        return state_mod.capture(model, optimizer, progress, extra)

    def apply(self, saved: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              extra: dict[str, Any]) -> dict:
        """Adopt a captured state; returns its progress (state.apply)."""
        return state_mod.apply(saved, model, optimizer, extra)

    def capture_full(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: dict,
                     extra: dict[str, Any]) -> dict:
        """The whole state as one plain dict, for a checkpoint (a sharded path gathers it)."""
        return self.capture(model, optimizer, progress, extra)

    def fingerprint(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> str:
        """Hash of the whole state: identical on every rank (state.fingerprint)."""
        return state_mod.fingerprint(model, optimizer, extra)


class ReplicatedPath(GradientPath):
    """Every rank holds every gradient: bucketed all-reduces launched as backward
    fills the buckets (module docstring)."""

    # While a rank catches up in the background (catchup.py, synchronous steps): the job's
    # CatchUp, called at the step's start (poll), its first launch (the link is busy until
    # the summed tail: the transfer's chunks wait), its summed tail, and in place of the
    # optimizer step (a joiner keeps what the step consumes); None otherwise (a look only).
    catchup: Any = None

    def __init__(self, params: list[torch.Tensor], bucket_mb: float,
                 device: torch.device = torch.device("cpu"), grad_dtype: str | None = None) -> None:
        self._params = params
        self.device = device  # where the buffers live (ElasticJob sets it once the model is placed)
        # One flat buffer per parameter dtype, one bucket order over all of them;
        # 0 MB: one bucket per dtype, all-reduced after backward.
        self.layout = layout_for(params, bucket_mb)
        for kind in self.layout.groups:
            state_mod.dtype_named(kind)  # a dtype the buffers cannot hold fails here, naming it
        self._bucket_of = {i: b for b, bucket in enumerate(self.layout.buckets) for i in bucket.members}
        # bf16 on the wire (module docstring): float32 buckets go through a bfloat16 copy
        # (`_wire`, one per float32 buffer); the tail never does, so it goes on its own.
        self._wire_dtype = wire_dtype(grad_dtype)
        self._tail_group = self.layout.tail_group if self._wire_dtype is None else None
        self._wire: list[torch.Tensor | None] | None = None
        self._casts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (float32 bucket, its wire copy) this step
        # The last launch carries the float32 tail: the last bucket, or an extra one.
        self._n_launch = len(self.layout.buckets) + (0 if self._tail_group is not None else 1)
        self._flats: list[torch.Tensor] | None = None  # views of _stores: the gradients, then the tail
        self._stores: list[torch.Tensor] | None = None  # the buffers' memory, with room for a larger tail
        self._tail_buf: torch.Tensor | None = None  # the tail's own buffer when it does not ride with a bucket
        self._tail_size = 0
        self._launching = False  # inside the backward of a step's last micro-batch
        self._ready: list[int] = []  # per bucket: gradients ready in this backward
        self._fired: set[int] = set()  # parameters whose gradient is ready in this backward
        self._works: list = []  # the all-reduces launched for this step, in bucket order
        self._launch_error: Exception | None = None
        self._ok_upto, self._watch_failures = 0, False  # failed()
        self.pg = None
        # Gradient bytes all-reduced per step (every bucket once); finish adds the tail's.
        self._grad_bytes = sum(p.numel() * (self._wire_dtype.itemsize if self._wire_dtype is not None
                                            and p.dtype == TAIL_DTYPE else p.element_size()) for p in params)

    def _buffers(self, tail_size: int) -> list[torch.Tensor]:
        """The flat all-reduce buffers, one per parameter dtype (bucket by
        bucket), the float32 one followed by the tail when it rides with the
        last bucket. Parameters' .grad are views into them (as DDP's
        gradient_as_bucket_view), so backward accumulates in place and nothing
        is copied in or out."""
        lay, sizes = self.layout, self._reserve(tail_size)
        self._tail_size = tail_size
        if self._flats is None or [f.numel() for f in self._flats] != sizes:
            # A world size's tail is a view of the same memory: the gradients' views stay.
            self._flats = [store[:n] for store, n in zip(self._stores, sizes)]
        if self._tail_group is None and (self._tail_buf is None or self._tail_buf.numel() != tail_size):
            self._tail_buf = torch.zeros(tail_size, dtype=TAIL_DTYPE, device=self.device)
        if self._wire_dtype is not None and self._wire is None:
            self._wire = [torch.empty(n, dtype=self._wire_dtype, device=self.device) if kind == _TAIL_KIND else None
                          for kind, n in zip(lay.groups, lay.lengths)]
        return self._flats

    def _reserve(self, tail_size: int) -> list[int]:
        """Each flat buffer's length with a tail of `tail_size`, its memory (`_stores`,
        zeroed) holding it, with room for a tail of twice `tail_size` plus TAIL_ROOM
        elements where the tail rides with a bucket: a new world size's tail (its per-rank
        slots) is a view of the same memory, so a membership change reallocates nothing
        (the 50 M-parameter model's 200 MB, allocated, faulted in and copied into at the
        new generation's first step, were 0.2-1.3 s of each member's CPU in a join's pause
        on the bed)."""
        lay = self.layout
        sizes = [n + (tail_size if g == self._tail_group else 0) for g, n in enumerate(lay.lengths)]
        if self._stores is None or any(s.numel() < n for s, n in zip(self._stores, sizes)):
            # The caller copies the current gradients in (they are not views of these).
            self._flats, room = None, tail_size + TAIL_ROOM
            self._stores = [self._zeros(n + (room if g == self._tail_group else 0), kind)
                            for g, (kind, n) in enumerate(zip(lay.groups, sizes))]
        return sizes

    def _zeros(self, n: int, kind: str) -> torch.Tensor:
        dtype = state_mod.dtype_named(kind)
        if self.device.type == "cpu":
            return hostmem.empty(n, dtype).zero_()
        return torch.zeros(n, dtype=dtype, device=self.device)

    def prepare_join(self, world: int, stop: threading.Event, prepared: threading.Event | None = None) -> None:
        """A joiner, before it asks to be admitted: its flat buffers allocated and
        faulted in now (the helper thread of life.preparing_join), not in its first step,
        where its CPU would hold up the members' first all-reduce on shared cores. The
        tail's size is not known yet; TAIL_ROOM covers it."""
        self._reserve(tail_layout(world).size)
        if prepared is not None:
            prepared.set()

    def begin(self, tail_size: int) -> None:
        """Bind every .grad to its view of its dtype's flat buffer (so backward
        accumulates in place) and arm the gradient hooks for this backward."""
        flats = self._buffers(tail_size)
        with torch.no_grad():
            for p, slot in zip(self._params, self.layout.slots):
                view = flats[slot.group][slot.offset : slot.offset + slot.numel]
                if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                    continue
                view = view.view_as(p)
                if p.grad is None:
                    view.zero_()
                else:  # the script replaced .grad (e.g. zero_grad), or a new buffer after a resize
                    view.copy_(p.grad)
                p.grad = view
        self._ready = [0] * len(self.layout.buckets)
        self._fired = set()
        self._works = []
        self._casts = []
        self._launch_error = None
        self._ok_upto = 0  # works before this one are known to have succeeded (failed())
        # failed() looks on gloo only: on NCCL reading a work's future makes the compute stream wait for it
        self._watch_failures = collectives.is_gloo(self.pg)
        self._launching = True
        if self.catchup is not None:
            self.catchup.poll()  # a joiner whose state arrived takes it up and says so in this step's tail

    def end_backward(self) -> None:
        self._launching = False

    def failed(self) -> BaseException | None:
        if self._launch_error is not None:
            return self._launch_error
        if not self._watch_failures:
            return None
        self._ok_upto, error = collectives.first_failure(self._works, self._ok_upto)
        return error

    def grad_ready(self, index: int, p: torch.Tensor) -> None:
        """Launch every bucket that is complete, in the one global bucket order
        (every rank issues the same collectives in the same order). The last
        launch, which carries the float32 tail, is left to finish."""
        if not self._launching or index in self._fired:
            return
        self._fired.add(index)
        slot = self.layout.slots[index]
        view = self._flats[slot.group][slot.offset : slot.offset + slot.numel]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            with torch.no_grad():  # not a view (should not happen): reduce a copy and adopt the view
                view.view_as(p).copy_(p.grad)
                p.grad = view.view_as(p)
        self._ready[self._bucket_of[index]] += 1
        buckets = self.layout.buckets
        while len(self._works) < self._n_launch - 1:
            b = len(self._works)
            if self._ready[b] < len(buckets[b].members):
                break
            self._launch(b)

    def _launch(self, b: int) -> None:
        """All-reduce launch `b`: bucket b, the last one with the tail after it
        when the tail rides with it, or (b past the buckets) the tail alone."""
        buckets = self.layout.buckets
        if b < len(buckets):
            bucket = buckets[b]
            end = bucket.end
            if b == len(buckets) - 1 and self._tail_group is not None:
                end = self._flats[bucket.group].numel()
            tensor = self._flats[bucket.group][bucket.start : end]
            wire = self._wire[bucket.group] if self._wire is not None else None
            if wire is not None:  # bf16 on the wire: reduce a bfloat16 copy, cast back in finish
                wire = wire[bucket.start : end]
                wire.copy_(tensor)
                self._casts.append((tensor, wire))
                tensor = wire
        else:
            tensor = self._tail_buf
        if b == 0 and self.catchup is not None:
            self.catchup.link.busy()  # a joiner's state holds its chunks back until finish (catchup.py)
        try:
            self._works.append(collectives.allreduce_async(self.pg, tensor))
        except Exception as e:  # noqa: BLE001 - a broken group: the step is dropped in finish
            self._launch_error = e
            self._works.append(None)

    def tail(self) -> torch.Tensor:
        """The float32 tail: control scalars, then the buffers' updates."""
        g = self._tail_group
        if g is None:
            return self._tail_buf
        return self._flats[g][self.layout.lengths[g]:]

    def finish(self, abort: threading.Event) -> torch.Tensor:
        # Buckets whose gradients never came (parameters unused in this step, a
        # rank with no samples) go now, in order; then the last one, with the tail.
        t0 = time.perf_counter()  # the network wait starts (StepTiming)
        while len(self._works) < self._n_launch:
            self._launch(len(self._works))
        if self._launch_error is not None:
            raise Aborted(f"an all-reduce could not be launched: {self._launch_error}", backend_error=True)
        for work in self._works:
            collectives.wait_work(work, abort)
        for grad, wire in self._casts:  # bf16 on the wire: the sums back into the float32 gradients, once
            grad.copy_(wire)
        self._casts = []
        self._works = []  # all done (drop looks at those of a step that broke)
        tail = self.tail().to("cpu", copy=True)  # the buffers are zeroed after the step
        self.last_step_timing = StepTiming(time.perf_counter() - t0,
                                           self._grad_bytes + self._tail_size * TAIL_DTYPE.itemsize)
        if self.catchup is not None:
            self.catchup.tail_summed(tail)  # joiners that took up the state train from the next step
        return tail

    def unscale_(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        scaler.unscale_(optimizer)

    def clip_grad_norm_(self, max_norm: float, abort: threading.Event) -> float:
        """Every rank holds the whole all-reduced gradient: the local norm is the global
        one, in float64 (add_squares) over the flat buffers, as the sharded path's."""
        return clip_global_norm_([f[:n] for f, n in zip(self._flats, self.layout.lengths)], max_norm)

    def step(self, optimizer: torch.optim.Optimizer, scaler: Any, abort: threading.Event) -> bool:
        """Every rank holds the same all-reduced gradients, so every rank decides alike."""
        c = self.catchup
        if c is not None and c.replaces_step(self, optimizer):
            return False  # a joiner catching up: it keeps what the step consumes instead
        if scaler is None:
            optimizer.step()
            skipped = False
        else:
            finite = all_finite(f[:n] for f, n in zip(self._flats, self.layout.lengths))
            scaler.step(optimizer)
            scaler.update()
            skipped = not finite
        if c is not None:
            c.stepped()  # the source: a newer copy asked for is taken now
        return skipped

    def gradient_copy(self) -> list[torch.Tensor]:
        """The whole gradient as the optimizer step reads it (all-reduced, unscaled,
        clipped): one host copy per dtype buffer, the tail left out (catchup.py)."""
        return [hostmem.empty(n, f.dtype).copy_(f[:n]) for f, n in zip(self._flats, self.layout.lengths)]

    def zero(self) -> None:
        for flat in self._flats or ():
            flat.zero_()  # the gradients stay views of the buffers: next backward accumulates in place

    def drop(self) -> None:
        # A collective that never finished may still write into the buffers: never reuse them.
        # Where every one launched has completed (succeeded or failed), they are kept: begin()
        # zeroes the gradients' views again (the job sets .grad to None), the tail here.
        settled = collectives.settled(self._works)
        self._works, self._launching, self._casts = [], False, []
        if settled and self._flats is not None:
            with torch.no_grad():
                self.tail().zero_()
            return
        self._flats = self._stores = None
        self._tail_buf = None
        self._wire = None

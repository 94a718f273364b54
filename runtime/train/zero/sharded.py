"""Sharded optimizer state (ZeRO-1 and ZeRO-2) whose shards move live between members.

The layout (`plan_shards`, pure): the parameters' gradients are cut into the
same buckets as the replicated all-reduce (`gradients.plan_layout`, one global
order, buckets never span dtypes), with one flat buffer per (dtype, optimizer
param group). Each bucket is padded to a multiple of the world size W and split
into W equal chunks; chunk j of every bucket belongs to rank j, so a rank owns
one contiguous range of each bucket, which is what `reduce_scatter_tensor` and
`all_gather_into_tensor` hand out and take back. With `shard_replicas=2` chunk j
is also held by one other rank (its backup), on another host where the hosts
allow; every rank then holds exactly two chunks. The layout depends only on the
parameters and the ordered member list, so every rank plans the same one
without talking to anyone.

`ShardedGradients` is the sharded gradient path of one rank:

- the model's parameters become views of one padded flat buffer per group (as
  FSDP's flat parameter), so the all-gather after the step writes them in place;
- `shard="optimizer"` (ZeRO-1): the gradients are all-reduced bucket by bucket
  as backward produces them (the replicated path's schedule), then each rank
  steps only the chunks it holds;
- `shard="gradients"` (ZeRO-2): each bucket is reduce-scattered as soon as
  backward completes it, straight into the rank's chunk; the parameters'
  gradients are freed as they are staged, so between steps a rank keeps only
  1/W of the gradients. A backup chunk's gradient comes from its primary by
  point-to-point;
- the step: the GradScaler's unscale on the shard, one 2-element all-reduce of
  (sum of squared gradient norms, inf/NaN found) over the primary chunks, so the
  global-norm clip and the skip decision are the same on every rank; the shard's
  optimizer step; the parameters all-gathered. Until that all-gather ends the
  held chunks' pre-step values and optimizer state are kept: a generation that
  breaks inside it (a rank lost there) leaves the chunks a step ahead of the
  parameters and the parameters half-gathered, and `settle` undoes (or keeps)
  that step in the next generation before `reshard` rebuilds the parameters.

The optimizer the script built is kept for its hyperparameters (a scheduler's
changes to lr are copied into the shard optimizer at every step) and never
stepped. AdamW, Adam, SGD, RMSprop, Adamax, RAdam and Adadelta are supported: their
updates are elementwise and their state per parameter is tensors shaped as it and a
step count, so a shard steps exactly as the replicated optimizer steps those elements.
Others are refused (`check_optimizer`).

Live resharding (`reshard`): given the old and the new layout and a group that
holds every rank involved (the old group for a planned leave, so the leaver can
hand its chunks over; the new group for a join or after a crash), every
(sender, receiver) pair exchanges one message with the optimizer-state slices
the receiver's new chunks need, each taken from a live old holder (a chunk's
primary, or its backup when the primary is gone), so the work is spread over
the members; a joiner also receives the parameters, chunk by chunk from their
holders. The transfer plan (`plan_transfers`) is pure.

Checkpoints: `shard_state_dict` is one rank's own part (plain tensors and JSON
scalars); `full_state_dict` gathers one plain state dict in the format of the
script's optimizer's `state_dict()`, which `load_full_state_dict` takes back at
any world size.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ...member import collectives
from .. import gradients, state as state_mod
from . import hostmem
from .hostmem import Recycler
from ..state import dtype_named

log = logging.getLogger("eltctl_runtime")

SHARD_MODES = ("optimizer", "gradients")
FORMAT = "eltctl-zero/1"
# The shard steps in pieces of at most this many elements (each a view of its chunk): the
# optimizer's temporaries (AdamW's denominator) stay this small, which the CPU allocator
# reuses, where one temporary the size of a whole chunk is a fresh mapping every step.
PIECE_ELEMS = 1 << 21
# ZeRO-2 on the CPU: staging buffers per dtype kept from step to step (a bucket's full gradient while it
# is reduced). A bucket waits for the oldest one in flight to be reduced when all are taken, so
# between steps a rank keeps these few buckets, not the full gradients; a buffer freed every
# step would come back from the OS at a page fault per 4 KiB, every step. On CUDA the caching
# allocator does this already: each bucket gets its own.
STAGING_BUFFERS = 3
# A large bucket pads to a multiple of this (lcm(1..8)) and of the world size, so its padded
# width, and the flat buffers, stay the same through membership changes among 1 to 8 ranks
# (_chunk); only buckets of at least PAD_MIN_QUANTA such multiples do (padding under 1/64).
PAD_QUANTUM = 840
PAD_MIN_QUANTA = 64
# How long a joiner keeps the memory it touched ahead while it waits to be admitted
# (ShardedPath.prepare_join): a joiner of a job with room is admitted at its next boundary.
JOINER_MEMORY_HOLD_S = 60.0
# How long the members of a running job hold a queued joiner back while they touch the host
# memory their next layout's move allocates (ShardedPath.ready_for_join): after this the
# join goes on with whatever is touched.
MEMBER_PREPARE_MAX_S = 10.0
# How long the survivors of a planned leave hold it back while they touch the host memory their
# hand-over allocates (ShardedPath.ready_for_leave): a leaver's owner is waiting, so it is short.
LEAVE_PREPARE_MAX_S = 2.0
# The tags of the parameters' point-to-point gather on gloo (GATHER_TAG + bucket); reshard's
# transfers use tag 0.
GATHER_TAG = 1 << 20
# Optimizers whose update is elementwise and whose state per parameter is tensors shaped as it
# (made at the first step) and a step count: a shard's step is the replicated step of its elements.
SUPPORTED_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD,
                        "RMSprop": torch.optim.RMSprop, "Adamax": torch.optim.Adamax, "RAdam": torch.optim.RAdam,
                        "Adadelta": torch.optim.Adadelta}
# Why the nearest others are not: what the refusal says.
_WHY_NOT = {"Adagrad": "its state is made when it is built, whole on every rank",
            "NAdam": "its state holds a per-parameter product (mu_product) beside the step count",
            "ZeroRedundancyOptimizer": "it shards the state itself; give the job the optimizer it wraps"}


class ShardsLost(RuntimeError):
    """A chunk the new layout needs has no live holder (a crash with
    shard_replicas=1): the optimizer state has to come from a checkpoint."""


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless the optimizer is one whose shards step alike."""
    if type(optimizer) not in SUPPORTED_OPTIMIZERS.values():
        name = type(optimizer).__name__
        why = f" ({_WHY_NOT[name]})" if name in _WHY_NOT else ""
        raise ValueError(f"sharded optimizer state supports {', '.join(SUPPORTED_OPTIMIZERS)} (exactly those "
                         f"classes, not subclasses); got {name}{why}. Use shard=None for other optimizers")
    for group in optimizer.param_groups:
        for flag in ("fused", "differentiable", "capturable"):
            if group.get(flag):
                raise ValueError(f"sharded optimizer state does not support {flag}=True: build the "
                                 f"{type(optimizer).__name__} without it")


# ---------------------------------------------------------------------------- layout (pure)


@dataclass(frozen=True)
class Member:
    """One worker of a layout: its stable id and its host (replicas avoid sharing one)."""

    id: str
    host: str


@dataclass(frozen=True)
class ShardBucket:
    """One reduce-scatter / all-gather: `numel` elements of its group from `start`
    (unpadded), padded to `chunk` * world from `pstart` of the padded buffer, with
    the parameters in it."""

    group: int
    start: int
    numel: int
    chunk: int
    pstart: int
    params: tuple[int, ...]

    def span(self, j: int) -> tuple[int, int]:
        """Chunk j's real elements, bucket-local [lo, hi) (empty for all-padding chunks)."""
        lo = min(j * self.chunk, self.numel)
        return lo, min(lo + self.chunk, self.numel)


@dataclass(frozen=True)
class ShardLayout:
    members: tuple[Member, ...]  # rank order
    replicas: int  # holders per chunk (min of the asked replicas and the world size)
    groups: tuple[tuple[str, int], ...]  # (dtype, optimizer param group) of each flat buffer
    slots: tuple[gradients.Slot, ...]  # per parameter: group, unpadded offset, numel
    buckets: tuple[ShardBucket, ...]  # launch order
    holders: tuple[tuple[int, ...], ...]  # per chunk j: the ranks holding it, primary (j) first

    @property
    def world(self) -> int:
        return len(self.members)

    def rank_of(self, member_id: str) -> int:
        for r, m in enumerate(self.members):
            if m.id == member_id:
                return r
        raise KeyError(member_id)

    def held(self, rank: int) -> tuple[int, ...]:
        """The chunks `rank` holds: its own first, then those it backs up, ascending."""
        return (rank,) + tuple(j for j, h in enumerate(self.holders) if rank in h[1:])

    def padded(self, g: int) -> int:
        return sum(b.chunk * self.world for b in self.buckets if b.group == g)

    def shard_len(self, g: int) -> int:
        """Elements of one chunk of group g over all its buckets (one held chunk's section)."""
        return sum(b.chunk for b in self.buckets if b.group == g)

    def chunk_offsets(self) -> tuple[int, ...]:
        """Per bucket: where its chunk starts in a section of its group."""
        seen: dict[int, int] = {}
        out = []
        for b in self.buckets:
            out.append(seen.get(b.group, 0))
            seen[b.group] = out[-1] + b.chunk
        return tuple(out)

    def same_parameters(self, other: "ShardLayout") -> bool:
        """True if both cut the same parameters into the same buckets (only the world differs)."""
        return (self.groups == other.groups and self.slots == other.slots
                and [(b.group, b.start, b.numel, b.params) for b in self.buckets]
                == [(b.group, b.start, b.numel, b.params) for b in other.buckets])

    def to_json(self) -> str:
        return json.dumps({
            "members": [[m.id, m.host] for m in self.members], "replicas": self.replicas,
            "groups": [list(g) for g in self.groups], "slots": [[s.group, s.offset, s.numel] for s in self.slots],
            "buckets": [[b.group, b.start, b.numel, b.chunk, b.pstart, list(b.params)] for b in self.buckets],
            "holders": [list(h) for h in self.holders]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ShardLayout":
        d = json.loads(text)
        return cls(tuple(Member(*m) for m in d["members"]), d["replicas"], tuple(tuple(g) for g in d["groups"]),
                   tuple(gradients.Slot(*s) for s in d["slots"]),
                   tuple(ShardBucket(g, s, n, c, p, tuple(m)) for g, s, n, c, p, m in d["buckets"]),
                   tuple(tuple(h) for h in d["holders"]))


def place_replicas(members: list[Member] | tuple[Member, ...], replicas: int) -> tuple[tuple[int, ...], ...]:
    """Holders of each chunk (pure). With 2 replicas the ranks are ordered host by
    host and each chunk's backup is the rank `m` places further on (m: the most
    ranks any host has), which lands on another host whenever no host has more
    than half the ranks; every rank backs up exactly one chunk."""
    world = len(members)
    if replicas not in (1, 2):
        raise ValueError(f"shard_replicas must be 1 or 2, not {replicas}")
    if replicas == 1 or world == 1:
        return tuple((j,) for j in range(world))
    hosts: dict[str, list[int]] = {}
    for r, m in enumerate(members):
        hosts.setdefault(m.host, []).append(r)
    ordered = [r for rs in hosts.values() for r in rs]
    most = max(len(rs) for rs in hosts.values())
    shift = most if most < world else 1
    pos = {r: p for p, r in enumerate(ordered)}
    return tuple((j, ordered[(pos[j] + shift) % world]) for j in range(world))


def _chunk(numel: int, world: int) -> int:
    """A bucket's chunk length at `world` ranks (its padded width: chunk * world).

    A bucket of at least PAD_MIN_QUANTA quanta pads to a multiple of lcm(PAD_QUANTUM, world),
    so at every world size that divides PAD_QUANTUM (1 to 8, 10, 12, ...) it has the same
    padded width: a membership change between such sizes keeps the padded flat buffers
    (ShardedGradients.bind: the parameters stay where they are, nothing is allocated or
    copied). The padding costs under 1/PAD_MIN_QUANTA of the bucket. A smaller bucket pads
    to a multiple of the world size only."""
    quantum = math.lcm(PAD_QUANTUM, world)
    padded = math.ceil(numel / quantum) * quantum if numel >= PAD_MIN_QUANTA * quantum else numel
    return max(1, math.ceil(padded / world))


def plan_shards(kinds: list[tuple[str, int]], numels: list[int], elem_sizes: list[int],
                members: list[Member] | tuple[Member, ...], replicas: int = 1,
                bucket_bytes: int = 25 * 2**20) -> ShardLayout:
    """The layout for parameters of (dtype, param group) `kinds` over `members` (pure)."""
    if not members:
        raise ValueError("a shard layout needs at least one member")
    if len({m.id for m in members}) != len(members):
        raise ValueError("member ids must be distinct")
    world = len(members)
    lay = gradients.plan_layout([f"{d}@{pg}" for d, pg in kinds], numels, elem_sizes, bucket_bytes)
    groups = tuple((k.rsplit("@", 1)[0], int(k.rsplit("@", 1)[1])) for k in lay.groups)
    pstart: dict[int, int] = {}
    buckets = []
    for b in lay.buckets:
        chunk = _chunk(b.end - b.start, world)
        at = pstart.get(b.group, 0)
        buckets.append(ShardBucket(b.group, b.start, b.end - b.start, chunk, at, b.members))
        pstart[b.group] = at + chunk * world
    replicas = min(replicas, world) if replicas in (1, 2) else replicas
    return ShardLayout(tuple(members), replicas, groups, lay.slots, tuple(buckets),
                       place_replicas(members, replicas))


def _param_groups_of(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[int]:
    where = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    missing = [i for i, p in enumerate(params) if id(p) not in where]
    if missing:
        raise ValueError(f"parameters {missing} are not in the optimizer; sharding needs every trained "
                         "parameter in it")
    # Parameters of the optimizer that are not trained (requires_grad=False: a frozen backbone
    # under AdamW(model.parameters())) are not sharded: they never have a gradient, so the
    # replicated optimizer never steps them or makes state for them either.
    return [where[id(p)] for p in params]


def shard_layout(params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 members: list[Member] | tuple[Member, ...], replicas: int = 1,
                 bucket_mb: float = 25.0) -> ShardLayout:
    """The layout of `params` (the trained parameters, in model order) over `members`."""
    bucket_bytes = max(1, int(bucket_mb * 2**20)) if bucket_mb > 0 else 2**62
    pgs = _param_groups_of(params, optimizer)
    return plan_shards([(str(p.dtype), g) for p, g in zip(params, pgs)], [p.numel() for p in params],
                       [p.element_size() for p in params], members, replicas, bucket_bytes)


# ---------------------------------------------------------------------------- one rank's sharded path


@dataclass(frozen=True)
class StepResult:
    grad_norm: float | None  # the global norm before clipping (only when clipping)
    skipped: bool  # the GradScaler found inf/NaN in some rank's shard: nobody stepped


def _state_names(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    """The elementwise state tensors a supported optimizer keeps per parameter of `group`
    (as its _init_group makes them)."""
    kind = type(optimizer)
    if kind in (torch.optim.AdamW, torch.optim.Adam):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    if kind is torch.optim.RAdam:
        return ("exp_avg", "exp_avg_sq")
    if kind is torch.optim.Adamax:
        return ("exp_avg", "exp_inf")
    if kind is torch.optim.Adadelta:
        return ("square_avg", "acc_delta")
    if kind is torch.optim.RMSprop:
        return (("square_avg",) + (("momentum_buffer",) if group.get("momentum", 0) > 0 else ())
                + (("grad_avg",) if group.get("centered") else ()))
    return ("momentum_buffer",) if group.get("momentum", 0) else ()


def counts_steps(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer keeps a step count per parameter (every supported one but SGD)."""
    return type(optimizer) is not torch.optim.SGD


def step_tensor(step: int) -> torch.Tensor:
    """A step count as torch's optimizers keep it (not capturable, not fused): a 0-dim
    float32 tensor, float64 where that is the default dtype."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(step), dtype=dtype)


class _Pieces:
    """What GradScaler.unscale_ reads of an optimizer (its param groups' parameters' .grad),
    over the pieces of every held chunk: it unscales the gradients the step reads, and only
    those, and finds an inf/NaN there."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]


class _Transfers:
    """Point-to-point sends and receives waited for as one (a bucket's gather on gloo)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _wait(work, abort: threading.Event | None) -> None:
    if abort is None:
        work.wait()
    else:
        collectives.wait_work(work, abort)


def _wait_p2p(works: list, abort: threading.Event | None) -> None:
    collectives.wait_p2p(works, abort, "shard transfers")


class ShardedGradients:
    """The sharded gradient path and optimizer state of one rank (module docstring).

    Use: `bind()` once (no communication), then per step `begin(pg)`, backward
    with `grad_ready(index, p)` called from each parameter's post-accumulate-grad
    hook (`attached()` registers such hooks), `finish()`, `step()`, `zero_grad()`.
    """

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, layout: ShardLayout,
                 rank: int, shard: str = "optimizer", reduce_scatter: bool | None = None,
                 p2p_gather: bool | None = None) -> None:
        if shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {SHARD_MODES} (or None for replicated), not {shard!r}")
        check_optimizer(optimizer)
        if len(params) != len(layout.slots) or any(p.numel() != s.numel for p, s in zip(params, layout.slots)):
            raise ValueError("the layout was planned for other parameters")
        self.params = list(params)
        self.optimizer = optimizer
        self.layout = layout
        self.rank = rank
        self.shard = shard
        # ZeRO-2's reduction: reduce_scatter_tensor, or (None: on gloo) an all-reduce of the bucket
        # from which each rank keeps its chunks (see _launch).
        self._reduce_scatter_asked = reduce_scatter
        self._rs = True
        # The parameters' gather: all_gather_into_tensor, or (None: on gloo) point-to-point
        # sends and receives of the same chunks (_gather_bucket).
        self._p2p_gather_asked = p2p_gather
        self._p2p_gather = False
        self._pg_of = _param_groups_of(self.params, optimizer)
        self._opt_index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        self._held = layout.held(rank)
        # Every rank holds every chunk (shard_replicas=2 at 2 ranks, or 1 rank): the step needs
        # no collective after the gradients' all-reduce (_step_local).
        self._full = len(self._held) == layout.world
        self._offsets = layout.chunk_offsets()
        self._bucket_of = [0] * len(params)
        for b, bucket in enumerate(layout.buckets):
            for i in bucket.params:
                self._bucket_of[i] = b
        self._flat: list[torch.Tensor] = []  # padded parameters per group (the params are views)
        self._grads: list[torch.Tensor] = []  # ZeRO-1: padded gradients per group (the .grad are views)
        self._shard_grads: list[torch.Tensor] = []  # per group: one section per held chunk
        self._masters: list[list[torch.Tensor]] = []  # per group, per held chunk: the stepped tensor
        self._inner: torch.optim.Optimizer | None = None  # holds the held chunks' state, keyed by the masters
        # Per bucket, per held chunk: an optimizer of the script's class over views of that chunk's
        # pieces (_build_steppers); the step runs through these, the state stays in _inner.
        self._steppers: list[list[tuple[torch.optim.Optimizer, list[tuple[int, int]]]]] = []
        self._unscale_view = _Pieces([])  # every piece: what GradScaler unscales (_point_grads)
        self._spares: dict[tuple, torch.Tensor] = {}  # CPU: the pre-step copy's buffers, reused every step
        self._spare_base: torch.Tensor | None = None  # CPU: the one allocation they are carved out of
        self._spare_arena: Recycler | None = None
        # Host memory this path's buffers are carved out of until its reshard's move is done
        # (the old layout's pre-step copy, or a joiner's prepared memory: hostmem.py); None:
        # everything is allocated.
        self.recycler: Recycler | None = None
        self._pg = None
        self._gloo = False  # the group of the last begin() is gloo's
        self._ok_upto = 0  # failed(): reductions before this one are known to have succeeded
        self._abort: threading.Event | None = None
        self._launching = False
        self._works: list = []  # the step's reductions, in bucket order (None: its launch failed)
        self._staging: dict[int, torch.Tensor] = {}  # ZeRO-2: bucket -> its staged full gradient
        self._pool: dict[torch.dtype, list[torch.Tensor]] = {}  # ZeRO-2 on the CPU: free staging buffers
        self._pooled: dict[int, torch.Tensor] = {}  # bucket -> the pool buffer its staging is a view of
        self._pool_size: dict[torch.dtype, int] = {}  # per dtype: staging buffers the pool owns (free or lent)
        self._retired = 0  # buckets whose reduction is waited for and taken out of the staging
        self._error: BaseException | None = None  # a launch or wait inside backward failed: finish raises it
        # ZeRO-2 with replicas: the backups' exchange (point-to-point into _shard_grads) is
        # posted and not yet waited for to its end
        self._exchanging = False
        # ZeRO-2 reducing each micro-batch (ElasticJob(reduce_each_micro_batch=True)): the
        # rounds of this step already reduced into _shard_grads (begin(accumulate=True),
        # finish_round); a later round's reduction is added to them, not written over them.
        self._rounds = 0
        self._rs_into: dict[int, torch.Tensor] = {}  # a later round's reduce-scatter: bucket -> its sum
        self._loose: list = []  # reductions of a failed round that may still be in flight (drop)
        # A dropped step left a reduction that may still write into the gradient buffers and
        # the staging pool (drop): they are replaced before they are used again (begin), and
        # a reshard's new path does not take them over (bind).
        self._stale = False
        # The step in flight: the held chunks' values and optimizer state from before the
        # shard's optimizer step, kept until the parameters' all-gather has finished
        # (`settle` undoes or keeps a step whose gather broke).
        self._undo: dict[str, list] | None = None
        # What finish() prepared for the coming step (_prepare_step): the pre-step copy of the
        # held chunks ({} where none is kept); None: not prepared.
        self._prepared: dict[str, list] | None = None

    # -- setup

    @property
    def device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D buffer on the parameters' device: out of the recycler where there is one."""
        if self.recycler is not None:
            return self.recycler.empty(n, dtype, self.device)
        if self.device.type == "cpu":
            return hostmem.empty(n, dtype)
        return torch.empty(n, dtype=dtype, device=self.device)

    def _zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self._empty(n, dtype).zero_()

    def _geometry(self, g: int) -> tuple:
        """Where group g's buckets lie in its padded buffer (start, padded width)."""
        return (self.layout.groups[g],) + tuple((b.pstart, b.chunk * self.layout.world)
                                                for b in self.layout.buckets if b.group == g)

    def bind(self, reuse: "ShardedGradients | None" = None, values: bool = True) -> None:
        """Make the parameters views of the padded flat buffers (values kept) and
        build the shard optimizer. No communication. `reuse`: this rank's path under
        the previous layout (a reshard): a group whose buckets lie at the same places
        with the same padded widths (a world change that every bucket's length divides
        alike) keeps its parameter buffer, of which the parameters already are views,
        and (ZeRO-1) its gradient buffer: nothing is allocated or copied for it.
        `values` False: the parameters' values are not kept (a joiner, whose reshard
        receives every chunk's parameters): they are not copied (on the join's critical
        path: with the masters' copy, which a step makes anyway, 0.3 s of the 50 M
        benchmark model's 0.47 s bind here)."""
        lay = self.layout
        same = [reuse is not None and g < len(reuse._flat) and reuse._geometry(g) == self._geometry(g)
                and reuse._flat[g].device == self.device for g in range(len(lay.groups))]
        with torch.no_grad():
            self._flat = []
            for g, (dtype, _pg) in enumerate(lay.groups):
                if same[g]:
                    self._flat.append(reuse._flat[g])
                    continue
                flat = self._empty(lay.padded(g), dtype_named(dtype))
                for b in lay.buckets:  # the parameters fill the rest
                    if b.group == g:
                        flat[b.pstart + b.numel:b.pstart + b.chunk * lay.world].zero_()
                self._flat.append(flat)
            for i, p in enumerate(self.params):
                view = self._param_view(self._flat, i)
                if view.data_ptr() != p.data_ptr():
                    if values:
                        view.copy_(p.detach().reshape(-1))
                    p.data = view.view_as(p)
            # ZeRO-2: the held chunks' gradients, one section per held chunk. ZeRO-1 has none: its
            # pieces' gradients are views of the all-reduced gradients (_point_grads).
            self._shard_grads = []
            for g, f in enumerate(self._flat if self.shard == "gradients" else ()):
                n = len(self._held) * lay.shard_len(g)
                was = reuse._shard_grads[g] if reuse is not None and g < len(reuse._shard_grads) else None
                if was is not None and was.numel() == n and was.dtype == f.dtype and was.device == f.device \
                        and not reuse._stale:
                    self._shard_grads.append(was.zero_())  # e.g. 2 -> 1 ranks with two replicas: 2 x 1/2 = 1 x 1
                else:
                    self._shard_grads.append(self._zeros(n, f.dtype))
            # A chunk stepped in place (_in_place: this rank's own chunk, or every chunk where
            # it holds them all) has its pieces step the parameters' buffer itself; its master
            # only keys the optimizer state and gives its sizes: one element, expanded (no
            # memory on any device: at world N that is 1/N of the model per rank, all of it
            # at world 1). A backup's master is a real copy: its values are only read within
            # a step, which writes every element (padding too) from the parameters first
            # (_refresh_masters), so none are copied here.
            self._masters = [[(torch.empty(1, dtype=f.dtype, device=f.device).expand(lay.shard_len(g))
                               if self._in_place(h) else self._empty(lay.shard_len(g), f.dtype))
                              for h in range(len(self._held))] for g, f in enumerate(self._flat)]
        if self.shard == "optimizer":
            self._grads = []
            for g, f in enumerate(self._flat):
                if same[g] and len(reuse._grads) > g and not reuse._stale:
                    self._grads.append(reuse._grads[g].zero_())
                else:
                    self._grads.append(self._zeros(f.numel(), f.dtype))
            for i, p in enumerate(self.params):
                p.grad = self._param_view(self._grads, i).view_as(p)
        else:
            self._grads = []
            for p in self.params:
                p.grad = None
        groups = []
        for g, (_dtype, pg) in enumerate(lay.groups):
            hyper = {k: v for k, v in self.optimizer.param_groups[pg].items() if k != "params"}
            groups.append({**hyper, "params": self._masters[g]})
        self._inner = type(self.optimizer)(groups) if groups else None
        self._build_steppers()
        self._point_grads()

    def host_bytes(self) -> int:
        """The bytes of the buffers a joiner's path allocates from bind to the end of its
        reshard (nothing of an earlier path to reuse): the parameters' padded buffer, ZeRO-1's
        gradient buffer, the chunk gradients, the backups' stepped copies and the held
        chunks' optimizer state, each rounded up to a cache line (what
        ShardedPath.prepare_join touches ahead)."""
        lay, held, total, line = self.layout, len(self._held), 0, _line
        for g, (dtype, _pg) in enumerate(lay.groups):
            item, n, names = dtype_named(dtype).itemsize, lay.shard_len(g), len(self._names(g))
            total += line(lay.padded(g) * item) * (2 if self.shard == "optimizer" else 1)
            total += line(held * n * item) if self.shard == "gradients" else 0
            total += sum(line(n * item) for h in range(held) if not self._in_place(h))
            total += held * names * line(n * item)
        return total

    def _in_place(self, h: int) -> bool:
        """Held chunk h is stepped in the parameters' own buffer: this rank's own chunk
        (h 0, which the all-gather then sends from where it lies) or, where every chunk is
        held here (_full, no all-gather), every chunk. A backup (h > 0) of a sharded
        layout steps a copy: the all-gather writes the chunk's parameters from its primary
        while the backup steps."""
        return h == 0 or self._full

    def _build_steppers(self) -> None:
        """Per bucket and held chunk, an optimizer of the script's class over that chunk's
        pieces (views of the master, at most PIECE_ELEMS each), so the step goes bucket by
        bucket (each bucket's all-gather starts once its primary chunk has stepped) and its
        temporaries stay small."""
        cls = type(self.optimizer)
        self._steppers = []
        for b, bucket in enumerate(self.layout.buckets):
            g, off = bucket.group, self._offsets[b]
            end = off + bucket.chunk
            spans = [(lo, min(lo + PIECE_ELEMS, end)) for lo in range(off, end, PIECE_ELEMS)]
            per_h = []
            for h, j in enumerate(self._held):
                if self._in_place(h):  # the parameters themselves (chunk j of the padded buffer) are stepped
                    base = bucket.pstart + j * bucket.chunk - off
                    views = [self._flat[g][base + lo:base + hi] for lo, hi in spans]
                else:
                    views = [self._masters[g][h][lo:hi] for lo, hi in spans]
                per_h.append((cls([{**self._inner.param_groups[g], "params": views}]), spans))
            self._steppers.append(per_h)

    def _point_grads(self) -> None:
        """The pieces' .grad (again after the buffers are replaced): ZeRO-2, their sections
        of _shard_grads (the masters' too); ZeRO-1, their chunk's elements of the all-reduced
        gradients themselves, so nothing copies the held chunks' gradients out of them (at
        world 2 with two replicas that was the 50 M model's 200 MB at every step). Also the
        view GradScaler unscales (_unscale_view)."""
        for g, masters in enumerate(self._masters):
            n = self.layout.shard_len(g)
            for h, m in enumerate(masters):
                m.grad = self._shard_grads[g][h * n:(h + 1) * n] if self.shard == "gradients" else None
        for b, per_h in enumerate(self._steppers):
            bucket = self.layout.buckets[b]
            g, off = bucket.group, self._offsets[b]
            for h, (opt, spans) in enumerate(per_h):
                base = bucket.pstart + self._held[h] * bucket.chunk - off
                for v, (lo, hi) in zip(opt.param_groups[0]["params"], spans):
                    v.grad = (self._masters[g][h].grad[lo:hi] if self.shard == "gradients"
                              else self._grads[g][base + lo:base + hi])
        self._unscale_view = _Pieces([v for per_h in self._steppers for opt, _spans in per_h
                                      for v in opt.param_groups[0]["params"]])

    def _param_view(self, flats: list[torch.Tensor], i: int) -> torch.Tensor:
        return self._param_in(flats[self.layout.slots[i].group], i)

    def _param_in(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's elements in a padded buffer of its group."""
        slot = self.layout.slots[i]
        b = self.layout.buckets[self._bucket_of[i]]
        at = b.pstart + slot.offset - b.start
        return flat[at:at + slot.numel]

    def _chunk_of(self, flat: torch.Tensor, b: int, j: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        return flat[bucket.pstart + j * bucket.chunk:bucket.pstart + (j + 1) * bucket.chunk]

    def _section(self, t: torch.Tensor, g: int, h: int) -> torch.Tensor:
        n = self.layout.shard_len(g)
        return t[h * n:(h + 1) * n]

    def _read_chunk(self, g: int, h: int, into: torch.Tensor) -> torch.Tensor:
        """Held chunk h's parameters of group g, bucket by bucket, into the section `into`."""
        for b, bucket in enumerate(self.layout.buckets):
            if bucket.group == g:
                off = self._offsets[b]
                into[off:off + bucket.chunk].copy_(self._chunk_of(self._flat[g], b, self._held[h]))
        return into

    def _write_chunk(self, g: int, h: int, values: torch.Tensor) -> None:
        """The section `values` into held chunk h's parameters of group g, bucket by bucket."""
        for b, bucket in enumerate(self.layout.buckets):
            if bucket.group == g:
                off = self._offsets[b]
                self._chunk_of(self._flat[g], b, self._held[h]).copy_(values[off:off + bucket.chunk])

    def _backups(self) -> Iterator[tuple[int, int]]:
        """(group, held index) of every chunk stepped in a copy (not _in_place)."""
        return ((g, h) for g in range(len(self._masters)) for h in range(len(self._held)) if not self._in_place(h))

    def _refresh_masters(self) -> None:
        """The backups' stepped copies from the parameters (a restore or a state apply may
        have changed them). A chunk stepped in place (_in_place) has none."""
        with torch.no_grad():
            for g, h in self._backups():
                self._read_chunk(g, h, self._masters[g][h])

    # -- the gradient reduction

    def begin(self, pg, abort: threading.Event | None = None, accumulate: bool = False) -> None:
        """Arm the reduction for the coming backward: the step's last (finish() follows),
        or (`accumulate`, ZeRO-2) a micro-batch before it, whose gradients are reduced into
        the held chunks' and added to those of the rounds before (finish_round follows).
        Every rank runs the same number of rounds in a step."""
        if accumulate and self.shard != "gradients":
            raise ValueError("only ZeRO-2 (shard='gradients') reduces each micro-batch")
        self._pg, self._abort = pg, abort
        asked = self._reduce_scatter_asked
        # Every chunk held here: an all-reduce gives them all at once (a reduce-scatter would
        # need the backups' exchange on top).
        gloo = self._gloo = collectives.is_gloo(pg)
        self._rs = False if self._full else asked if asked is not None else not gloo
        self._p2p_gather = self._p2p_gather_asked if self._p2p_gather_asked is not None else gloo
        if self._stale and not self._rounds:
            self._renew_grads()
        if self.shard == "optimizer":
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    view = self._param_view(self._grads, i)
                    if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                        continue
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad.reshape(-1))
                    p.grad = view.view_as(p)
        self._ready = [0] * len(self.layout.buckets)
        self._fired: set[int] = set()
        self._works = []
        # A failure in an earlier round of this step is kept for finish() to raise.
        self._staging, self._pooled, self._retired = {}, {}, 0
        self._error = self._error if self._rounds else None
        self._rs_into = {}
        self._prepared = None
        self._ok_upto = 0  # reductions before this one are known to have succeeded (failed())
        self._launching = True

    def grad_ready(self, index: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook body of parameter `index`: stage its gradient
        (ZeRO-2) and launch every complete bucket, in the one global order."""
        if not self._launching or index in self._fired:
            return
        self._fired.add(index)
        b = self._bucket_of[index]
        if self.shard == "gradients":
            self._stage(index, p)
        self._ready[b] += 1
        while len(self._works) < len(self.layout.buckets):
            nb = len(self._works)
            if self._ready[nb] < len(self.layout.buckets[nb].params):
                break
            self._launch(nb)

    def failed(self) -> BaseException | None:
        """A reduction of this backward already failed (checked without waiting; a wait
        inside backward that failed is kept in _error)."""
        if self._error is not None:
            return self._error
        if not self._gloo:
            return None  # NCCL: reading a work's future makes the compute stream wait for it
        self._ok_upto, error = collectives.first_failure(self._works, max(self._ok_upto, self._retired))
        return error

    def _stage(self, index: int, p: torch.Tensor) -> None:
        b = self._bucket_of[index]
        bucket = self.layout.buckets[b]
        if b not in self._staging:
            self._staging[b] = self._new_staging(b)
        slot = self.layout.slots[index]
        at = slot.offset - bucket.start
        with torch.no_grad():
            if p.grad is not None:
                self._staging[b][at:at + slot.numel].copy_(p.grad.reshape(-1))
            else:  # no gradient (an unused parameter): zeros in the sum
                self._staging[b][at:at + slot.numel].zero_()
        p.grad = None  # ZeRO-2: the full gradient lives only until its bucket is staged

    def _new_staging(self, b: int) -> torch.Tensor:
        """Bucket b's staging buffer: on the CPU a view of a pool buffer (STAGING_BUFFERS:
        when all are lent, the oldest bucket in flight is waited for and taken out first),
        elsewhere its own. Every parameter's slot is written when it is staged (its
        gradient, or zeros), so only the padding is zeroed here."""
        bucket = self.layout.buckets[b]
        width = bucket.chunk * self.layout.world
        dtype = self._flat[bucket.group].dtype
        if self.device.type != "cpu":
            t = torch.empty(width, dtype=dtype, device=self.device)
        else:
            free = self._pool.setdefault(dtype, [])
            while not free and self._pool_size.get(dtype, 0) >= STAGING_BUFFERS and self._error is None \
                    and self._retired < len(self._works):
                self._retire_next()
            if free:
                buf = free.pop()
            elif self._pool_size.get(dtype, 0) < STAGING_BUFFERS:
                widest = max(k.chunk * self.layout.world for k in self.layout.buckets
                             if self._flat[k.group].dtype == dtype)
                buf = self._empty(widest, dtype)
                self._pool_size[dtype] = self._pool_size.get(dtype, 0) + 1
            else:
                buf = None  # every buffer is held by a bucket not launched yet (or a failed wait): its own
            if buf is None:
                t = torch.empty(width, dtype=dtype, device=self.device)
            else:
                self._pooled[b] = buf
                t = buf[:width]
        t[bucket.numel:].zero_()
        return t

    def _retire_next(self) -> None:
        """Wait for the oldest reduction not yet taken out; ZeRO-2 on gloo (an all-reduce):
        copy the held chunks out of its staging; return its buffer to the pool. A failure
        is kept for finish() (this runs inside backward, from the gradient hooks)."""
        b = self._retired
        work = self._works[b]
        try:
            if work is None:
                raise RuntimeError("the reduction could not be launched")
            _wait(work, self._abort)
        except Exception as e:  # noqa: BLE001 - raised by finish()
            self._error = self._error or e
            return
        self._retired += 1
        if self.shard != "gradients":  # ZeRO-1: the pieces' gradients are views of the reduced buckets
            return
        t = self._staging.pop(b)
        bucket = self.layout.buckets[b]
        off = self._offsets[b]
        if not self._rs:  # all-reduced: every held chunk is here
            with torch.no_grad():
                for h, j in enumerate(self._held):
                    held = self._section(self._shard_grads[bucket.group], bucket.group, h)[off:off + bucket.chunk]
                    src = t[j * bucket.chunk:(j + 1) * bucket.chunk]
                    if self._rounds:  # a later round: added to the rounds before
                        held.add_(src)
                    else:
                        held.copy_(src)
        elif b in self._rs_into:  # a later round's reduce-scatter
            with torch.no_grad():
                self._shard_grads[bucket.group][off:off + bucket.chunk].add_(self._rs_into.pop(b))
        buf = self._pooled.pop(b, None)
        if buf is not None:
            self._pool[buf.dtype].append(buf)

    def _launch(self, b: int) -> None:
        """Launch bucket b's reduction; a failure is kept for finish() (inside backward)."""
        try:
            self._works.append(self._launch_work(b))
        except Exception as e:  # noqa: BLE001 - a broken group: raised by finish()
            self._error = self._error or e
            self._works.append(None)

    def _launch_work(self, b: int):
        bucket = self.layout.buckets[b]
        width = bucket.chunk * self.layout.world
        if self.shard == "optimizer":
            t = self._grads[bucket.group][bucket.pstart:bucket.pstart + width]
            return collectives.allreduce_async(self._pg, t)
        for i in bucket.params:  # parameters whose gradient never came (unused, or no hook)
            if i not in self._fired:
                self._fired.add(i)
                self._stage(i, self.params[i])
        if b not in self._staging:
            self._staging[b] = self._new_staging(b)
        if not self._rs:
            # gloo's reduce-scatter took 2.6x its all-reduce of the same 25 MB bucket here
            # (3.2 s against 1.2 s, 2 ranks, loaded CPUs): all-reduce the staged bucket and keep
            # this rank's chunks (_retire_next). Same traffic as replicated.
            return collectives.allreduce_async(self._pg, self._staging[b])
        out = self._shard_grads[bucket.group][self._offsets[b]:self._offsets[b] + bucket.chunk]
        if self._rounds:  # a later round: its sum goes beside the chunk's, added at _retire_next
            out = self._rs_into[b] = self._empty(bucket.chunk, out.dtype)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self._pg._reduce_scatter_base(out, self._staging[b], opts)

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all; afterwards every held
        chunk's gradient (summed over ranks) is in place."""
        self._launch_rest()
        if self._error is None:
            self._prepare_step()
        self._retire_all()
        self._rounds = 0
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._works = []
        if self.shard == "gradients" and self._rs and self.layout.replicas > 1:
            self._exchanging = True  # until every transfer is waited for (drop)
            with torch.no_grad():
                self._exchange_backups()
            self._exchanging = False

    def _launch_rest(self) -> None:
        """The buckets this backward did not launch (unused parameters, or no backward), in order."""
        while len(self._works) < len(self.layout.buckets):
            self._launch(len(self._works))
        self._launching = False

    def _retire_all(self) -> None:
        """Wait for every launched reduction and take it out (until one fails: _error)."""
        while self._error is None and self._retired < len(self._works):
            self._retire_next()

    def finish_round(self) -> None:
        """After a micro-batch's backward armed with begin(accumulate=True): launch the
        buckets not launched yet (a round with no backward, for a rank that has fewer
        micro-batches than another, launches them all: zeros), wait for all and add them
        into the held chunks' gradients. Between rounds the full gradients are gone
        (each is staged into its bucket as it comes, then dropped): only the held chunks'
        are kept, as after a step. A failure is kept for the step's finish(), which
        raises it; the rounds that follow still issue their collectives."""
        self._launch_rest()
        self._retire_all()
        if self._error is not None:
            self._loose.extend(w for w in self._works[self._retired:] if w is not None)
        self._works = []
        self._rounds += 1

    def _prepare_step(self) -> None:
        """What the step needs of the parameters and the optimizer state, which backward
        and the reductions do not change, done while the last buckets are still being
        reduced, where this rank would only wait: the backups' copies refreshed and the
        pre-step copy of the held chunks (at 2 ranks, 50 M parameters, ZeRO-1: 0.05 s of a
        0.54 s step). Where every chunk is held here (_full) there is no pre-step copy."""
        if self._inner is None:
            return
        self._refresh_masters()  # the backups' copies (the own chunk steps the parameters in place)
        self._prepared = {} if self._full else self._held_copy()

    def drop(self) -> None:
        """A dropped step. Where every reduction it launched has completed (succeeded or
        failed), the gradient buffers and the staging pool are kept: the next begin() zeroes
        the gradients again. Where one may still write into them (collectives.settled: a
        survivor waiting on a live ring neighbour that left its own), they are replaced, but
        only when next used (begin); a reshard's new path allocates its own (bind), so a
        crash's survivors allocate nothing here (fresh zeroed buffers for the 50 M model's
        gradients took 0.1-0.15 s of each survivor's pause at world 4, only for the new
        layout to replace them)."""
        settled = collectives.settled(self._works + self._loose) and not self._exchanging
        self._works, self._staging, self._pooled, self._launching, self._error = [], {}, {}, False, None
        self._prepared, self._exchanging = None, False
        self._rounds, self._rs_into, self._loose = 0, {}, []
        if not settled:
            self._stale = True
            self._pool, self._pool_size = {}, {}  # a buffer lent to a reduction in flight is never lent again
        for p in self.params:
            p.grad = None  # ZeRO-1: begin() points and zeroes the views again

    def _renew_grads(self) -> None:
        """Fresh gradient buffers for those a dropped step's reductions may still write (drop)."""
        with torch.no_grad():
            self._shard_grads = [self._zeros(t.numel(), t.dtype) for t in self._shard_grads]
            if self.shard == "optimizer":
                self._grads = [self._zeros(t.numel(), t.dtype) for t in self._grads]
            self._point_grads()
        self._stale = False

    def _exchange_backups(self) -> None:
        """ZeRO-2 with replicas: each primary sends its reduced chunk to its backups."""
        works = []
        for g in range(len(self._flat)):
            for dst in self.layout.holders[self.rank][1:]:
                works.append(collectives.send(self._pg, self._section(self._shard_grads[g], g, 0), dst, g))
            for h, j in enumerate(self._held[1:], start=1):
                works.append(collectives.recv(self._pg, self._section(self._shard_grads[g], g, h), j, g))
        _wait_p2p(works, self._abort)

    # -- the step

    def release_recycler(self) -> None:
        """What the recycler still holds goes back to the OS (hostmem.Recycler.release)."""
        rec, self.recycler = self.recycler, None
        if rec is not None:
            rec.release()

    def take_spares(self) -> list[torch.Tensor]:
        """The pre-step copy's buffers, let go of (dead between steps; a later step of this
        path makes new ones), for a reshard to carve the new layout's buffers out of. This
        path keeps no reference, so where that reshard breaks with receives still posted
        into them, nothing of this path's is ever written by those."""
        if self._undo is not None:
            return []  # a step in doubt: settle() reads them first
        spares = [self._spare_base] if self._spare_base is not None else list(self._spares.values())
        self._spares, self._spare_base, self._spare_arena = {}, None, None
        return spares

    def take_state(self) -> list[torch.Tensor]:
        """The held chunks' optimizer state, let go of: a restore replaces it, and its new
        state is carved out of this (the path keeps no state, and no reference to it)."""
        if self._inner is None:
            return []
        out = [t for st in self._inner.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim()]
        self._inner.state.clear()
        return out

    def discard(self) -> None:
        """This path was replaced (its move done): let go of its host buffers now, so their
        pages are back with the OS for the new path's first step (whatever cycles might
        keep the object itself alive). Not the parameters' buffer, which the new path may
        have kept and the parameters' views hold anyway."""
        if self._inner is not None:
            self._inner.state.clear()
        self._spares, self._spare_base, self._spare_arena = {}, None, None
        self._grads, self._shard_grads, self._masters, self._steppers = [], [], [], []
        self._unscale_view = _Pieces([])
        self._pool, self._pooled, self._staging = {}, {}, {}

    def step(self, max_grad_norm: float | None = None, scaler: Any = None) -> StepResult:
        """Unscale, clip by the global norm, step the held chunks, all-gather the
        parameters. Every rank decides alike: the norm and the inf/NaN flag are
        all-reduced. Call after finish()."""
        inner = self._inner
        if inner is None:
            return StepResult(None, False)
        for g, (_dtype, pg) in enumerate(self.layout.groups):
            for k, v in self.optimizer.param_groups[pg].items():
                if k != "params":
                    inner.param_groups[g][k] = v
        prepared, self._prepared = self._prepared, None
        if prepared is None:  # finish() did not prepare the step (the tests' bare step() calls)
            self._refresh_masters()
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        found_infs: list[torch.Tensor] = []
        if scaler is not None and scaler.is_enabled():
            scaler.unscale_(self._unscale_view)
            found_infs = list(scaler._per_optimizer_states[id(self._unscale_view)]["found_inf_per_device"].values())
            stats[1] = float(sum(float(f) for f in found_infs))
        if max_grad_norm is not None:
            # Each rank sums its primary chunks, all-reduced below; where every rank holds every
            # chunk, each sums them all, in chunk order, so every rank gets the same norm alone.
            pick = ([per_h[self._held.index(j)] for j in range(self.layout.world)] if self._full else per_h[:1]
                    for per_h in self._steppers)
            with torch.no_grad():  # float64, piece by piece, as the replicated path's norm
                gradients.add_squares(stats[0], [v.grad for chosen in pick for opt, _spans in chosen
                                                 for v in opt.param_groups[0]["params"]])
        if (max_grad_norm is not None or found_infs) and not self._full:
            _wait(collectives.allreduce_async(self._pg, stats), self._abort)
        skipped = bool(stats[1] > 0)
        norm = None
        if max_grad_norm is not None:
            norm, coef = gradients.clip_coefficient(max_grad_norm, float(stats[0]))
            with torch.no_grad():
                for v in self._unscale_view.param_groups[0]["params"]:
                    v.grad.mul_(coef)
        if found_infs:
            for f in found_infs:
                f.fill_(1.0 if skipped else 0.0)
        if not skipped and not self._full:
            self._undo = self._pre_step_copy(scaler if found_infs else None, prepared or None)
        if found_infs:
            # scaler.step(inner) would step only if no rank found inf/NaN (below); its update
            # reads only the found_inf flags, so it goes before the step and the gather.
            scaler.update()
        if not skipped and self._full:
            self._step_local()
        elif not skipped:
            self.gather_params(self._step_shard())
        self._undo = None  # the gather finished: the step stands on every rank that got here
        return StepResult(norm, skipped)

    def _step_shard(self) -> Iterator[int]:
        """The optimizer step of the held chunks, piece by piece (_build_steppers), bucket
        by bucket: yields each bucket once its primary chunk has stepped (its all-gather
        can start), then steps the backups. Each piece's state is a view of its chunk's
        state in _inner (its step count a copy); a chunk without state yet (the first
        step) gets the state the pieces' optimizers made, joined into one tensor per name.
        Run it to the end: the step counts are written back last."""
        inner = self._inner
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in inner.param_groups]
        states = [[inner.state.get(m) for m in ms] for ms in self._masters]

        def step(b: int, h: int) -> None:
            opt, spans = self._steppers[b][h]
            st = states[self.layout.buckets[b].group][h]
            opt.param_groups[0].update(hyper[self.layout.buckets[b].group])
            for v, (lo, hi) in zip(opt.param_groups[0]["params"], spans):
                if st:
                    opt.state[v] = {k: (t[lo:hi] if t.dim() else t.clone()) if isinstance(t, torch.Tensor) else t
                                    for k, t in st.items()}
                else:
                    opt.state.pop(v, None)
            opt.step()

        for b in range(len(self._steppers)):
            step(b, 0)
            yield b
        for b in range(len(self._steppers)):
            for h in range(1, len(self._held)):
                step(b, h)
        # The step counts (and, on the first step, the new state) back into _inner.
        pieces: dict[tuple[int, int], list[tuple[dict, int, int]]] = {}
        for b, per_h in enumerate(self._steppers):
            g = self.layout.buckets[b].group
            for h, (opt, spans) in enumerate(per_h):
                for v, (lo, hi) in zip(opt.param_groups[0]["params"], spans):
                    pieces.setdefault((g, h), []).append((opt.state.pop(v, None) or {}, lo, hi))
        with torch.no_grad():
            for (g, h), got in pieces.items():
                m, st = self._masters[g][h], states[g][h]
                first = got[0][0]
                if st:
                    for k, t in first.items():
                        if not (isinstance(t, torch.Tensor) and t.dim()):
                            st[k] = t
                    continue
                new: dict[str, Any] = {}
                for k, t in first.items():
                    if isinstance(t, torch.Tensor) and t.dim():
                        whole = self._zeros(m.numel(), t.dtype)
                        for piece_state, lo, hi in got:
                            whole[lo:hi].copy_(piece_state[k])
                        new[k] = whole
                    else:
                        new[k] = t
                if new:
                    inner.state[m] = new

    def _step_local(self) -> None:
        """Every chunk held here (`_full`): step them all, no all-gather. The pieces are
        views of the parameters' own padded buffer (_build_steppers), so the step writes
        the parameters in place (no masters' refresh, no copy back). Every rank steps the
        same chunks from the same all-reduced gradients, states and hyperparameters, so
        every rank's parameters come out alike (as in replicated training); and as no
        collective follows the step, no rank can be left with a step in doubt (no
        pre-step copy)."""
        for _b in self._step_shard():
            pass

    def _write_params(self) -> None:
        """The parameters of every backed-up chunk from its stepped copy (a chunk stepped in
        place is its parameters already)."""
        with torch.no_grad():
            for g, h in self._backups():
                self._write_chunk(g, h, self._masters[g][h])

    def _values(self, g: int, h: int, into: torch.Tensor) -> torch.Tensor:
        """Held chunk h's stepped values of group g, copied into the section `into`."""
        return self._read_chunk(g, h, into) if self._in_place(h) else into.copy_(self._masters[g][h])

    def _set_values(self, g: int, h: int, values: torch.Tensor) -> None:
        """Write held chunk h's values of group g (a section) back where it is stepped."""
        if self._in_place(h):
            self._write_chunk(g, h, values)
        else:
            self._masters[g][h].copy_(values)

    def _spare(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        """A buffer shaped as `like` for the pre-step copy: on the CPU the same one every
        step (torch's CPU allocator hands a block this big back to the OS when freed, and a
        fresh one costs a page fault per 4 KiB at every step); elsewhere a new one (CUDA's
        caching allocator reuses the memory, and between steps the forward can have it)."""
        if like.device.type != "cpu":
            return torch.empty_like(like)
        t = self._spares.get(key)
        if t is None or t.shape != like.shape or t.dtype != like.dtype:
            if self._spare_arena is None:
                # All of the copy's buffers in one allocation: the next reshard can carve the new
                # layout's buffers, whatever their sizes, out of it whole (take_spares).
                self._spare_base = self._empty(self._spare_bytes(), torch.uint8)
                self._spare_arena = Recycler()
                self._spare_arena.give(self._spare_base)
            t = self._spares[key] = self._spare_arena.empty(like.numel(), like.dtype).view(like.shape)
        return t

    def _spare_bytes(self) -> int:
        """The pre-step copy's size: per held chunk its values and each state tensor, each
        rounded up to a cache line."""
        return sum((1 + len(self._names(g))) * (-(-self.layout.shard_len(g) * m.element_size() // 64) * 64)
                   for g, ms in enumerate(self._masters) for m in ms)

    def _pre_step_copy(self, scaler: Any = None, held: dict[str, list] | None = None) -> dict[str, Any]:
        """The held chunks' values and optimizer state before the step (a rank lost
        between the shard's step and the end of the all-gather leaves the survivors'
        chunks one step ahead of the parameters, and their parameters half-gathered),
        and an enabled GradScaler's scale and growth tracker (its update() comes before
        the gather: an undone step must not count towards its growth). Into buffers
        reused from step to step on the CPU (_spare); settle copies out of them. `held`:
        the chunks' part, copied already (_held_copy, by finish())."""
        scaled = None
        if scaler is not None and getattr(scaler, "_scale", None) is not None:
            scaled = (scaler, scaler._scale.clone(), scaler._growth_tracker.clone())
        return {**(held if held is not None else self._held_copy()), "scaler": scaled}

    def _held_copy(self) -> dict[str, list]:
        """The held chunks' values and optimizer state, into the spare buffers (_pre_step_copy)."""
        inner = self._inner
        masters, state = [], []
        with torch.no_grad():
            for g, ms in enumerate(self._masters):
                masters.append([self._values(g, h, self._spare(("master", g, h), m)) for h, m in enumerate(ms)])
                state.append([])
                for h, m in enumerate(ms):
                    st = inner.state.get(m)
                    state[g].append({k: ((self._spare((k, g, h), v).copy_(v) if v.dim() else v.clone())
                                         if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                                    if st else None)
        return {"masters": masters, "state": state}

    @property
    def step_in_doubt(self) -> bool:
        """True after a step whose parameter all-gather did not finish here (dropped)."""
        return self._undo is not None

    def settle(self, keep: bool) -> None:
        """Resolve a step whose all-gather broke (`step_in_doubt`): `keep` (another
        rank committed it, so every rank had stepped its chunks) leaves the held chunks
        stepped; else they go back to their pre-step values and optimizer state. Either
        way the held chunks' parameters are written back from them: the broken gather
        may have left any chunk of the parameters half-written, so the caller then has
        every chunk's parameters sent from its holders (reshard's resend_params)."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        inner = self._inner
        with torch.no_grad():
            if not keep:
                for g, ms in enumerate(self._masters):
                    for h, m in enumerate(ms):
                        self._set_values(g, h, undo["masters"][g][h])
                        st = undo["state"][g][h]
                        if st is None:
                            inner.state.pop(m, None)
                        else:  # copies: the undo's tensors are the spare buffers of the next step's copy
                            inner.state[m] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                              for k, v in st.items()}
                if undo["scaler"] is not None:
                    scaler, scale, growth = undo["scaler"]
                    scaler._scale.copy_(scale)
                    scaler._growth_tracker.copy_(growth)
        self._write_params()

    def gather_params(self, stepped: Iterator[int] | None = None) -> None:
        """All-gather every bucket's chunks from their primaries into the parameters:
        each bucket as soon as `stepped` (the shard's step, _step_shard) yields it, so
        the gathers overlap the rest of the step; without it, every bucket at once.
        `stepped` is run to its end even if a launch fails (the error is raised after)."""
        works, error = [], None
        for b in (stepped if stepped is not None else range(len(self.layout.buckets))):
            if error is None:
                try:
                    works.append(self._gather_bucket(b))
                except Exception as e:  # noqa: BLE001 - raised once the shard has stepped to the end
                    error = e
        if error is not None:
            raise error
        p2p = [t for w in works if isinstance(w, _Transfers) for t in w.works]
        if p2p:
            _wait_p2p(p2p, self._abort)
        for w in works:
            if not isinstance(w, _Transfers):
                _wait(w, self._abort)

    def _gather_bucket(self, b: int):
        """Launch bucket b's all-gather: each rank's own chunk, stepped in place, from where
        it lies in the parameters' buffer. An in-place all-gather (NCCL's documented form,
        input = output + rank * chunk), or on gloo (`_p2p_gather`) the same exchange as
        point-to-point sends and receives: this rank's chunk to every other rank, every
        other rank's straight into its place (gloo's all-gather of the 50 M model's 200 MB
        took 0.16 s at 2 ranks and 0.32 s at 4 here, the sends and receives 0.06 and 0.16).
        Returns something to wait() on; gather_params waits abortably."""
        bucket = self.layout.buckets[b]
        flat = self._flat[bucket.group]
        mine = self._chunk_of(flat, b, self._held[0])
        if not self._p2p_gather:
            out = flat[bucket.pstart:bucket.pstart + bucket.chunk * self.layout.world]
            return self._pg._allgather_base(out, mine)
        works = []
        tag = GATHER_TAG + b  # each bucket its own tag: its messages cannot match another's
        for j in range(self.layout.world):
            if j != self._held[0]:
                works.append(collectives.send(self._pg, mine, j, tag))
                works.append(collectives.recv(self._pg, self._chunk_of(flat, b, j), j, tag))
        return _Transfers(works)

    def zero_grad(self) -> None:
        # ZeRO-2's chunk gradients (_shard_grads) need no zeroing: finish() writes every held
        # chunk whole (from the reduced buckets, or the primary's for a backup) before a step.
        with torch.no_grad():
            for t in self._grads:
                t.zero_()
        if self.shard == "gradients":
            for p in self.params:
                p.grad = None
        self._rounds, self._loose = 0, []

    @contextmanager
    def attached(self) -> Iterator["ShardedGradients"]:
        """Post-accumulate-grad hooks that call grad_ready, for a loop without a job."""
        handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: self.grad_ready(i, p))
                   for i, p in enumerate(self.params)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    # -- state

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: optimizer state, gradients, stepped copies
        and, on the CPU, the pre-step copy's buffers and ZeRO-2's staging pool."""
        inner = self._inner
        opt = sum(t.numel() * t.element_size() for s in (inner.state.values() if inner else ())
                  for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        grads = sum(t.numel() * t.element_size() for t in self._grads + self._shard_grads)
        masters = sum(m.untyped_storage().nbytes() for ms in self._masters for m in ms)  # _full: expanded
        undo = sum(t.numel() * t.element_size() for t in self._spares.values())
        staging = sum(t.numel() * t.element_size() for ts in self._pool.values() for t in ts)
        staging += sum(t.numel() * t.element_size() for t in self._pooled.values())
        return {"optimizer_state": opt, "gradients": grads, "shard_params": masters, "step_undo": undo,
                "staging": staging}

    def _names(self, g: int) -> tuple[str, ...]:
        return _state_names(self.optimizer, self.optimizer.param_groups[self.layout.groups[g][1]])

    def steps_taken(self) -> int:
        """The optimizer's step count (0: no state yet); every held chunk steps alike."""
        inner = self._inner
        for ms in self._masters:
            for m in ms:
                st = inner.state.get(m) if inner else None
                if st:
                    return int(float(st["step"])) if "step" in st else 1
        return 0

    def _chunk_state(self, g: int, h: int) -> dict[str, torch.Tensor]:
        st = self._inner.state.get(self._masters[g][h]) if self._inner else None
        return {k: v for k, v in (st or {}).items() if k != "step"}

    def _set_state(self, step: int, tensors: list[list[dict[str, torch.Tensor]]], adopt: bool = False) -> None:
        """Take the held chunks' state (per group, per held chunk); step 0: none. `adopt`:
        the tensors are this rank's own, fresh ones (reshard, a checkpoint's chunks): kept as
        they are where dtype and device already fit, not copied."""
        inner = self._inner
        if inner is None:
            return
        inner.state.clear()
        if step == 0:
            return
        for g, ms in enumerate(self._masters):
            for h, m in enumerate(ms):
                st: dict[str, Any] = {}
                if counts_steps(inner):
                    st["step"] = step_tensor(step)
                for k in self._names(g):
                    t = tensors[g][h][k]
                    st[k] = t if adopt and t.dtype == m.dtype and t.device == m.device else t.to(m.dtype).clone()
                inner.state[m] = st

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state, for its own checkpoint file."""
        return {"format": FORMAT, "layout": self.layout.to_json(), "rank": self.rank, "held": list(self._held),
                "step": self.steps_taken(),
                "chunks": [[self._chunk_state(g, h) for h in range(len(self._held))]
                           for g in range(len(self._masters))],
                "param_groups": copy.deepcopy(self.optimizer.state_dict()["param_groups"])}

    def load_shard_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("format") != FORMAT:
            raise ValueError(f"not a sharded optimizer state ({FORMAT})")
        if sd["layout"] != self.layout.to_json() or sd["rank"] != self.rank:
            raise ValueError("this shard was written under another layout or rank; load the full state "
                             "(load_full_state_dict) or reshard")
        self.optimizer.load_state_dict({"state": {}, "param_groups": sd["param_groups"]})
        self._set_state(int(sd["step"]), sd["chunks"])

    def full_state_dict(self) -> dict[str, Any]:
        """One plain state dict in the script's optimizer's format (collective over
        the group of the last begin(); every rank gets it)."""
        sd = self.optimizer.state_dict()
        step = self.steps_taken()
        state: dict[int, dict[str, Any]] = {}
        if step:
            for g in range(len(self._masters)):
                for name in self._names(g):
                    full = torch.zeros_like(self._flat[g])
                    works = []
                    for b, bucket in enumerate(self.layout.buckets):
                        if bucket.group != g:
                            continue
                        off = self._offsets[b]
                        out = full[bucket.pstart:bucket.pstart + bucket.chunk * self.layout.world]
                        src = self._chunk_state(g, 0)[name][off:off + bucket.chunk].contiguous()
                        works.append(self._pg._allgather_base(out, src))
                    for w in works:
                        _wait(w, self._abort)
                    for i, p in enumerate(self.params):
                        if self.layout.slots[i].group != g:
                            continue
                        entry = state.setdefault(self._opt_index[id(p)], {})
                        if counts_steps(self.optimizer) and "step" not in entry:
                            entry["step"] = step_tensor(step)
                        entry[name] = self._param_in(full, i).view_as(p).clone()
        sd["state"] = dict(sorted(state.items()))
        return sd

    def load_full_state_dict(self, sd: dict[str, Any]) -> None:
        """Take this rank's chunks of a plain full state dict (any world size)."""
        self.optimizer.load_state_dict({"state": {}, "param_groups": sd["param_groups"]})
        saved = sd.get("state") or {}
        step = 0
        for entry in saved.values():
            if "step" in entry:
                step = int(float(entry["step"]))
                break
            step = 1 if entry else step
        if not saved:
            step = 0
        tensors: list[list[dict[str, torch.Tensor]]] = []
        for g in range(len(self._masters)):
            per_h: list[dict[str, torch.Tensor]] = [{} for _ in self._held]
            for name in self._names(g):
                full = torch.zeros_like(self._flat[g])
                for i, p in enumerate(self.params):
                    entry = saved.get(self._opt_index[id(p)], {})
                    if self.layout.slots[i].group == g and entry.get(name) is not None:
                        self._param_in(full, i).copy_(entry[name].reshape(-1))
                for h, j in enumerate(self._held):
                    sec = self._zeros(self.layout.shard_len(g), full.dtype)
                    for b, bucket in enumerate(self.layout.buckets):
                        if bucket.group == g:
                            sec[self._offsets[b]:self._offsets[b] + bucket.chunk].copy_(self._chunk_of(full, b, j))
                    per_h[h][name] = sec
            tensors.append(per_h)
        self._set_state(step, tensors, adopt=True)


# ---------------------------------------------------------------------------- live resharding


@dataclass(frozen=True)
class Segment:
    """Elements [lo, hi) of bucket `bucket` (bucket-local, unpadded) that `dst` needs
    from `src`: optimizer state for its new chunk `chunk` ("state"), or parameters
    for a joiner ("param"). `old_chunk`: the chunk of the old layout they are in."""

    src: str
    dst: str
    what: str
    bucket: int
    lo: int
    hi: int
    old_chunk: int
    chunk: int


def plan_transfers(old: ShardLayout, new: ShardLayout, live: list[str] | tuple[str, ...],
                   all_params: bool = False, fresh: frozenset[str] = frozenset()) -> list[Segment]:
    """Every slice that moves (or is copied locally: src == dst), in one order all
    ranks agree on (pure). `live`: the ids that can send (a planned leaver is live;
    a crashed rank is not). Among a chunk's live old holders the one sending to a
    receiver rotates with the receiver's chunk, so a new rank's needs are spread
    over the members. Raises ShardsLost if a needed chunk has no live holder.
    The parameters go to the joiners, or with `all_params` to every new member
    (after a broken all-gather: ShardedGradients.settle). `fresh`: members of the old
    layout that came back without its state (a generation broke before they got it):
    they send nothing and receive the parameters as joiners do."""
    if not old.same_parameters(new):
        raise ValueError("the two layouts were planned for different parameters")
    live_set = set(live) - set(fresh)
    old_holders = [[old.members[r].id for r in h if old.members[r].id in live_set] for h in old.holders]
    old_ids = {m.id for m in old.members}
    out: list[Segment] = []

    def source(j: int, dst: str, turn: int) -> str:
        holders = old_holders[j]
        if not holders:
            raise ShardsLost(f"chunk {j} of the old layout (held by "
                             f"{[old.members[r].id for r in old.holders[j]]}) has no live holder; its "
                             "optimizer state must come from a checkpoint")
        return dst if dst in holders else holders[turn % len(holders)]

    for b, (ob, nb) in enumerate(zip(old.buckets, new.buckets)):
        for k in range(new.world):
            nlo, nhi = nb.span(k)
            for rank in new.holders[k]:
                dst = new.members[rank].id
                for j in range(old.world):
                    olo, ohi = ob.span(j)
                    lo, hi = max(nlo, olo), min(nhi, ohi)
                    if lo < hi:
                        out.append(Segment(source(j, dst, k), dst, "state", b, lo, hi, j, k))
        for m in new.members:
            if m.id in old_ids and not all_params and m.id not in fresh:
                continue
            for j in range(old.world):
                olo, ohi = ob.span(j)
                if olo < ohi:
                    out.append(Segment(source(j, m.id, new.rank_of(m.id) + j), m.id, "param", b, olo, ohi, j, -1))
    return out


def reshard(old_layout: ShardLayout, new_layout: ShardLayout, group, group_ids: list[str], *,
            old: ShardedGradients | None = None, new: ShardedGradients | None = None,
            abort: threading.Event | None = None, resend_params: bool = False) -> dict[str, Any]:
    """Move the optimizer state from the old layout's holders to the new one's over
    `group`, whose ranks are `group_ids` (it must hold every sender and receiver).
    Returns what this rank did, for the log: bytes sent and received (and to and from
    which group ranks), bytes copied locally, and the seconds of each part.

    `old`: this rank's path under the old layout (None on a joiner); `new`: its
    path under the new layout, bound (None on a leaver, which only sends). Each
    (sender, receiver) pair exchanges one message; a joiner also receives the
    parameters; with `resend_params` on any rank, every new member receives every
    chunk's parameters from its holders (after a broken all-gather). Every rank of
    `group` calls this with the same layouts."""
    t0 = time.perf_counter()
    me = group_ids[group.rank()]
    where = {mid: r for r, mid in enumerate(group_ids)}
    missing = [m.id for m in new_layout.members if m.id not in where]
    if missing:
        raise ValueError(f"new members {missing} are not in the transfer group")
    # The step count (every holder has the same); a joiner learns it here.
    some = old if old is not None else new
    if some is None:
        raise ValueError("reshard needs this rank's old or new path (or both)")
    device = some.device  # messages travel on the parameters' device (NCCL sends device tensors)
    # [step count, resend the parameters, then per rank of the group: it has no old path]
    info = torch.zeros(2 + len(group_ids), dtype=torch.float64, device=device)
    info[0] = float(old.steps_taken()) if old is not None else 0.0
    info[1] = 1.0 if resend_params else 0.0
    info[2 + group.rank()] = 1.0 if old is None else 0.0
    _wait(collectives.allreduce_async(group, info, dist.ReduceOp.MAX), abort)
    t_agree = time.perf_counter()
    step = int(info[0])
    old_ids = {m.id for m in old_layout.members}
    fresh = frozenset(mid for r, mid in enumerate(group_ids) if info[2 + r] > 0 and mid in old_ids)
    segs = plan_transfers(old_layout, new_layout, group_ids, all_params=bool(info[1] > 0), fresh=fresh)
    opt = some.optimizer
    groups = old_layout.groups
    names = [_state_names(opt, opt.param_groups[pg]) if step else () for _d, pg in groups]
    dtypes = [dtype_named(d) for d, _pg in groups]
    old_off = old_layout.chunk_offsets()
    new_off = new_layout.chunk_offsets()

    def read(seg: Segment) -> list[torch.Tensor]:
        """The slices this (old) rank sends for `seg`."""
        assert old is not None
        ob = old_layout.buckets[seg.bucket]
        g = ob.group
        if seg.what == "param":
            return [old._flat[g][ob.pstart + seg.lo:ob.pstart + seg.hi]]
        h = old._held.index(seg.old_chunk)
        at = old_off[seg.bucket] + seg.lo - seg.old_chunk * ob.chunk
        st = old._chunk_state(g, h)
        return [st[k][at:at + seg.hi - seg.lo] for k in names[g]]

    # The new chunks' state, filled below: every real element of a new chunk is written
    # (the old chunks' spans cover each bucket), so only the padding is zeroed.
    new_state: list[list[dict[str, torch.Tensor]]] = []
    if new is not None:
        new_state = [[_chunk_sections(new_layout, g, j, names[g], dtypes[g], new) for j in new._held]
                     for g in range(len(groups))]

    def target(seg: Segment) -> list[torch.Tensor]:
        """Where this (new) rank's slices of `seg` go: views of its new buffers."""
        assert new is not None
        nb = new_layout.buckets[seg.bucket]
        g = nb.group
        if seg.what == "param":
            return [new._flat[g][nb.pstart + seg.lo:nb.pstart + seg.hi]]
        h = new._held.index(seg.chunk)
        at = new_off[seg.bucket] + seg.lo - seg.chunk * nb.chunk
        return [new_state[g][h][k][at:at + seg.hi - seg.lo] for k in names[g]]

    outgoing: dict[str, list[Segment]] = {}
    incoming: dict[str, list[Segment]] = {}
    mine: list[Segment] = []
    t_plan = time.perf_counter()
    local = 0
    for seg in segs:
        if seg.what == "state" and not step:
            continue
        if seg.src == me and seg.dst == me:
            mine.append(seg)
        elif seg.src == me:
            outgoing.setdefault(seg.dst, []).append(seg)
        elif seg.dst == me:
            incoming.setdefault(seg.src, []).append(seg)
    # Each slice travels as its own message, straight from the sender's state to the
    # receiver's new buffers (no packing, no unpacking copy); the tag is its place in the
    # pair's list, which both sides build alike. Per peer the lower rank sends first and
    # the higher receives first, so an in-order backend (NCCL's pair streams) cannot deadlock.
    # The messages are posted before this rank's local copies, which then run while they
    # travel (disjoint elements of the new buffers): a peer never waits for them. Posted
    # after them, a leave at world 4 on 2 cores had the senders wait 0.8-0.9 s for the
    # receivers' local copies before anything moved.
    works: list = []
    sent = received = 0
    for peer in sorted(set(outgoing) | set(incoming), key=lambda m: where[m]):
        sends = [t for s in outgoing.get(peer, ()) for t in read(s)]
        recvs = [t for s in incoming.get(peer, ()) for t in target(s)]
        order = ((True, sends), (False, recvs)) if group.rank() < where[peer] else ((False, recvs), (True, sends))
        for is_send, ts in order:
            for tag, t in enumerate(ts):
                if is_send:
                    works.append(collectives.send(group, t.detach(), where[peer], tag))
                    sent += t.numel() * t.element_size()
                else:
                    works.append(collectives.recv(group, t, where[peer], tag))
                    received += t.numel() * t.element_size()
    t_pack = time.perf_counter()
    with torch.no_grad():
        for seg in mine:
            for t, src in zip(target(seg), read(seg)):
                if t.data_ptr() != src.data_ptr():
                    t.copy_(src)
                local += t.numel() * t.element_size()
    t_local = time.perf_counter()
    if works:
        _wait_p2p(works, abort)
    t_p2p = time.perf_counter()
    if new is not None:
        new._set_state(step, new_state, adopt=True)  # (the masters follow the parameters at the next step)
    t_end = time.perf_counter()
    return {"sent_bytes": sent, "to": sorted(where[d] for d in outgoing),
            "received_bytes": received, "from": sorted(where[s] for s in incoming),
            "messages": len(works), "local_bytes": local,
            "s": {"agree": round(t_agree - t0, 4), "plan": round(t_plan - t_agree, 4),
                  "post": round(t_pack - t_plan, 4), "local": round(t_local - t_pack, 4),
                  "p2p": round(t_p2p - t_local, 4), "set_state": round(t_end - t_p2p, 4)}}


# ---------------------------------------------------------------------------- the job's gradient path


def _line(n_bytes: int) -> int:
    """`n_bytes` rounded up to a cache line (how a Recycler carves)."""
    return -(-n_bytes // 64) * 64


def _touched(need: int, stop: threading.Event) -> torch.Tensor:
    """`need` bytes of fresh host memory (hostmem.empty), touched a slice at a time until
    all of it is or `stop` is set: the part touched."""
    buf = hostmem.empty(need, torch.uint8)
    done, piece = 0, 64 << 20
    while done < need and not stop.is_set():
        buf[done:done + piece].zero_()
        done = min(need, done + piece)
    return buf[:done]


class _Toucher:
    """_touched on a helper thread, of `need()` bytes (worked out there too): `done` once it
    is; `take` stops it (after the slice in hand) and gives the part touched."""

    def __init__(self, need: Callable[[], int], name: str, key: Any = None) -> None:
        self.t0 = time.monotonic()
        self.key = key  # what it prepares for (ShardedPath._ready_for)
        self.stop, self.done = threading.Event(), threading.Event()
        self._buf: torch.Tensor | None = None
        self._thread = threading.Thread(target=self._run, args=(need,), name=name, daemon=True)
        self._thread.start()

    def _run(self, need: Callable[[], int]) -> None:
        try:
            self._buf = _touched(need(), self.stop)
        except Exception as e:  # noqa: BLE001 - an optimization: the move allocates as before
            log.warning("sharded: touching memory ahead failed (the move allocates it itself): %s", e)
        finally:
            self.done.set()

    def take(self) -> torch.Tensor | None:
        self.stop.set()
        self._thread.join()
        buf, self._buf = self._buf, None
        return buf if buf is not None and buf.numel() else None


def _chunk_sections(lay: ShardLayout, g: int, j: int, names, dtype: torch.dtype,
                    sg: "ShardedGradients") -> dict[str, torch.Tensor]:
    """New state tensors (one per name) for chunk j's section of group g, on `sg`'s device
    and out of its recycler where it has one, their padding zeroed; the caller writes every
    real element (a reshard's slices, a checkpoint's)."""
    n, offs = lay.shard_len(g), lay.chunk_offsets()
    st = {k: sg._empty(n, dtype) for k in names}
    for b, bucket in enumerate(lay.buckets):
        lo, hi = bucket.span(j)
        if bucket.group == g and hi - lo < bucket.chunk:
            for t in st.values():
                t[offs[b] + hi - lo:offs[b] + bucket.chunk].zero_()
    return st


def member_of(worker_id: str) -> Member:
    """A worker id as a layout member: its host is the id's first "/"-part
    (`host/device/pid`, the daemon's ids), else the whole id."""
    return Member(worker_id, worker_id.split("/", 1)[0])


class ShardedPath(gradients.GradientPath):
    """ElasticJob's sharded gradient path (gradients.GradientPath over ShardedGradients).

    Per generation the job calls `bind` (the group), agrees on the replicated
    state (`capture` / `apply`: progress, buffers, extra state, the optimizer's
    hyperparameters; the parameters only when no live layout holds them: the first
    start, a restore), then `reshard`, which plans this generation's layout from
    its members and moves the optimizer state (and a joiner's parameters) from the
    old layout's holders (zero.reshard). A planned leaver's chunks move first, over
    the old group (`hand_over`, from the job's before_group / on_leave hooks).
    A checkpoint, `fingerprint` and `capture_full` gather the full state: every
    rank must call them together."""

    gathers = True  # capture_full / fingerprint are collectives

    def __init__(self, shard: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 params: list[torch.Tensor], bucket_mb: float, replicas: int = 1) -> None:
        if shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {SHARD_MODES} (or None for replicated), not {shard!r}")
        if replicas not in (1, 2):
            raise ValueError(f"shard_replicas must be 1 or 2, not {replicas!r}")
        check_optimizer(optimizer)
        _param_groups_of(params, optimizer)
        self.shard = shard
        self.replicas = replicas
        self._model = model
        self._opt = optimizer
        self._params = params
        self._bucket_mb = bucket_mb
        self.device = torch.device("cpu")
        self.sg: ShardedGradients | None = None
        self.layout: ShardLayout | None = None
        self.pg = None
        self.rank = -1
        self.members: tuple[str, ...] = ()
        self.abort: threading.Event | None = None
        self._tail_buf: torch.Tensor | None = None
        self._tail_work = None  # the tail's all-reduce of the step in flight (drop)
        self._max_norm: float | None = None
        self.grad_norm: float | None = None  # the last step's global norm (clipping), known after step()
        self._pending_full: dict | None = None  # a full optimizer state (checkpoint) to load at reshard
        # A sharded checkpoint to take the chunks from at reshard ({"path", "sha256", "host"}: where the
        # restoring rank read it; ranks on that host read their chunks from its files, _restore_chunks).
        self._pending_ckpt: dict | None = None
        self._peer_members: list[str] | None = None  # the old layout's members, from the state a joiner got
        self._resend_params = False  # a broken all-gather was settled: every chunk's parameters are resent
        # Takes each rank's chunks of a sharded checkpoint at a restore (the job sets it:
        # checkpoint.restore_chunks; zero.py does not import the checkpoint module).
        self.restore_chunks: Any = None
        self._joiner_memory: Recycler | None = None  # prepare_join's, for the first layout's buffers
        self._member_prep: _Toucher | None = None  # ready_for_join's, for the next layout's buffers
        self._touched_ahead = 0  # of the move under way: bytes its recycler got touched ahead (logged)

    # -- layout
    def _layout(self, members) -> ShardLayout:
        return shard_layout(self._params, self._opt, [member_of(m) for m in members], self.replicas, self._bucket_mb)

    @property
    def _restoring(self) -> bool:
        """A restore (a checkpoint's optimizer state) is still to be taken up at reshard."""
        return self._pending_ckpt is not None or self._pending_full is not None

    def state_key(self) -> int | None:
        """What this rank's optimizer state is, for the generation's agreement
        (job._sync_state): 0 before any layout was bound (the script's own state, whole);
        > 0 its chunks of one layout (a digest of the layout: the ranks holding chunks
        must hold them of the same one); < 0 a restore still to be taken up at reshard
        (a digest of the checkpoint). None: this rank has the rest of the state but not
        its chunks: it received the state as a joiner and its reshard did not finish
        (the generation broke); it must be served again as a rank without state."""
        if self._pending_ckpt is not None:
            return -1 - zlib.crc32(json.dumps(self._pending_ckpt, sort_keys=True, default=str).encode())
        if self._pending_full is not None:
            return -1
        if self.sg is None:
            return None if self._peer_members else 0
        return 1 + zlib.crc32(self.layout.to_json().encode()) if self.layout is not None else 0

    def state_lost(self, lost: tuple[str, ...] | list[str]) -> bool:
        """True if the loss of `lost` (crashed, or back without their state) leaves a
        chunk of the current layout with no live holder (shard_replicas=1, or both
        replicas of a chunk): the optimizer state must come from a checkpoint. A
        restore still pending loses nothing."""
        lay = self.layout
        if lay is None or not lost or self._restoring:
            return False
        gone = set(lost)
        return any(all(lay.members[r].id in gone for r in h) for h in lay.holders)

    def hand_over(self, left: tuple[str, ...] | list[str]) -> None:
        """A planned leave, over the OLD group (every old member calls it, the leavers
        too): the leavers' chunks move to the survivors' layout before the group goes."""
        if self.layout is None or self.sg is None or not left or self.pg is None:
            return
        ids = list(self.members)
        survivors = [m for m in ids if m not in set(left)]
        if not survivors:
            return
        t0 = time.perf_counter()
        inter = self._layout(survivors)
        me = ids[self.rank]
        new = None
        t1 = time.perf_counter()
        if me in survivors:
            new = self._new_path(inter, survivors.index(me))
            new.bind(reuse=self.sg)
        t2 = time.perf_counter()
        moved = reshard(self.layout, inter, self.pg, ids, old=self.sg, new=new, abort=self.abort)
        memory = self._take_up(new, inter if new is not None else None)
        self._log_move("hand_over", len(ids), len(survivors), t1 - t0, t2 - t1, {**(moved or {}), **memory})

    def settle(self, committed_before: int, committed_now: int) -> None:
        """Once every rank's step is known, before any state is sent: a step this rank
        dropped after its shard's optimizer step (its all-gather broke) is kept if a rank
        holding the state committed it (its gather finished), else undone (with its
        GradScaler update); either way the next reshard sends every chunk's parameters
        from their holders. A restore replaces it all."""
        sg = self.sg
        if sg is None or not sg.step_in_doubt:
            return
        if self._restoring:
            sg._undo = None  # restored from a checkpoint: state and parameters come from it
            return
        keep = committed_now > committed_before
        log.warning("sharded: the step after %d was dropped after this rank's shard stepped (its parameter "
                    "all-gather broke); the agreed state is at step %d, so it is %s", committed_before,
                    committed_now, "kept" if keep else "undone")
        sg.settle(keep)
        self._resend_params = True

    def reshard(self, old_members, new_members) -> None:
        t0 = time.perf_counter()
        new_members = list(new_members)
        new_lay = self._layout(new_members)
        sg = self.sg
        # Nothing moves when every rank holds the generation's layout already (a planned leave,
        # whose hand_over moved the leavers' chunks to the survivors' layout, or a generation
        # formed again with the same members), no restore is pending and no rank settled a
        # broken all-gather (its parameters are resent). Whether one did is this rank's own
        # knowledge, so the ranks agree (one small all-reduce) before any of them skips.
        moves = not (sg is not None and new_lay == self.layout and not self._restoring and not self._resend_params
                     and sg.rank == new_lay.rank_of(self.members[self.rank]))
        flag = torch.tensor([1.0 if moves else 0.0], dtype=torch.float64, device=self.device)
        _wait(collectives.allreduce_async(self.pg, flag, dist.ReduceOp.MAX), self.abort)
        if float(flag[0]) == 0.0:
            self._peer_members = None
            sg._pg, sg._abort = self.pg, self.abort
            self._log_move("reshard", len(new_members), len(new_members), time.perf_counter() - t0, 0.0,
                           {"kept": True})
            return
        new = self._new_path(new_lay, new_members.index(self.members[self.rank]), self._restoring)
        # Taken up only once the move succeeds (below): a generation that breaks inside it
        # leaves the restore, or the joiner's source layout, pending for the next one.
        full, ckpt, peers = self._pending_full, self._pending_ckpt, self._peer_members
        old_lay = self.layout
        if old_lay is None and full is None and ckpt is None and peers:
            old_lay = self._layout(peers)  # a joiner: the layout its state came from
        t1 = time.perf_counter()
        # a joiner (or a member that came back without the state) receives every chunk's
        # parameters from the members (plan_transfers): its own values are not copied
        receives = self.sg is None and full is None and ckpt is None and old_lay is not None
        new.bind(reuse=self.sg, values=not receives)
        t2 = time.perf_counter()
        moved = None
        if ckpt is not None:
            moved = self._restore_chunks(new, ckpt)  # a restore: each rank's chunks from the shard files
        elif full is not None:
            new.load_full_state_dict(full)  # a restore: every rank takes its chunks of the full state
            moved = {"loaded_full_state_s": round(time.perf_counter() - t2, 4)}
        elif old_lay is not None:
            moved = reshard(old_lay, new_lay, self.pg, new_members, old=self.sg, new=new, abort=self.abort,
                            resend_params=self._resend_params)
        new._pg, new._abort = self.pg, self.abort  # full_state_dict before the first step
        memory = self._take_up(new, new_lay)
        self._resend_params = False
        self._pending_full = self._pending_ckpt = self._peer_members = None
        self._log_move("reshard", len(old_lay.members) if old_lay is not None else 0, len(new_members),
                       t1 - t0, t2 - t1, {**(moved or {}), **memory})

    def _new_path(self, lay: ShardLayout, rank: int, restoring: bool = False) -> ShardedGradients:
        """This rank's path for layout `lay`. On the CPU its buffers until the move is done
        (bind's, the new state's) are carved out of memory the rank holds where they fit
        (hostmem.py): the current path's pre-step copy, dead between steps, and when a
        checkpoint's state replaces it (`restoring`) its optimizer state too; and the memory
        touched ahead: a joiner's (prepare_join, while it waited) or a member's
        (ready_for_join / ready_for_leave, while the job held a joiner or a leave back)."""
        new = ShardedGradients(self._params, self._opt, lay, rank, self.shard)
        prep, self._member_prep = self._member_prep, None
        if self.device.type == "cpu":
            rec, self._joiner_memory = self._joiner_memory or Recycler(), None
            if prep is not None:
                rec.give(prep.take())
            self._touched_ahead = rec.free_bytes
            if self.sg is not None:
                rec.give(*self.sg.take_spares(), *(self.sg.take_state() if restoring else ()))
            new.recycler = rec
        return new

    def _take_up(self, new: ShardedGradients | None, lay: ShardLayout | None) -> dict[str, int]:
        """The move to `new` is done: it is this rank's path. What its recycler did not hand
        out and what the old path held go back to the OS now, where the new path's first
        step (its pre-step copy) finds those pages again (freed memory is reused warm;
        memory held back here would leave it fresh pages instead, slower on a VM)."""
        old, stats = self.sg, {}
        if new is not None:
            stats = new.recycler.stats() if new.recycler is not None else {}
            if self._touched_ahead:
                stats["touched_ahead_bytes"], self._touched_ahead = self._touched_ahead, 0
            new.release_recycler()
            if old is not None:
                old.discard()
        self.sg, self.layout = new, lay
        return stats

    def prepare_join(self, world: int, stop: threading.Event, prepared: threading.Event | None = None) -> None:
        """A joiner about to ask to be admitted to a job that will then have `world` members:
        the host memory its first layout's bind and reshard allocate (host_bytes), allocated
        and touched now (on the caller's thread, in slices until `stop` is set; then
        `prepared` is set and the joiner asks), so that its reshard and first step carve
        their buffers out of it instead of faulting pages in inside the pause. The layout is
        a guess (any `world` members; the sizes depend only on how many): where it is wrong,
        the rest is allocated as before."""
        if self.device.type != "cpu" or self.sg is not None or world < 1:
            return
        lay = self._layout([f"joining-{i}" for i in range(world)])
        need = ShardedGradients(self._params, self._opt, lay, world - 1, self.shard).host_bytes()
        rec = Recycler()
        rec.give(_touched(need, stop))
        if prepared is not None:
            prepared.set()
        # Held only while admission is near: a joiner kept waiting (the job paused by its
        # hours, say) gives the memory back rather than sit on it on someone's workstation.
        if stop.wait(JOINER_MEMORY_HOLD_S):
            self._joiner_memory = rec
        else:
            rec.release()

    def _prepares(self) -> bool:
        """Whether this rank's moves allocate host memory worth touching ahead (a CPU path
        with a layout: it has state to move)."""
        return self.device.type == "cpu" and self.sg is not None and self.layout is not None

    def ready_for_join(self, world: int) -> bool:
        """A joiner is queued and this member's next layout will have `world` members: False
        while this rank still touches the host memory that layout's move allocates afresh
        (_member_need) on a helper thread, started at the first call; True once that is done,
        where there is nothing to prepare (not the CPU, no layout yet, no more members), or
        MEMBER_PREPARE_MAX_S after the first call. The job holds the join back while any rank
        says False (job.py), so the reshard carves its buffers out of memory touched while the
        job still trained instead of faulting pages in inside the pause (a ZeRO-1 member's
        200 MB of fresh state at a join 1 -> 2 took 0.5-1.4 s to fault in on this project's VMs)."""
        members = list(self.members)
        if not self._prepares() or world <= len(members):
            return True
        return self._ready_for(members + [f"joining-{i}" for i in range(world - len(members))], self.rank,
                               MEMBER_PREPARE_MAX_S)

    def ready_for_leave(self, leaving) -> bool:
        """The last commit asked for `leaving` to leave: False while this survivor still
        touches the host memory its hand-over allocates afresh for the survivors' layout (on
        a helper thread, started at the first call); True once that is done, on a leaver
        (it only sends), where there is nothing to prepare, or LEAVE_PREPARE_MAX_S after the
        first call. `leaving` empty (no leave known yet): True only where nothing is ever
        prepared, so on the CPU a leave waits one commit, in which the survivors touch (a
        ZeRO-1 survivor of 2 -> 1 takes over 200 MB more state: its hand-over faulted it in
        for 0.65-0.95 s of a 1.0-1.5 s pause on this project's VMs)."""
        if not self._prepares():
            return True
        if not leaving:
            return False
        gone = set(leaving)
        survivors = [m for m in self.members if m not in gone]
        me = self.members[self.rank]
        if me in gone or not survivors:
            return True
        return self._ready_for(survivors, survivors.index(me), LEAVE_PREPARE_MAX_S)

    def _ready_for(self, members: list[str], rank: int, limit_s: float) -> bool:
        """Touch, on a helper thread, what this rank's move to a layout of `members` (this
        rank at `rank`) allocates afresh; True once done or `limit_s` after it began. A
        preparation for another layout is stopped and let go first."""
        key = (tuple(members), rank)
        prep = self._member_prep
        if prep is not None and prep.key != key:
            prep.take()
            prep = self._member_prep = None
        if prep is None:
            sg = self.sg  # as it is now, for the helper
            prep = self._member_prep = _Toucher(lambda: self._member_need(sg, members, rank),
                                                "eltctl-prepare-members", key)
        return prep.done.is_set() or time.monotonic() - prep.t0 >= limit_s

    def _member_need(self, old: ShardedGradients, members: list[str], rank: int) -> int:
        """The bytes this member's path `old` would allocate afresh at a move to a layout of
        `members` (this rank at `rank`; a joiner's placeholder ids stand for hosts of their
        own: the sizes depend on how many): the new path's host_bytes less what bind keeps
        (a parameter buffer of the same geometry, ZeRO-1's gradient buffer, ZeRO-2's chunk
        gradients of the same size). The pre-step copy, which the recycler gets too, is not
        counted off: carved best fit out of two ranges, a total that only just fits can
        leave a buffer with no range left that is big enough (the toy model of
        tests/runtime/train/test_sharded_job.py: 4.9 of 39 KB fresh); all in the touched range,
        everything fits, and what nobody took goes back at the end of the move."""
        lay = self._layout(members)
        new = ShardedGradients(self._params, self._opt, lay, rank, self.shard)
        need = new.host_bytes()
        for g, (dtype, _pg) in enumerate(lay.groups):
            item = dtype_named(dtype).itemsize
            if g < len(old._flat) and old._geometry(g) == new._geometry(g):
                need -= _line(lay.padded(g) * item) * (2 if self.shard == "optimizer" else 1)
            n = len(new._held) * lay.shard_len(g)
            if self.shard == "gradients" and g < len(old._shard_grads) and old._shard_grads[g].numel() == n:
                need -= _line(n * item)
        return max(0, need)

    def _restore_chunks(self, new: ShardedGradients, ckpt: dict) -> dict:
        """A restore from a sharded checkpoint (`ckpt`: where the restoring rank found it),
        through the loader the job gave (checkpoint.restore_chunks: a collective)."""
        if self.restore_chunks is None:
            raise ShardsLost(f"no loader for the sharded checkpoint {ckpt.get('path')} (ShardedPath.restore_chunks)")
        return self.restore_chunks(ckpt, new, self.pg, member_of(self.members[self.rank]).host, self.abort)

    def _log_move(self, what: str, old_world: int, new_world: int, plan_s: float, bind_s: float,
                  moved: dict | None) -> None:
        """One line per move of the shards (hand_over, reshard): where its time went (and how
        much of the new path's memory was recycled or allocated afresh)."""
        log.debug("sharded: %s %d -> %d ranks: %s", what, old_world, new_world,
                 json.dumps({"layout_s": round(plan_s, 4), "bind_s": round(bind_s, 4), **(moved or {})}))

    def memory(self) -> dict[str, int]:
        return self.sg.memory() if self.sg is not None else {}

    def state_bytes_per_rank(self) -> list[int]:
        """Optimizer-state bytes each rank of the layout keeps (from the layout: no communication)."""
        lay, sg = self.layout, self.sg
        if lay is None or sg is None or sg.steps_taken() == 0:
            return [0] * (lay.world if lay else 0)
        per_chunk = sum(lay.shard_len(g) * dtype_named(d).itemsize * len(sg._names(g))
                        for g, (d, _pg) in enumerate(lay.groups))
        return [len(lay.held(r)) * per_chunk for r in range(lay.world)]

    # -- the step
    def begin(self, tail_size: int) -> None:
        if self._tail_buf is None or self._tail_buf.numel() != tail_size:
            self._tail_buf = torch.zeros(tail_size, dtype=gradients.TAIL_DTYPE, device=self.device)
        else:
            self._tail_buf.zero_()
        self._tail_work = None
        self.sg.begin(self.pg, self.abort)

    def begin_round(self) -> None:
        self.sg.begin(self.pg, self.abort, accumulate=True)

    def finish_round(self) -> None:
        self.sg.finish_round()

    def grad_ready(self, index: int, p: torch.Tensor) -> None:
        if self.sg is not None:
            self.sg.grad_ready(index, p)

    def end_backward(self) -> None:
        pass  # ShardedGradients stops launching in finish(); hooks outside begin..finish are ignored there

    def failed(self) -> BaseException | None:
        return self.sg.failed() if self.sg is not None else None

    def tail(self) -> torch.Tensor:
        return self._tail_buf

    def finish(self, abort: threading.Event) -> torch.Tensor:
        try:
            self.sg.finish()  # the buckets (reduce-scatter / all-reduce), then the tail as its own all-reduce
            self._tail_work = collectives.allreduce_async(self.pg, self._tail_buf)
            collectives.wait_work(self._tail_work, abort)
        except collectives.Aborted:
            raise
        except Exception as e:  # noqa: BLE001 - a broken group
            raise collectives.Aborted(f"a sharded reduction failed: {e}", backend_error=True) from e
        return self._tail_buf.to("cpu", copy=True)

    def unscale_(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        pass  # the shard's own optimizer is unscaled in step() (ShardedGradients.step)

    def clip_grad_norm_(self, max_norm: float, abort: threading.Event) -> float:
        """Deferred to step(): the norm is summed over the shards there (its value: `grad_norm`)."""
        self._max_norm = max_norm
        return float("nan")

    def step(self, optimizer: torch.optim.Optimizer, scaler: Any, abort: threading.Event) -> bool:
        max_norm, self._max_norm = self._max_norm, None
        try:
            res = self.sg.step(max_norm, scaler)
        except collectives.Aborted:
            raise
        except Exception as e:  # noqa: BLE001
            raise collectives.Aborted(f"a sharded step's collective failed: {e}", backend_error=True) from e
        self.grad_norm = res.grad_norm
        return res.skipped

    def zero(self) -> None:
        if self.sg is not None:
            self.sg.zero_grad()

    def drop(self) -> None:
        if self._tail_work is not None and not collectives.settled([self._tail_work]):
            self._tail_buf = None  # its all-reduce may still write into it: begin() makes another
        self._tail_work = None
        if self.sg is not None:
            self.sg.drop()

    # -- state
    def _replicated(self, model: torch.nn.Module, with_params: bool) -> dict:
        params = {id(p) for p in self._params}
        return {k: v for k, v in model.state_dict(keep_vars=True).items()
                if with_params or id(v) not in params}

    def capture(self, model, optimizer, progress, extra) -> dict:
        """What a joiner (or a lagging rank) receives: everything replicated; the
        parameters only when no live layout holds them (the first start, a restore);
        the full optimizer state only when it came from a checkpoint."""
        with_params = self.layout is None or self._restoring
        opt = {"state": self._pending_full["state"] if self._pending_full is not None else {},
               "param_groups": copy.deepcopy(optimizer.state_dict()["param_groups"])}
        if self._pending_ckpt is not None:
            opt["checkpoint"] = self._pending_ckpt
        model_sd = {k: v.detach() for k, v in self._replicated(model, with_params).items()}
        return {"model": model_sd, "optimizer": opt, "extra_state": state_mod.extra_state_dicts(extra),
                "progress": dict(progress), "rng": state_mod.rng_state(),
                "optimizer_class": state_mod.optimizer_class(optimizer),
                "zero": {"members": [m.id for m in self.layout.members] if self.layout is not None else None}}

    def apply(self, saved, model, optimizer, extra) -> dict:
        """Adopt a state: from a peer (no optimizer state: it comes by reshard) or
        from a checkpoint (a full optimizer state: every rank loads its chunks at reshard)."""
        opt = saved.get("optimizer") or {}
        self._pending_full = self._pending_ckpt = None  # what this state says replaces any earlier one
        if opt.get("checkpoint"):
            self._pending_ckpt = dict(opt["checkpoint"])  # a sharded checkpoint: its chunks at reshard
        elif opt.get("state"):
            self._pending_full = opt
        zero = saved.get("zero") or {}
        self._peer_members = zero.get("members")
        plain = {**saved, "optimizer": {"state": {}, "param_groups": opt.get("param_groups",
                                                                               optimizer.state_dict()["param_groups"])}}
        return state_mod.apply(plain, model, optimizer, extra)

    def capture_full(self, model, optimizer, progress, extra) -> dict:
        """The whole state as one plain dict (a checkpoint): the optimizer state gathered
        from the shards. A collective: every rank of the group calls it."""
        full = self.sg.full_state_dict() if self.sg is not None else optimizer.state_dict()
        return {"model": model.state_dict(), "optimizer": full, "extra_state": state_mod.extra_state_dicts(extra),
                "progress": dict(progress), "rng": state_mod.rng_state(),
                "optimizer_class": state_mod.optimizer_class(optimizer)}

    def shard_checkpoint_state(self, model, progress, extra) -> dict | None:
        """What a sharded checkpoint holds besides the optimizer's chunks (the job hands it
        to checkpoint.save_sharded with `self.sg`, `self.pg` and the layout's hosts), or
        None when no layout is bound yet (the caller then gathers: capture_full)."""
        if self.sg is None or self.pg is None or self.layout is None:
            return None
        return {"model": model.state_dict(), "optimizer": None, "extra_state": state_mod.extra_state_dicts(extra),
                "progress": dict(progress), "rng": state_mod.rng_state(),
                "optimizer_class": state_mod.optimizer_class(self.sg.optimizer)}

    def fingerprint(self, model, optimizer, extra) -> str:
        """Hash of the gathered state (a collective: every rank calls it); identical on every rank."""
        full = self.sg.full_state_dict() if self.sg is not None and self.pg is not None else optimizer.state_dict()
        return state_mod.fingerprint_of(model.state_dict(), full["state"], extra)


def sharded_path(shard: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 params: list[torch.Tensor], bucket_mb: float, replicas: int = 1) -> ShardedPath:
    """ElasticJob's gradient path for shard="optimizer" | "gradients" (job._gradient_path)."""
    return ShardedPath(shard, model, optimizer, params, bucket_mb, replicas)



# ---------------------------------------------------------------------------- sharded checkpoints
# (runtime/checkpoint.py writes and reads the files; these take a rank's part and the facts that
# rebuild the full state from the parts without torch.distributed.)

SHARD_FILE_FORMAT = "eltctl-zero-shard/1"


def checkpoint_shard(sg: ShardedGradients) -> dict[str, Any]:
    """This rank's PRIMARY chunk's optimizer state, cloned to CPU (consistent with the step
    just taken): `{"format", "chunk", "state": [per group {name: tensor}]}`. Backups are not
    saved: the primaries of all ranks cover every chunk once."""
    step = sg.steps_taken()
    state = [({k: v.detach().to("cpu", copy=True) for k, v in sg._chunk_state(g, 0).items()} if step else {})
             for g in range(len(sg._masters))]
    return {"format": SHARD_FILE_FORMAT, "chunk": sg.rank, "state": state}


def checkpoint_layout(sg: ShardedGradients) -> dict[str, Any]:
    """Plain JSON facts (the layout, the optimizer's step count, the state names per group,
    each parameter's index in the script's optimizer and its shape) from which the full
    optimizer state is rebuilt out of the shard files (checkpoint.assemble_optimizer)."""
    step = sg.steps_taken()
    return {"format": FORMAT, "layout": json.loads(sg.layout.to_json()), "step": step,
            "optimizer": type(sg.optimizer).__name__, "counts_steps": counts_steps(sg.optimizer),
            "names": [list(sg._names(g)) if step else [] for g in range(len(sg.layout.groups))],
            "params": [[sg._opt_index[id(p)], list(p.shape)] for p in sg.params]}


def checkpoint_param_groups(sg: ShardedGradients) -> list[dict[str, Any]]:
    """The script's optimizer's param_groups (hyperparameters), as its state_dict() gives them."""
    return copy.deepcopy(sg.optimizer.state_dict()["param_groups"])


def _checkpoint_pieces(sg: ShardedGradients, sharded: dict[str, Any]) -> Iterator[tuple[int, ...]]:
    """Where each piece of this rank's held chunks (under ITS layout) lies in a sharded
    checkpoint (`sharded`: the manifest's entry): (h, new group, offset in held chunk h's
    section, old chunk, old group, offset in that chunk's section, length)."""
    old = ShardLayout.from_json(json.dumps(sharded["layout"]))
    new = sg.layout
    old_bucket = {i: b for b, bk in enumerate(old.buckets) for i in bk.params}
    new_bucket = {i: b for b, bk in enumerate(new.buckets) for i in bk.params}
    old_off, new_off = old.chunk_offsets(), new.chunk_offsets()
    for i, (os_, ns) in enumerate(zip(old.slots, new.slots)):
        ob, nb = old.buckets[old_bucket[i]], new.buckets[new_bucket[i]]
        o_at, n_at = os_.offset - ob.start, ns.offset - nb.start  # bucket-local starts
        for h, j in enumerate(sg._held):
            lo, hi = max(n_at, j * nb.chunk), min(n_at + ns.numel, (j + 1) * nb.chunk)
            k = lo - n_at
            while k < hi - n_at:
                q = o_at + k
                jo = q // ob.chunk
                take = min(hi - n_at - k, (jo + 1) * ob.chunk - q)
                yield (h, ns.group, new_off[new_bucket[i]] + n_at + k - j * nb.chunk,
                       jo, os_.group, old_off[old_bucket[i]] + q - jo * ob.chunk, take)
                k += take


def checkpoint_chunks_needed(sg: ShardedGradients, sharded: dict[str, Any]) -> list[int]:
    """The chunks of a sharded checkpoint (`sharded`: the manifest's entry) that this rank's
    held chunks under ITS layout take elements from (load_checkpoint_chunks reads only these)."""
    return sorted({jo for _h, _g, _dst, jo, _og, _src, _n in _checkpoint_pieces(sg, sharded)})


def load_checkpoint_chunks(sg: ShardedGradients, sharded: dict[str, Any], shards: list[list[dict[str, torch.Tensor]]],
                           param_groups: list[dict[str, Any]]) -> None:
    """Load this rank's chunks (under ITS layout, any world size) straight from a sharded
    checkpoint's per-chunk states (`shards[j]`: chunk j's [per group {name: tensor}], e.g.
    memory-mapped files; only those of checkpoint_chunks_needed are looked up), copying
    only the element ranges its held chunks need: no full state is built. `sharded`: the
    manifest's entry (checkpoint_layout)."""
    new = sg.layout
    # its hyperparameters and state names would be another class's
    reason = state_mod.optimizer_mismatch(sharded.get("optimizer"), state_mod.optimizer_class(sg.optimizer))
    if reason:
        raise state_mod.OptimizerMismatch(reason)
    if sharded["params"] != [[sg._opt_index[id(p)], list(p.shape)] for p in sg.params]:
        raise ValueError("the checkpoint was written for other parameters (order, shapes or optimizer)")
    sg.optimizer.load_state_dict({"state": {}, "param_groups": param_groups})
    step = int(sharded["step"])
    tensors: list[list[dict[str, torch.Tensor]]] = []
    for g in range(len(new.groups)):
        dtype = dtype_named(new.groups[g][0])
        tensors.append([_chunk_sections(new, g, j, sg._names(g), dtype, sg) for j in sg._held]
                       if step else [{} for _ in sg._held])
        have = sharded["names"][g] if g < len(sharded["names"]) else []
        for per_h in tensors[-1]:  # a state the checkpoint lacks (say amsgrad turned on since) starts at zero
            for k, t in per_h.items():
                if k not in have:
                    t.zero_()
    if step:
        for h, g, dst, jo, og, src, take in _checkpoint_pieces(sg, sharded):
            for name in sharded["names"][og]:
                tensors[g][h][name][dst:dst + take].copy_(shards[jo][og][name][src:src + take])
    sg._set_state(step, tensors, adopt=True)

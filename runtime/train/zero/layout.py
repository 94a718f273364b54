"""The shard layout (pure): which rank holds which chunk of which bucket.

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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from ...member.plan import host_of
from .. import gradients

# A large bucket pads to a multiple of this (lcm(1..8)) and of the world size, so its padded
# width, and the flat buffers, stay the same through membership changes among 1 to 8 ranks
# (_chunk); only buckets of at least PAD_MIN_QUANTA such multiples do (padding under 1/64).
PAD_QUANTUM = 840
PAD_MIN_QUANTA = 64




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


def param_groups_of(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[int]:
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
    pgs = param_groups_of(params, optimizer)
    return plan_shards([(str(p.dtype), g) for p, g in zip(params, pgs)], [p.numel() for p in params],
                       [p.element_size() for p in params], members, replicas, bucket_bytes)


def members_layout(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, worker_ids,
                   replicas: int = 1, bucket_mb: float = 25.0) -> ShardLayout:
    """The layout of the workers `worker_ids` (in rank order) for `params` (pure)."""
    return shard_layout(params, optimizer, [member_of(m) for m in worker_ids], replicas, bucket_mb)


def member_of(worker_id: str) -> Member:
    """A worker id as a layout member: its host is the id's first "/"-part
    (`host/device/pid`, the daemon's ids), else the whole id."""
    return Member(worker_id, host_of(worker_id))


@dataclass(frozen=True)
class Placement:
    """One rank's place in a layout (pure, fixed for the life of its path): the chunks it
    holds, where each bucket's chunk starts in a held chunk's section, each parameter's
    bucket, and where these lie in a padded buffer (views, never copies). The buffers, the
    reducer and the stepper of a ShardedGradients are each handed the same one."""

    layout: ShardLayout
    rank: int
    shard: str  # "optimizer" (ZeRO-1) or "gradients" (ZeRO-2)
    held: tuple[int, ...]  # its own chunk first, then those it backs up
    full: bool  # every chunk is held here: the step needs no collective after the reduction
    offsets: tuple[int, ...]  # per bucket: where its chunk starts in a section of its group
    bucket_of: tuple[int, ...]  # per parameter: its bucket

    @classmethod
    def of(cls, layout: ShardLayout, rank: int, shard: str) -> "Placement":
        held = layout.held(rank)
        bucket_of = [0] * len(layout.slots)
        for b, bucket in enumerate(layout.buckets):
            for i in bucket.params:
                bucket_of[i] = b
        # Every rank holds every chunk (shard_replicas=2 at 2 ranks, or 1 rank): the step needs
        # no collective after the gradients' all-reduce (Stepper._step_local).
        return cls(layout, rank, shard, held, len(held) == layout.world, layout.chunk_offsets(), tuple(bucket_of))

    def in_place(self, h: int) -> bool:
        """Held chunk h is stepped in the parameters' own buffer: this rank's own chunk
        (h 0, which the all-gather then sends from where it lies) or, where every chunk is
        held here (`full`, no all-gather), every chunk. A backup (h > 0) of a sharded
        layout steps a copy: the all-gather writes the chunk's parameters from its primary
        while the backup steps."""
        return h == 0 or self.full

    def geometry(self, g: int) -> tuple:
        """Where group g's buckets lie in its padded buffer (start, padded width)."""
        lay = self.layout
        return (lay.groups[g],) + tuple((b.pstart, b.chunk * lay.world) for b in lay.buckets if b.group == g)

    def param_view(self, flats, i: int):
        """Parameter i's elements in the padded buffer of its group among `flats` (one per group)."""
        return self.param_in(flats[self.layout.slots[i].group], i)

    def param_in(self, flat, i: int):
        """Parameter i's elements in a padded buffer of its group."""
        slot = self.layout.slots[i]
        b = self.layout.buckets[self.bucket_of[i]]
        at = b.pstart + slot.offset - b.start
        return flat[at:at + slot.numel]

    def chunk_of(self, flat, b: int, j: int):
        """Chunk j of bucket b in a padded buffer of its group."""
        bucket = self.layout.buckets[b]
        return flat[bucket.pstart + j * bucket.chunk:bucket.pstart + (j + 1) * bucket.chunk]

    def section(self, t, g: int, h: int):
        """Held chunk h's section of `t` (one section per held chunk, of group g)."""
        n = self.layout.shard_len(g)
        return t[h * n:(h + 1) * n]

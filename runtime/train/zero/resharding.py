"""Live resharding: the optimizer state (and a joiner's parameters) moved from the old
layout's holders to the new layout's.

Live resharding (`reshard`): given the old and the new layout and a group that
holds every rank involved (the old group for a planned leave, so the leaver can
hand its chunks over; the new group for a join or after a crash), every
(sender, receiver) pair exchanges one message with the optimizer-state slices
the receiver's new chunks need, each taken from a live old holder (a chunk's
primary, or its backup when the primary is gone), so the work is spread over
the members; a joiner also receives the parameters, chunk by chunk from their
holders. The transfer plan (`plan_transfers`) is pure.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...member import collectives
from ..state import dtype_named
from .buffers import chunk_sections
from .layout import ShardLayout
from .optim import state_names
from .sharded import ShardedGradients


class ShardsLost(RuntimeError):
    """A chunk the new layout needs has no live holder (a crash with
    shard_replicas=1): the optimizer state has to come from a checkpoint."""



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
    collectives.wait_work(collectives.allreduce_async(group, info, dist.ReduceOp.MAX), abort)
    t_agree = time.perf_counter()
    step = int(info[0])
    old_ids = {m.id for m in old_layout.members}
    fresh = frozenset(mid for r, mid in enumerate(group_ids) if info[2 + r] > 0 and mid in old_ids)
    segs = plan_transfers(old_layout, new_layout, group_ids, all_params=bool(info[1] > 0), fresh=fresh)
    opt = some.optimizer
    groups = old_layout.groups
    names = [state_names(opt, opt.param_groups[pg]) if step else () for _d, pg in groups]
    dtypes = [dtype_named(d) for d, _pg in groups]
    old_off = old_layout.chunk_offsets()
    new_off = new_layout.chunk_offsets()

    def read(seg: Segment) -> list[torch.Tensor]:
        """The slices this (old) rank sends for `seg`."""
        assert old is not None
        ob = old_layout.buckets[seg.bucket]
        g = ob.group
        if seg.what == "param":
            return [old.buffers.flat[g][ob.pstart + seg.lo:ob.pstart + seg.hi]]
        h = old.held.index(seg.old_chunk)
        at = old_off[seg.bucket] + seg.lo - seg.old_chunk * ob.chunk
        st = old.buffers.chunk_state(g, h)
        return [st[k][at:at + seg.hi - seg.lo] for k in names[g]]

    # The new chunks' state, filled below: every real element of a new chunk is written
    # (the old chunks' spans cover each bucket), so only the padding is zeroed.
    new_state: list[list[dict[str, torch.Tensor]]] = []
    if new is not None:
        new_state = [[chunk_sections(new_layout, g, j, names[g], dtypes[g], new.buffers) for j in new.held]
                     for g in range(len(groups))]

    def target(seg: Segment) -> list[torch.Tensor]:
        """Where this (new) rank's slices of `seg` go: views of its new buffers."""
        assert new is not None
        nb = new_layout.buckets[seg.bucket]
        g = nb.group
        if seg.what == "param":
            return [new.buffers.flat[g][nb.pstart + seg.lo:nb.pstart + seg.hi]]
        h = new.held.index(seg.chunk)
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
        collectives.wait_p2p(works, abort)
    t_p2p = time.perf_counter()
    if new is not None:
        new.buffers.set_state(step, new_state, adopt=True)  # (the masters follow the parameters at the next step)
    t_end = time.perf_counter()
    return {"sent_bytes": sent, "to": sorted(where[d] for d in outgoing),
            "received_bytes": received, "from": sorted(where[s] for s in incoming),
            "messages": len(works), "local_bytes": local,
            "s": {"agree": round(t_agree - t0, 4), "plan": round(t_plan - t_agree, 4),
                  "post": round(t_pack - t_plan, 4), "local": round(t_local - t_pack, 4),
                  "p2p": round(t_p2p - t_local, 4), "set_state": round(t_end - t_p2p, 4)}}

"""Host memory touched ahead of a move of the shards (CPU only).

A reshard's new buffers faulted in afresh inside the pause cost seconds on this project's
VMs (hostmem.py has the figures). So the memory a move will allocate is allocated and
touched before the pause, on a helper thread, and the move carves its buffers out of it
(a Recycler): a joiner touches its first layout's memory before it asks to be admitted
(`prepare_join`); the members touch their next layout's while the job holds a queued
joiner back (`ready_for_join`), the survivors of a planned leave theirs while the job
holds the leave back (`ready_for_leave`).

`MemoryPreparation` owns what is touched ahead (a joiner's memory, a member's preparation
under way) and is handed the parameters, the script's optimizer, the shard mode and the
layout planner (layout.members_layout over the path's replicas and bucket size, pure); the
path that owns it (no reference back to it) says where it stands (its current
ShardedGradients, members and rank) at each call, and hands what was touched to the new
path's recycler (`take`, from `ShardedPath.new_path`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from ..state import dtype_named
from . import hostmem
from .buffers import line_bytes as _line
from .hostmem import Recycler
from .layout import ShardLayout
from .sharded import ShardedGradients

log = logging.getLogger("eltctl_runtime")

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
        self.key = key  # what it prepares for (MemoryPreparation._ready_for)
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


class MemoryPreparation:
    """What ShardedPath's prepare_join, ready_for_join and ready_for_leave touch ahead
    (module docstring). Owns the memory touched; handed what it needs to size a layout's
    buffers. Touching ahead is for the CPU only: the path calls it only there."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, shard: str,
                 layout_of: Callable[[list[str]], ShardLayout]) -> None:
        self._params = params
        self._opt = optimizer
        self._shard = shard
        self._layout_of = layout_of  # worker ids in rank order -> their layout (pure)
        self._joiner_memory: Recycler | None = None  # prepare_join's, for the first layout's buffers
        self._member_prep: _Toucher | None = None  # ready_for_join's, for the next layout's buffers

    @property
    def joiner_memory(self) -> Recycler | None:
        """The memory prepare_join touched and holds for the first layout (None: none held)."""
        return self._joiner_memory

    @property
    def preparing(self) -> bool:
        """A member's preparation (ready_for_join / ready_for_leave) is under way or done and not taken yet."""
        return self._member_prep is not None

    def take(self) -> Recycler:
        """What was touched ahead (a joiner's memory, a member's preparation, stopped now),
        in one Recycler for a new path's buffers; nothing is held here any more."""
        prep, self._member_prep = self._member_prep, None
        rec, self._joiner_memory = self._joiner_memory or Recycler(), None
        if prep is not None:
            rec.give(prep.take())
        return rec

    def prepare_join(self, world: int, stop: threading.Event, prepared: threading.Event | None = None) -> None:
        """A joiner (no layout yet) about to ask to be admitted to a job that will then have
        `world` members: the host memory its first layout's bind and reshard allocate
        (host_bytes), allocated and touched now (on the caller's thread, in slices until
        `stop` is set; then `prepared` is set and the joiner asks), so that its reshard and
        first step carve their buffers out of it instead of faulting pages in inside the
        pause. The layout is a guess (any `world` members; the sizes depend only on how
        many): where it is wrong, the rest is allocated as before."""
        lay = self._layout_of([f"joining-{i}" for i in range(world)])
        need = ShardedGradients(self._params, self._opt, lay, world - 1, self._shard).host_bytes()
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

    def ready_for_join(self, world: int, sg: ShardedGradients, members: list[str], rank: int) -> bool:
        """A joiner is queued and this member's (its path `sg`, at `rank` of `members`) next
        layout will have `world` members: False while this rank still touches the host
        memory that layout's move allocates afresh (_member_need) on a helper thread,
        started at the first call; True once that is done, where there are no more members,
        or MEMBER_PREPARE_MAX_S after the first call. The job holds the join back while any
        rank says False (job.py), so the reshard carves its buffers out of memory touched
        while the job still trained instead of faulting pages in inside the pause (a ZeRO-1
        member's 200 MB of fresh state at a join 1 -> 2 took 0.5-1.4 s to fault in on this
        project's VMs)."""
        if world <= len(members):
            return True
        return self._ready_for(sg, members + [f"joining-{i}" for i in range(world - len(members))], rank,
                               MEMBER_PREPARE_MAX_S)

    def ready_for_leave(self, leaving, sg: ShardedGradients, members: list[str], rank: int) -> bool:
        """The last commit asked for `leaving` to leave: False while this survivor (its path
        `sg`, at `rank` of `members`) still touches the host memory its hand-over allocates
        afresh for the survivors' layout (on a helper thread, started at the first call);
        True once that is done, on a leaver (it only sends), or LEAVE_PREPARE_MAX_S after
        the first call. `leaving` empty (no leave known yet): False, so on the CPU a leave
        waits one commit, in which the survivors touch (a ZeRO-1 survivor of 2 -> 1 takes
        over 200 MB more state: its hand-over faulted it in for 0.65-0.95 s of a 1.0-1.5 s
        pause on this project's VMs)."""
        if not leaving:
            return False
        gone = set(leaving)
        survivors = [m for m in members if m not in gone]
        me = members[rank]
        if me in gone or not survivors:
            return True
        return self._ready_for(sg, survivors, survivors.index(me), LEAVE_PREPARE_MAX_S)

    def _ready_for(self, sg: ShardedGradients, members: list[str], rank: int, limit_s: float) -> bool:
        """Touch, on a helper thread, what the move of `sg` to a layout of `members` (this
        rank at `rank`) allocates afresh; True once done or `limit_s` after it began. A
        preparation for another layout is stopped and let go first."""
        key = (tuple(members), rank)
        prep = self._member_prep
        if prep is not None and prep.key != key:
            prep.take()
            prep = self._member_prep = None
        if prep is None:
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
        lay = self._layout_of(members)
        new = ShardedGradients(self._params, self._opt, lay, rank, self._shard)
        need = new.host_bytes()
        was, now = old.buffers, new.buffers
        for g, (dtype, _pg) in enumerate(lay.groups):
            item = dtype_named(dtype).itemsize
            if g < len(was.flat) and was.place.geometry(g) == now.place.geometry(g):
                need -= _line(lay.padded(g) * item) * (2 if self._shard == "optimizer" else 1)
            n = len(new.held) * lay.shard_len(g)
            if self._shard == "gradients" and g < len(was.chunk_grads) and was.chunk_grads[g].numel() == n:
                need -= _line(n * item)
        return max(0, need)

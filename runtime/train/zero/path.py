"""ElasticJob's sharded gradient path: the layout of each generation and the moves between them.

`ShardedPath` (gradients.GradientPath) plans each generation's layout from its members
(layout.py), moves the shards to it (resharding.py), settles a step in doubt, takes up a
restore, and runs the job's step through this rank's ShardedGradients (sharded.py). The
host memory its moves allocate is touched ahead by the MemoryPreparation it owns (prepare.py).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import threading
import time
import zlib
from typing import Any, Callable


import torch
import torch.distributed as dist

from ...member import collectives
from .. import gradients, state as state_mod
from ..state import dtype_named
from . import resharding
from .hostmem import Recycler
from .layout import ShardLayout, member_of, members_layout, param_groups_of
from .optim import SHARD_MODES, check_optimizer
from .prepare import MemoryPreparation
from .resharding import ShardsLost
from .sharded import ShardedGradients

# Each rank's chunks of a sharded checkpoint at a restore: (ckpt, new ShardedGradients, pg, host,
# abort) -> what it did (ShardedPath._restore_chunks says the contract).
ChunkLoader = Callable[[dict, ShardedGradients, Any, str, "threading.Event | None"], dict]

log = logging.getLogger("eltctl_runtime")


class ShardedPath(gradients.GradientPath):
    """ElasticJob's sharded gradient path (gradients.GradientPath over ShardedGradients).

    Per generation the job calls `bind` (the group), agrees on the replicated
    state (`capture` / `apply`: progress, buffers, extra state, the optimizer's
    hyperparameters; the parameters only when no live layout holds them: the first
    start, a restore), then `reshard`, which plans this generation's layout from
    its members and moves the optimizer state (and a joiner's parameters) from the
    old layout's holders (resharding.reshard). A planned leaver's chunks move first, over
    the old group (`hand_over`, from the job's before_group / on_leave hooks).
    A checkpoint, `fingerprint` and `capture_full` gather the full state: every
    rank must call them together."""

    gathers = True  # capture_full / fingerprint are collectives

    def __init__(self, shard: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 params: list[torch.Tensor], bucket_mb: float, replicas: int = 1,
                 restore_chunks: ChunkLoader | None = None) -> None:
        if shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {SHARD_MODES} (or None for replicated), not {shard!r}")
        if replicas not in (1, 2):
            raise ValueError(f"shard_replicas must be 1 or 2, not {replicas!r}")
        check_optimizer(optimizer)
        param_groups_of(params, optimizer)
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
        # Takes each rank's chunks of a sharded checkpoint at a restore (the job's, given at
        # construction: train/checkpoints.py JobCheckpoints.restore_chunks, over
        # train/zero/checkpoint.py's; path.py does not import the checkpoint modules).
        self._load_chunks = restore_chunks
        # Host memory touched ahead of this rank's moves (CPU only): handed to new_path's recycler.
        self._prep = MemoryPreparation(params, optimizer, shard, functools.partial(
            members_layout, params, optimizer, replicas=replicas, bucket_mb=bucket_mb))
        self._touched_ahead = 0  # of the move under way: bytes its recycler got touched ahead (logged)

    # -- read-only views
    @property
    def params(self) -> list[torch.Tensor]:
        """The trained parameters, in model order (what each layout shards)."""
        return self._params

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The script's optimizer (its hyperparameters; never stepped)."""
        return self._opt

    # -- layout
    def layout_of(self, members) -> ShardLayout:
        """The layout of `members` (worker ids, in rank order) for this path's parameters (pure)."""
        return members_layout(self._params, self._opt, members, self.replicas, self._bucket_mb)

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
        inter = self.layout_of(survivors)
        me = ids[self.rank]
        new = None
        t1 = time.perf_counter()
        if me in survivors:
            new = self.new_path(inter, survivors.index(me))
            new.bind(reuse=self.sg)
        t2 = time.perf_counter()
        moved = resharding.reshard(self.layout, inter, self.pg, ids, old=self.sg, new=new, abort=self.abort)
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
            sg.forget_step_in_doubt()  # restored from a checkpoint: state and parameters come from it
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
        new_lay = self.layout_of(new_members)
        sg = self.sg
        # Nothing moves when every rank holds the generation's layout already (a planned leave,
        # whose hand_over moved the leavers' chunks to the survivors' layout, or a generation
        # formed again with the same members), no restore is pending and no rank settled a
        # broken all-gather (its parameters are resent). Whether one did is this rank's own
        # knowledge, so the ranks agree (one small all-reduce) before any of them skips.
        moves = not (sg is not None and new_lay == self.layout and not self._restoring and not self._resend_params
                     and sg.rank == new_lay.rank_of(self.members[self.rank]))
        flag = torch.tensor([1.0 if moves else 0.0], dtype=torch.float64, device=self.device)
        collectives.wait_work(collectives.allreduce_async(self.pg, flag, dist.ReduceOp.MAX), self.abort)
        if float(flag[0]) == 0.0:
            self._peer_members = None
            sg.use_group(self.pg, self.abort)
            self._log_move("reshard", len(new_members), len(new_members), time.perf_counter() - t0, 0.0,
                           {"kept": True})
            return
        new = self.new_path(new_lay, new_members.index(self.members[self.rank]), self._restoring)
        # Taken up only once the move succeeds (below): a generation that breaks inside it
        # leaves the restore, or the joiner's source layout, pending for the next one.
        full, ckpt, peers = self._pending_full, self._pending_ckpt, self._peer_members
        old_lay = self.layout
        if old_lay is None and full is None and ckpt is None and peers:
            old_lay = self.layout_of(peers)  # a joiner: the layout its state came from
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
            moved = resharding.reshard(old_lay, new_lay, self.pg, new_members, old=self.sg, new=new, abort=self.abort,
                            resend_params=self._resend_params)
        new.use_group(self.pg, self.abort)  # full_state_dict before the first step
        memory = self._take_up(new, new_lay)
        self._resend_params = False
        self._pending_full = self._pending_ckpt = self._peer_members = None
        self._log_move("reshard", len(old_lay.members) if old_lay is not None else 0, len(new_members),
                       t1 - t0, t2 - t1, {**(moved or {}), **memory})

    def new_path(self, lay: ShardLayout, rank: int, restoring: bool = False) -> ShardedGradients:
        """This rank's path for layout `lay`. On the CPU its buffers until the move is done
        (bind's, the new state's) are carved out of memory the rank holds where they fit
        (hostmem.py): the current path's pre-step copy, dead between steps, and when a
        checkpoint's state replaces it (`restoring`) its optimizer state too; and the memory
        touched ahead: a joiner's (prepare_join, while it waited) or a member's
        (ready_for_join / ready_for_leave, while the job held a joiner or a leave back)."""
        new = ShardedGradients(self._params, self._opt, lay, rank, self.shard)
        rec = self._prep.take()  # (off the CPU nothing was touched ahead: an empty one, unused)
        if self.device.type == "cpu":
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

    def _restore_chunks(self, new: ShardedGradients, ckpt: dict) -> dict:
        """A restore from a sharded checkpoint (`ckpt`: where the restoring rank found it),
        through the loader the job gave (checkpoint.restore_chunks: a collective).

        The contract with that loader (ChunkLoader, given at construction):
        `restore_chunks(ckpt, new, pg, host, abort) -> dict`, called by every rank of the
        group together at reshard: `ckpt` the pending checkpoint ({"path", "sha256",
        "host"}, as `apply` took it), `new` this rank's bound ShardedGradients of the new
        layout, whose held chunks it fills (load_checkpoint_chunks), `pg` the generation's
        group, `host` this rank's host (member_of), `abort` the generation's abort event;
        it returns what it did, for the move's log line. None set: ShardsLost."""
        if self._load_chunks is None:
            raise ShardsLost(f"no loader for the sharded checkpoint {ckpt.get('path')} (sharded_path's restore_chunks)")
        return self._load_chunks(ckpt, new, self.pg, member_of(self.members[self.rank]).host, self.abort)

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
        per_chunk = sum(lay.shard_len(g) * dtype_named(d).itemsize * len(sg.buffers.names(g))
                        for g, (d, _pg) in enumerate(lay.groups))
        return [len(lay.held(r)) * per_chunk for r in range(lay.world)]

    # -- host memory touched ahead of a move (CPU only: prepare.py)
    @property
    def joiner_memory(self) -> Recycler | None:
        """The memory prepare_join touched and holds for the first layout (None: none held)."""
        return self._prep.joiner_memory

    @property
    def preparing(self) -> bool:
        """A member's preparation (ready_for_join / ready_for_leave) is under way or done and not taken yet."""
        return self._prep.preparing

    def prepare_join(self, world: int, stop: threading.Event, prepared: threading.Event | None = None) -> None:
        """A joiner about to ask to be admitted to a job that will then have `world` members
        touches its first layout's host memory now (MemoryPreparation.prepare_join)."""
        if self.device.type != "cpu" or self.sg is not None or world < 1:
            return
        self._prep.prepare_join(world, stop, prepared)

    def _prepares(self) -> bool:
        """Whether this rank's moves allocate host memory worth touching ahead (a CPU path
        with a layout: it has state to move)."""
        return self.device.type == "cpu" and self.sg is not None and self.layout is not None

    def ready_for_join(self, world: int) -> bool:
        """A joiner is queued: False while this member still touches the host memory its next
        layout's move allocates afresh (MemoryPreparation.ready_for_join); True where there
        is nothing to prepare (not the CPU, no layout yet)."""
        if not self._prepares():
            return True
        return self._prep.ready_for_join(world, self.sg, list(self.members), self.rank)

    def ready_for_leave(self, leaving) -> bool:
        """The last commit asked for `leaving` to leave: False while this survivor still
        touches the host memory its hand-over allocates afresh (MemoryPreparation.ready_for_leave);
        True where nothing is ever prepared (not the CPU, no layout yet)."""
        if not self._prepares():
            return True
        return self._prep.ready_for_leave(leaving, self.sg, list(self.members), self.rank)

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
                 params: list[torch.Tensor], bucket_mb: float, replicas: int = 1,
                 restore_chunks: ChunkLoader | None = None) -> ShardedPath:
    """ElasticJob's gradient path for shard="optimizer" | "gradients" (job._gradient_path);
    `restore_chunks`: the job's loader of a sharded checkpoint's chunks (ChunkLoader)."""
    return ShardedPath(shard, model, optimizer, params, bucket_mb, replicas, restore_chunks=restore_chunks)

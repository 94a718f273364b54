"""The training state's agreement when a generation forms: which ranks hold the state,
and where the others get it from: a member that holds it (sent to the ranks that lack
it only), or, when none does, the newest checkpoint, restored together (every rank that
can read the same checkpoint takes it up itself; the rest receive it from the
restoring rank); or a joiner takes it in the background instead (catchup.py: the
members keep theirs and nothing big moves here; local steps and synchronous steps on
the replicated path), and at the job's end or a stop it holds it
(`caught_up_at_end`). A restore is
confirmed in its first step: its hashes ride in that step's control tail (tail.py:
restore_bad), and a damaged one is dropped for the newest checkpoint that verifies
(`confirmed`).

Sharded: the holders must hold every chunk of one layout; a crash or a rank back
without its chunks that left a chunk with no holder makes every rank drop its state
for the newest checkpoint (steps redone: `redo_from`, `redone_steps`).

`StateAgreement` belongs to one ElasticJob (the generation's group, rank and step, its
gradient path and its checkpoints are the job's); the job calls `sync` from its
generation hook (on_group) and `confirmed` in a restore's first step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..member import collectives, transfer
from ..member.collectives import Aborted
from ..member.plan import receivers
from . import state as state_mod
from .catchup import CatchUp

log = logging.getLogger("eltctl_runtime")


class StateAgreement:
    """Who holds the training state, and its agreement (module docstring). `job`: the
    ElasticJob (not imported here: job.py imports this module)."""

    def __init__(self, job: Any) -> None:
        self._job = job
        self.has_state = False  # this rank holds the job's state (sharded: its chunks too)
        self.has_state_before = False  # it did when the generation being formed began
        self.members_before: tuple[str, ...] = ()  # the previous generation's members (reshard)
        self.redo_from: int | None = None  # this generation restores after lost shards: the step it was at
        self.redone_steps: int | None = None  # a crash lost shards: steps redone from checkpoints, in all
        # Joiners catching up in the background with synchronous steps (local steps: LocalPath.catchup).
        self.catchup = CatchUp(job, None)

    def sync(self) -> bool:
        """Agree on the training state; returns True if it came from a checkpoint."""
        j = self._job
        if j._ckpts.unconfirmed:
            # The generation of a restore broke before the checkpoint's hashes were confirmed
            # (_restore_confirmed): what this rank took up (read, or received from the
            # restoring rank) is not trusted; the checkpoint is restored again.
            log.warning("worker %s: the restore's generation broke before the checkpoint's hashes were "
                        "confirmed; what it took up is dropped and the checkpoint restored again", j.worker_id)
            j._ckpts.unconfirmed = False
            self.has_state = False
            j._ckpts.check_pending()
        self.has_state_before = self.has_state
        rounds = j._rounds  # a joiner may catch up in the background (catchup.py)
        catchup = rounds.catchup if rounds is not None else self.catchup
        catchup.reset()  # a catch-up under way in the last generation is dropped
        # Each rank: whether it holds the state (sharded: its chunks too), its step, and
        # which state its part is of (gradients.GradientPath.state_key).
        key = j._grads.state_key()
        has = self.has_state and key is not None
        got = transfer.gather_holdings(j._pg, has, j._step, [key or 0], j._abort, j._device)
        why = self._incomplete(got, has)
        if why:
            # Part of the optimizer state has no holder (a crash with shard_replicas=1, a
            # rank back without its chunks, a reshard that broke halfway): every rank drops
            # its state, so the newest checkpoint is restored (steps redone).
            log.warning("worker %s: %s; restoring the newest checkpoint", j.worker_id, why)
            self.redo_from = max(s for h, s, _k in got if h)
            self.has_state = False
            got = [(0, s, k) for _h, s, k in got]
        reports, source = transfer.choose(got)
        # Sharded: a step this rank dropped after its shard stepped is kept if a rank holding
        # the state committed it, else undone, before this rank's state is sent anywhere.
        j._grads.settle(j._step, max((s for has, s in reports if has), default=j._step))
        if not source.needed:
            return False
        restored = False
        if source.restore:
            restored = self._restore_together(source.source)
        else:
            need = receivers(reports, source)
            if catchup.admit(reports, source.source, need):
                return False  # the joiners hold no state until they caught up; the members keep theirs
            self._send_state(source.source, need)
        self.has_state = True
        j._ckpts.unconfirmed = restored  # until the first step's tail confirms it (_restore_confirmed)
        return restored

    def _restore_together(self, src: int) -> bool:
        """No rank holds the state: rank `src` restores the newest checkpoint; every other
        rank that can read that same checkpoint (on the source's host, or shared storage)
        takes the state from it itself, and only the rest receive it from the source (at
        world 4 on 2 cores, receiving the 50 M-parameter model took 0.8 s of a SIGKILL's
        pause). No checkpoint: the source's own state goes to every rank (a first start).
        Returns whether a checkpoint was restored. The source says which checkpoint before
        it takes it up, so every rank reads it at once (at world 4 on 2 cores the others
        waited 0.1-0.15 s for the source's take-up)."""
        j = self._job
        found = j._ckpts.find() if j._rank == src else None
        # Another optimizer class's checkpoint: every rank stops, with the source's reason.
        refused = found and state_mod.optimizer_mismatch(
            found[1].get("optimizer_class"), state_mod.optimizer_class(j.optimizer), found[0].path)
        if j.world_size > 1:
            told = transfer.broadcast_json(j._pg, {"refused": refused} if refused else (
                j._ckpts.restored if found else None), src, j._rank, j._abort, j._device)
            refused, desc = (told["refused"], None) if told and "refused" in told else (None, told)
        else:
            desc = None
        if refused:
            raise state_mod.OptimizerMismatch(refused)
        if found is not None:
            j._ckpts.take_up_found(*found)
        if j.world_size == 1:
            return found is not None
        local = j._rank != src and desc is not None and j._ckpts.restore_here(desc)
        flags = torch.zeros(j.world_size, dtype=torch.int64, device=j._device)
        flags[j._rank] = int(local)
        flags = collectives.allreduce(j._pg, flags, j._abort).cpu()
        self._send_state(src, [r for r in range(j.world_size) if r != src and not flags[r]])
        return desc is not None

    def caught_up_at_end(self) -> bool:
        """The job's end or a stop with synchronous steps while ranks catch up (every rank
        alike): they take up their state first, so every rank ends with it (catchup.py:
        at_end); a rank whose transfer broke receives it now from the source, as a join
        did before. False: the group broke (the boundary owes the roll call)."""
        c = self.catchup
        if not c.idle:
            return True
        j = self._job
        try:
            lacking = c.at_end()
            if lacking:
                log.warning("worker %s: rank(s) %s did not catch up by the end; the state goes to them now",
                            j.worker_id, ", ".join(map(str, lacking)))
                self._send_state(c.source, lacking)
        except Aborted as e:
            log.warning("worker %s: generation %d aborted while its joiners took up their state at the end: %s",
                        j.worker_id, j.generation, e)
            j._boundary.dropped(e.backend_error)
            return False
        c.ended()
        return True

    def _send_state(self, src: int, need: list[int]) -> None:
        """The source's state to the ranks of `need` (the others hold it already, or took it
        from the checkpoint themselves): transfer.send_packed."""
        j = self._job
        packed = state_mod.pack(j._capture_state()) if j._rank == src and need else None
        got = transfer.send_packed(j._pg, packed, src, j._rank, need, j._abort, j._device)
        if got is not None:
            j._apply_state(state_mod.unpack(*got))

    def _incomplete(self, got: list[tuple[int, ...]], has: bool) -> str | None:
        """Why the ranks holding the state do not hold all of it, or None; the same answer
        on every rank. `got`: every rank's (holds the state, step, state_key). Replicated
        (every key 0), the first layout and a restore still pending lose nothing. Ranks
        whose chunks are of different layouts cannot move them consistently. Else, where
        ranks crashed or came back without their chunks, only the holders can tell whether
        a chunk lost every holder: one small all-reduce."""
        j = self._job
        keys = {k for h, _s, k in got if h and k != 0}
        if len(keys) > 1:
            return "the ranks holding optimizer-state shards hold them of different layouts"
        if not keys or min(keys) < 0:
            return None
        back = [m for m, (h, _s, _k) in zip(j._plan.members, got) if not h]
        gone = [*j._plan.lost, *back]
        if not gone:
            return None
        flag = torch.tensor([1.0 if has and j._grads.state_lost(gone) else 0.0], dtype=torch.float64,
                            device=j._device)
        if float(collectives.allreduce(j._pg, flag, j._abort, dist.ReduceOp.MAX)[0]) == 0.0:
            return None
        said = [f"the crash of {', '.join(j._plan.lost)}"] if j._plan.lost else []
        said += [f"{', '.join(back)} without their state"] if back else []
        return f"{' and '.join(said)} left optimizer-state shards with no holder"

    def confirmed(self, restore_bad: float) -> bool:
        """A restore's first step, its control tail summed over the ranks (`restore_bad`:
        the ranks that found a file of the checkpoint damaged): True if none did. Else the
        step is not taken: every rank drops what it took up and the source restores the
        newest checkpoint that verifies, checked before it is loaded (every rank sees the
        flag alike, so none steps alone)."""
        j = self._job
        j._ckpts.unconfirmed = False
        if restore_bad <= 0:
            return True
        j._ckpts.check_first = True  # after a damaged one, every rank checks before it loads
        log.warning("worker %s: the checkpoint restored is damaged on a rank; step %d is not taken and the "
                    "newest checkpoint that verifies is restored", j.worker_id, j._step + 1)
        j._discard_step()
        had_state = self.has_state_before
        self.has_state = False
        j._sync_state()  # Aborted: the step is dropped; the recovery restores (this rank holds no state)
        j._grads.reshard(self.members_before, self.members_before)
        self.has_state_before = had_state
        if j._pause.event is not None:
            j._pause.event["from_step"] = j._step
        return False

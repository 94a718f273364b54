"""Checkpoints as the job takes them: when one is due, writing it (replicated: rank 0
writes the whole state; sharded: each rank's chunk of the optimizer state is its own
file), and on a restore, finding the newest one, taking it up, and confirming its
hashes in the first step's control tail.

The checkpoint format, its store and its loaders are runtime/checkpoint/; this module
is the job's side of them. A restore takes the newest checkpoint up while its files
are hashed in the background (`pending_checks`); the first step's control tail
carries each rank's verdict (tail.py's `restore_bad`), so the hashing overlaps that
step's forward and backward instead of holding the pause. After a damaged one, every
restore checks before it loads (`check_first`).

`JobCheckpoints` belongs to one ElasticJob and reads from it only what a checkpoint
is of (its rank, step, gradient path, model, optimizer and progress); the job calls
it at its boundaries and from its state agreement.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ..protocol import get_restored, get_status

log = logging.getLogger("eltctl_runtime")

# A cold start whose host lacks the job's newest checkpoint waits this long for eltctl to deliver it.
RESTORE_WAIT_S = 90.0


class JobCheckpoints:
    """One job's checkpointing (module docstring). The constructor does no I/O; `open`
    opens the checkpoint directory (none: the job takes no checkpoints). `job`: the
    ElasticJob (not imported here: job.py imports this module)."""

    def __init__(self, job: Any, *, every_steps: int | None, every_seconds: float | None,
                 keep: int) -> None:
        self._job = job
        self.store = None  # checkpoint.store.CheckpointStore, once open
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._keep = keep
        self.last_t = time.monotonic()  # when the last one was taken (checkpoint_every_seconds)
        self.pending_checks: list = []  # checkpoint.PendingCheck of what this rank restored, until confirmed
        self.restored: dict | None = None  # the checkpoint this rank restored last: path, sha256, host
        self.unconfirmed = False  # this rank's state came from a restore whose hashes are not confirmed yet
        self.check_first = False  # the last restore's checkpoint failed its hashes: check before loading

    def open(self, directory: str, on_committed: Callable[[Any], None]) -> None:
        from ..checkpoint.store import CheckpointStore

        self.store = CheckpointStore(directory, keep=self._keep, on_committed=on_committed)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    # -- writing ----------------------------------------------------------------------
    def clock_due(self) -> bool:
        """Rank 0's clock says a checkpoint is due (checkpoint_every_seconds): it asks
        for it in the step's control tail, so every rank takes part."""
        return bool(self.every_seconds) and time.monotonic() - self.last_t >= self.every_seconds

    def due(self, step: int, tail_says: bool) -> bool:
        """A checkpoint is due at the coming boundary (the same on every rank: the step, or
        rank 0's clock through the last commit's tail)."""
        return self.store is not None and bool((self.every_steps and step % self.every_steps == 0) or tail_says)

    def at_boundary(self, boundary: Any, *, change: bool) -> None:
        """Every rank calls it at a boundary after a commit (sharded: the state is gathered);
        rank 0 writes. Due by steps, or by rank 0's clock (it rode the last commit's tail:
        `boundary.checkpoint_due`). `change`: a membership change goes at this boundary."""
        j = self._job
        due = self.due(j._step, boundary.checkpoint_due)
        if change and due:
            # A membership change goes at this boundary: the checkpoint due here goes at the
            # next one, so the two pauses do not add up (a sharded checkpoint held the boundary
            # 1.3-3.8 s at world 4 here, and a change that fell on it paid both). Nothing is at
            # risk meanwhile: a leaver hands its state over, and a job every member leaves
            # checkpoints in on_leave.
            boundary.defer_checkpoint()
            log.info("worker %s: the checkpoint of step %d moves to the next boundary (a membership change "
                     "goes at this one)", j.worker_id, j._step)
            return
        boundary.checkpoint_due = False
        if self.store is not None and due:
            self.last_t = time.monotonic()
            self.save()

    def now(self) -> None:
        """Every rank calls it (sharded: a collective); rank 0 writes and waits."""
        from ..member.collectives import Aborted

        j = self._job
        if self.store is not None and j._agreement.has_state:
            try:
                self.save()
            except Aborted as e:  # sharded: a rank died during the transfer; nothing partial was written
                log.error("worker %s: the checkpoint of step %d was not written (the newest one stands): %s",
                          j.worker_id, j._step, e)
                return
            if j._rank == 0:
                self.store.wait()

    def save(self) -> None:
        """Every rank calls it at the same step. Sharded: each rank's chunk of the
        optimizer state becomes its own file under rank 0's one manifest
        (checkpoint.save_sharded; the full state is never gathered); replicated: rank 0
        writes the whole state. Both go on on rank 0's writer thread."""
        j = self._job
        g = j._grads
        if g.gathers:
            state = g.shard_checkpoint_state(j.model, j._progress(), j._extra)
            if state is not None:
                from .zero.checkpoint import save_sharded

                save_sharded(j._step, state, g.sg, g.pg, hosts=[m.host for m in g.layout.members],
                             directory=self.store.directory, store=self.store if j._rank == 0 else None,
                             writer=0, abort=j._abort)
                return
        state = self._state()
        if state is not None:
            self.store.save_async(j._step, state)

    def _state(self) -> dict | None:
        """What a checkpoint holds, on rank 0 (None elsewhere): one plain full state
        dict; a sharded path gathers it (ShardedGradients.full_state_dict: every rank
        takes part), so restore at any world size and export work alike."""
        j = self._job
        if j._grads.gathers:
            full = j._grads.capture_full(j.model, j.optimizer, j._progress(), j._extra)
            return full if j._rank == 0 else None
        return j._capture_state() if j._rank == 0 else None

    # -- restoring --------------------------------------------------------------------
    def find(self) -> tuple[Any, dict] | None:
        """The newest checkpoint to restore (its info, and its state mapped or loaded, not
        yet taken up: take_up_found), or None; `restored` says which, for the others."""
        if self.store is None:
            return None
        j = self._job
        self._await_newest()
        # Sharded: state.pt is mapped (its tensors go straight into the model) and the optimizer
        # state is not assembled: each rank takes its own chunks from the shard files at reshard
        # (ShardedPath._restore_chunks), so the full state is neither built nor sent.
        sharded = j._shard is not None
        # The newest checkpoint is taken up while its files are hashed (confirmed in the first
        # step's control tail: StateAgreement.confirmed); after one failed, checked before it is loaded.
        if self.check_first:
            found = self.store.latest_valid(assemble=not sharded, mmap=sharded)
            if found is None:
                from ..checkpoint.format import CheckpointError

                raise CheckpointError(
                    f"the newest checkpoint in {self.store.directory} was damaged (see the warning above) and "
                    f"no older one there verifies: the model now holds the damaged one's values, so the job "
                    f"cannot go on from them. Move the step-* directories there away to start from step 0, "
                    f"or put a good checkpoint there (eltctl checkpoints)")
            info, saved = found
        else:
            found = self.store.latest_for_restore(assemble=not sharded, mmap=sharded)
            if found is None:
                return None
            info, saved, check = found
            if check is not None:
                self.pending_checks.append(check)
        # What the other ranks are told (StateAgreement._restore_together); for a sharded checkpoint also
        # what each rank's chunks come from at reshard (checkpoint.restore_chunks).
        from ..checkpoint.load import restore_identity

        self.restored = {"path": str(info.path), "sha256": info.sha256, "host": j._host,
                         **restore_identity(info.path)}
        j._mark("restore_read")
        return info, saved

    def take_up_found(self, info: Any, saved: dict) -> None:
        """Adopt the checkpoint `find` found."""
        j = self._job
        self.take_up(saved, self.restored)
        j._on_checkpoint(info)  # the job's last checkpoint until it writes a newer one (status shows it)
        log.info("worker %s: restored step %d from %s", j.worker_id, info.step, info.path)

    def restore_chunks(self, ckpt: dict, sg: Any, pg: Any, host: str, abort: threading.Event) -> dict:
        """The sharded path's loader (checkpoint.restore_chunks): each rank's chunks from the
        restored checkpoint's shard files; on another host than the restoring rank's, the
        files it reads are hashed meanwhile and confirmed with the rest of the restore."""
        from .zero.checkpoint import restore_chunks

        return restore_chunks(ckpt, sg, pg, host, abort, checks=None if self.check_first else self.pending_checks)

    def take_up(self, saved: dict, desc: dict) -> None:
        """Adopt a checkpoint's state (`desc`: which checkpoint, where it was read)."""
        if self._job._shard is not None:
            from ..checkpoint.load import is_sharded

            if is_sharded(desc["path"]):
                saved["optimizer"] = {**saved["optimizer"], "checkpoint": dict(desc)}
        self._job._apply_state(saved)

    def restore_here(self, desc: dict) -> bool:
        """A rank other than the restoring one takes the restored checkpoint (`desc`) up
        itself if it can read it: the same state.pt at the same path (the restoring rank's
        host, or shared storage). On another host it hashes what it reads meanwhile, or
        first after a damaged checkpoint (check_first); on that host, or reading the very
        same directory on the same machine (checkpoint.covered_by_restorer), the restoring
        rank's hashes cover it (at world 4 on 2 cores, three ranks each hashing what they
        read took CPU from every rank's restore). False: it receives the state from the
        restoring rank."""
        from ..checkpoint.format import InvalidCheckpoint
        from ..checkpoint.load import covered_by_restorer, load_restored

        j = self._job
        sharded = j._shard is not None
        try:
            found = load_restored(desc["path"], desc["sha256"], assemble=not sharded, mmap=sharded,
                                  verify=not covered_by_restorer(desc, j._host), defer=not self.check_first)
        except InvalidCheckpoint as exc:
            log.warning("worker %s: cannot take the restored checkpoint up here (%s); it comes from the "
                        "restoring rank", j.worker_id, exc)
            return False
        if found is None:
            return False  # not on this host: it comes from the restoring rank
        saved, check = found
        if check is not None:
            self.pending_checks.append(check)
        self.take_up(saved, desc)
        log.info("worker %s: took step %s up from %s itself", j.worker_id, saved.get("progress", {}).get("step"),
                 desc["path"])
        return True

    def check_pending(self) -> bool:
        """Wait for the hashes of the checkpoint this rank restored from, if any are being
        checked; False (and the next restore checks before it loads) if a file differs."""
        checks, self.pending_checks = self.pending_checks, []
        if not checks:
            return True
        from ..checkpoint.format import InvalidCheckpoint

        ok = True
        for check in checks:  # every one waited for: none is left hashing
            try:
                check.confirm()
            except InvalidCheckpoint as exc:
                log.warning("worker %s: the checkpoint restored is damaged (%s); its state is dropped for the "
                            "newest checkpoint that verifies", self._job.worker_id, exc)
                ok = False
        if not ok:
            self.check_first = True
        return ok

    def _await_newest(self) -> None:
        """A start with no member holding the state restores this host's newest checkpoint.
        When the job's last members paused it (every one left) and their status names a
        newer checkpoint, that one lies on another host: the last member left from there
        (its owner came) while this worker was starting. Wait, up to
        RESTORE_WAIT_S, for eltctl's controller to deliver it here (it restores before
        a start with no survivor, then writes Keys.RESTORED); restoring the older one
        would redo every step in between."""
        j = self._job
        status = j._read(get_status)
        if not isinstance(status, dict) or not status.get("paused"):
            return  # not a job its last members paused (a first start, the loss of every host, lost shards)
        want = (status.get("checkpoint") or {}).get("step")
        if not isinstance(want, int):
            return
        host = j._host

        def newest() -> int:
            return max((i.step for i in self.store.list()), default=-1)

        def delivered(rec) -> bool:  # the controller restored for this host and delivered `have`
            return isinstance(rec, dict) and host in (rec.get("targets") or ()) and rec.get("step") == have

        have, rec0 = newest(), j._read(get_restored)
        if have >= want or delivered(rec0):
            return
        log.warning("worker %s: the job's newest checkpoint is step %d, this host's is %s: waiting up to %.0f s "
                    "for eltctl to deliver it", j.worker_id, want, have if have >= 0 else "none", RESTORE_WAIT_S)
        end = time.monotonic() + RESTORE_WAIT_S
        while time.monotonic() < end and not j._abort.is_set():
            time.sleep(0.5)
            have, rec = newest(), j._read(get_restored)
            if have >= want or (rec != rec0 and delivered(rec)):
                log.info("worker %s: step %d is here now", j.worker_id, have)
                return
        log.error("worker %s: step %d did not arrive in %.0f s; restoring this host's newest (%s): the steps "
                  "in between are redone", j.worker_id, want, RESTORE_WAIT_S, have if have >= 0 else "none")

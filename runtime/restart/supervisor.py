"""Restart mode: an unmodified torchrun script under eltctl's membership.

`python -m eltctl_runtime.restart [--stop-grace S] [--script-dir D] -- <command>`
runs in place of the training script, one per slot. This supervisor is a member
of the job exactly like an ElasticJob worker (the same ELTCTL_* environment,
join queue, leave/dead keys, generation plans (member/plan.py), membership
state machine (generation.py: it runs the whole machine, with the hooks below)
and control thread (member/control.py)), so the host daemon, owner yield, scale, down and logs
work unchanged. It does not train: per generation it starts the script as its
child with torchrun's environment and, about every TICK_S, all-reduces a few
control flags with the other supervisors in their own gloo group::

    stop | join | leave per rank | child exited 0 per rank | child failed per rank

A leave, a join or a failed child is a membership change: every supervisor
sends SIGTERM to its child's process group, waits `stop_grace` for the script to
save, then SIGKILLs the group. While no child runs, rank 0's supervisor packs
the script's checkpoint directory (a consistent copy), broadcasts it to every
member (before the leavers go, so a leaving rank 0 hands it over) and saves it
as an ordinary eltctl checkpoint (step = the snapshot counter) so the
controller's mirror and restore work unchanged. The next generation is
decided (compare_set of its plan, as ElasticJob does); its members unpack the
newest snapshot into their script directory and start the script again at the
new size. A supervisor that crashes or hangs is found by the control thread:
the survivors stop their children, the old rank 0 snapshots its directory, and
the roll call forms the next generation, whose members agree on the newest
snapshot (membership.choose_source). Rank 0's child exiting 0 ends the job
(`done`); a stop request stops the children, snapshots and ends it.

Rank 0 writes the status document (with `mode: "restart"` and `restarts`) and
one event per restart (the plan's kind, with `mode: "restart"`; `pause_s` is
from the moment the change was known to the new children's start).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ..member import collectives, exiting, transfer
from ..member.collectives import Aborted
from ..member.generation import ExcludedFromJob, GenerationHooks
from ..member.plan import Plan, host_of, scan_joiners  # noqa: F401 - host_of: re-exported
from ..member.report import generation_event
from ..member.session import MemberSession, MemberViews
from ..member.config import Device, RuntimeConfig
from ..store.auth import ForgedValue
from ..protocol import EventKind, Keys, get_status
from .keeper import SNAPSHOT_FORMAT, SnapshotKeeper  # noqa: F401 - SNAPSHOT_FORMAT: re-exported
from .launch import (SCRIPT_DIR_PLACEHOLDER, WARM_MODULE, Child, Launcher, ScriptStore, Warm, child_env,  # noqa: F401
                     expand_command, slot_of, torchrun_env, warm_form)
from .progress import ProgressFile, ProgressTracker, compile_progress
from .snapshots import pack_dir, unpack_dir  # noqa: F401 - re-exported (tests import them from here)
from .watch import OutputPump, RestartLimit, progress_matcher

log = logging.getLogger("eltctl_runtime")

TICK_S = 0.15
# The next warm interpreter starts this long after the script (not at once: both
# importing torch at the same moment would slow the script's own start).
PREWARM_AFTER_S = 3.0
WARM_READY_S = 120.0  # a joiner waits this long at most for its warm interpreter before it registers
STATUS_EVERY_S = 1.0
DEFAULT_STOP_GRACE_S = 30.0
# The scripts count as training once every member's has run this long (or rank 0's reported a step).
SETTLE_S = 5.0
PROGRESS_POLL_S = 0.5
DEFAULT_CHECKPOINT_POLL_S = 2.0  # rank 0 looks this often for a new complete checkpoint of its script


# ---- the supervisor --------------------------------------------------------------


class Supervisor(MemberViews):
    """See the module docstring. `run()` does everything; the constructor nothing."""

    def __init__(self, config: RuntimeConfig, command: Sequence[str], script_dir: Path,
                 stop_grace: float = DEFAULT_STOP_GRACE_S, keep: int = 3, warm: bool = True,
                 progress: str | None = None, limit: RestartLimit = RestartLimit(),
                 checkpoint_poll_s: float = DEFAULT_CHECKPOINT_POLL_S) -> None:
        self.cfg = config
        self.me = config.worker_id
        self.script_dir = Path(script_dir)
        # The script's report() lines: beside its directory (never in its snapshots).
        self.progress_path = self.script_dir.parent / f".{self.script_dir.name}.progress"
        self._patterns = compile_progress(progress) if progress else ()
        self._limit = limit
        self._progress_file = ProgressFile(self.progress_path)
        self._tracker = ProgressTracker()
        self._tracker_lock = threading.Lock()
        self._step_from: str | None = None  # "report" | "output": where the script's step came from
        self._last_progress_poll = 0.0
        self._running_since: float | None = None  # wall time the scripts counted as training
        self._ever_running = False  # they did in some generation of this supervisor
        self._failure: str | None = None  # the job stopped on the restart limit: why
        self._failure_noted = False  # this generation's child's failure is in the store
        self.argv = expand_command(command, self.script_dir)
        self.stop_grace = stop_grace
        self._keep = keep
        self._launch = Launcher(self.argv, warm, host_of(self.me), config.job, self.me)
        self._script_store: ScriptStore | None = None  # rank 0: this generation's scripts' store
        self._child: Child | None = None
        self._child_ran = False  # a child ran in the current generation
        # The snapshots of the script's directory this supervisor holds, saves and restores.
        self._snaps = SnapshotKeeper(self.me, self.script_dir, checkpoint_poll_s, lambda: self._tracker.step,
                                     lambda: self._child)
        self._t_change: float | None = None  # when the pending change became known (monotonic)
        self._change_kind: EventKind | None = None
        self._member = False
        self._over = False  # left, finished or stopped: nothing more to do
        # This member's store, control thread, membership state machine and reports (a store
        # error is only logged: restart mode does not ride out the store's loss).
        self._session = MemberSession("supervisor", group_name="supervisors' group", mode="restart",
                                      rides_store_loss=False)

    # -- the membership state machine's view (and MemberViews': _plan, _rank, _pg) -----------
    @property
    def _store(self):
        return self._session.store

    # -- lifecycle -------------------------------------------------------------
    def run(self) -> int:
        cfg, session = self.cfg, self._session
        session.connect(cfg)
        if cfg.checkpoint_dir is not None:
            self._snaps.open(cfg.checkpoint_dir, self._keep, self._on_checkpoint)
        hooks = GenerationHooks(before_group=self._before_group, on_group=self._on_group, on_leave=self._on_leave,
                                on_abort=self._on_abort)
        session.start(hooks, torch.device("cpu"))
        session.trap_sigterm()
        gen = session.gen
        try:
            self._prewarm()
            if self._launch.warm is not None and not self._launch.warm.wait_ready(WARM_READY_S):
                log.warning("supervisor %s: the warm interpreter was not ready within %g s; joining anyway",
                            self.me, WARM_READY_S)
            plan = session.admit(leave_gives_up=True)  # None: the job is done, or asked to leave first
            self._member = plan is not None
            # enter each generation (on_group starts the script), watch it, and after
            # an abort (on_abort) the roll call: generation.Generations.run
            gen.run(plan, lambda: self._watch(gen.abort), alive=lambda: str(self._snaps.counter))
            return 0
        except BaseException as e:
            if self._member and not self._over and not isinstance(e, ExcludedFromJob):
                session.leave_abruptly(repr(e))
            raise
        finally:
            self._snaps.join_live()
            if self._child is not None:
                self._child.stop(grace=min(self.stop_grace, 5.0))
            self._launch.close()
            self._snaps.close()
            session.close()
            self._close_script_store()

    # -- the membership state machine's hooks (generation.GenerationHooks) ---------------
    def _before_group(self, plan: Plan) -> None:
        self._child, self._child_ran = None, False
        self._close_script_store()  # the last generation's scripts have exited

    def _on_group(self, plan: Plan) -> None:
        """The supervisors' group is formed and checked: agree on the snapshot,
        unpack it and start the script (the watch follows: _watch)."""
        me, st, abort, snaps = self.me, self._store, self._session.abort, self._snaps
        if self._rank == 0:
            self._script_store = ScriptStore(self._session.bind_host).open()
            st.set(Keys.master(plan.generation), self._script_store.endpoint)  # signed; for who looks
        restored = self._sync(abort)
        addr, _, port = self._master(abort).rpartition(":")
        counter = snaps.unpack()
        if self._rank == 0:
            snaps.unpacked_here()  # the directory is snapshot `counter`
            if counter > snaps.saved:
                snaps.save(wait=False)
        restarts = snaps.starts
        if self._rank == 0 and self._tracker.step is None:
            self._seed_progress()
        self._running_since, self._failure_noted = None, False
        self._progress_file.poll()
        self._progress_file.reset()
        with self._tracker_lock:
            self._tracker.reset()
        env = child_env(os.environ, self.script_dir, self.progress_path)
        env.update(torchrun_env(plan.members, me, addr, int(port), restarts, self.cfg.job,
                                gpus=self.cfg.device is Device.CUDA))
        self._child = self._launch.start(env, self._pump())
        self._child_ran = True
        snaps.starts += 1
        now = time.monotonic()
        log.info("supervisor %s: started the script (pid %d, %s) as rank %d of %d in generation %d (%s), "
                 "restart %d, snapshot %d; its store (MASTER_ADDR:MASTER_PORT) %s:%s", me, self._child.proc.pid,
                 "warm" if self._launch.last_warm else "cold", self._rank, plan.world_size, plan.generation,
                 plan.kind.value, restarts, counter, addr, port)
        if self._rank == 0:  # every generation's start is an event, the job's first too
            kind = EventKind.RESTORE if restored else (self._change_kind or plan.kind)
            pause = round(now - self._t_change, 4) if self._t_change is not None else None
            self._session.report.event(generation_event(kind, plan, restarts=restarts, from_step=counter,
                                                        step=counter, pause_s=pause))
        self._t_change, self._change_kind = None, None
        if self._rank == 0:
            self._write_status(now)

    def _on_leave(self, plan: Plan | None) -> None:
        if plan is None:
            log.info("supervisor %s: every member leaves; the job pauses at snapshot %d", self.me,
                     self._snaps.counter)
        self._over = True

    def _on_abort(self, error: Aborted) -> None:
        """Stop the script; rank 0 snapshots its directory if a script ran (the roll call follows)."""
        self._t_change = self._t_change or time.monotonic()
        self._stop_child()
        if self._rank == 0 and self._child_ran:
            self._snaps.take()
        self._change_kind = None

    def _close_script_store(self) -> None:
        if self._script_store is not None:
            self._script_store.close()
            self._script_store = None

    def _pump(self) -> OutputPump:
        return OutputPump(progress_matcher(self._patterns, self._on_output) if self._patterns else None)

    def _prewarm(self, wait: bool = True) -> None:
        self._launch.prewarm(child_env(os.environ, self.script_dir, self.progress_path), self._pump(), wait)

    def _sync(self, abort) -> bool:
        """Agree on the newest snapshot and the start count; True if it came from
        an eltctl checkpoint (no member held one)."""
        snaps, pg, rank = self._snaps, self._pg, self._rank
        rows = transfer.gather_holdings(pg, snaps.snap is not None, snaps.counter, [snaps.starts], abort)
        snaps.starts = max(r[2] for r in rows)
        _reports, source = transfer.choose(rows)
        if not source.needed:
            return False
        restored = False
        if rank == source.source and source.restore:
            restored = snaps.restore() is not None
            if restored:
                self._restored_progress()
        data = snaps.snap[1] if rank == source.source else None
        data, (counter, starts, restored) = transfer.broadcast_bytes(
            pg, data, source.source, rank, abort, meta=[snaps.counter, snaps.starts, int(restored)])
        snaps.starts = max(snaps.starts, starts)
        if rank != source.source:
            snaps.snap = (counter, data)
        return bool(restored)

    def _master(self, abort) -> str:
        """Rank 0's script store (`addr:port`), broadcast over the supervisors' group
        (whose members the signed rendezvous vouches for): nothing written to the store
        after rank 0 wrote gen/<g>/master can redirect the scripts or abort the generation."""
        raw = self._script_store.endpoint.encode() if self._rank == 0 else None
        return transfer.broadcast_bytes(self._pg, raw, 0, self._rank, abort)[0].decode()

    def _watch(self, abort) -> Plan | None:
        """The control-flag rounds of a running generation; acts on the first change."""
        W, r = self._plan.world_size, self._rank
        while True:
            flags = self._flags()
            collectives.allreduce(self._pg, flags, abort)
            f = flags.tolist()
            stop, join = f[0] > 0, f[1] > 0
            leavers = {self._plan.members[i] for i in range(W) if f[2 + i] > 0}
            finished = f[2 + W] > 0  # rank 0's script exited 0
            failed = [self._plan.members[i] for i in range(W) if f[2 + 2 * W + i] > 0]
            now = time.monotonic()
            if stop:
                return self._end("stop")
            if finished:
                return self._end("finished")
            if leavers or join or failed:
                self._t_change = now
                kind = EventKind.LEAVE if leavers else EventKind.CRASH if failed else EventKind.JOIN
                log.info("supervisor %s: generation %d changes (leave: %s, join: %s, failed scripts: %s); "
                         "stopping the script", self.me, self._plan.generation, sorted(leavers) or "-",
                         "yes" if join else "no", failed or "-")
                return self._change(leavers, kind, abort, failed)
            if now - self._last_progress_poll >= PROGRESS_POLL_S:
                self._last_progress_poll = now
                self._read_progress()
            if self._running_since is None and (now - self._launch.started_t >= SETTLE_S or self._tracker.step is not None
                                                and self._tracker.updated is not None
                                                and self._tracker.updated >= time.time() - (now - self._launch.started_t)):
                # every member's script ran past the settle time (no failure flag came up) or reported a step
                self._running_since = time.time()
                self._ever_running = True
            if r == 0:
                self._snaps.look(now)
            if r == 0 and now - self._session.report.last_status_t >= STATUS_EVERY_S:
                self._write_status(now)
            if self._launch.warm is None and now - self._launch.started_t >= PREWARM_AFTER_S:
                self._prewarm(wait=False)
            abort.wait(TICK_S)

    def _flags(self) -> torch.Tensor:
        W, r = self._plan.world_size, self._rank
        req = self._session.control.requests
        flags = torch.zeros(2 + 3 * W, dtype=torch.int64)
        flags[0] = int(req.stop)
        # The control thread may still report a join against the previous plan
        # (the one this generation admitted): check the queue against this plan.
        # (the queue is read, never its unsigned counter: membership.scan_joiners)
        flags[1] = int(req.join and any(w not in self._plan.members
                                        for _, w in scan_joiners(self._store, self._plan.join_upto)[0]))
        flags[2 + r] = int(req.leave)
        rc = self._child.poll() if self._child is not None and not self._child.stopping else None
        if rc is not None:
            if rc == 0 and r == 0:
                flags[2 + W] = 1
            elif rc != 0:
                flags[2 + 2 * W + r] = 1
                if not self._failure_noted:
                    self._note_failure(rc)
        return flags

    def _note_failure(self, rc: int) -> None:
        """The script failed by itself: its last line goes to the store, for rank 0's verdict."""
        self._failure_noted = True
        self._child.pump.join(timeout=1.0)
        cause = self._child.pump.cause() or f"exit status {rc}"
        log.warning("supervisor %s: the script exited with status %s: %s", self.me, rc, cause)
        try:
            self._store.set(Keys.script_failure(self.me), json.dumps({"time": time.time(), "rc": rc,
                                                                      "line": cause}))
        except Exception as e:  # noqa: BLE001 - the verdict then lacks this line
            log.warning("supervisor %s: could not record the script's failure: %s", self.me, e)

    def _change(self, leavers: set[str], kind: EventKind, abort, failed: Sequence[str] = ()) -> Plan | None:
        """Stop every script, hand rank 0's directory to every member, decide the next plan."""
        self._change_kind = kind
        self._stop_child()
        # Every script has exited once this round completes; leaves that came
        # in meanwhile join this change instead of causing another.
        flags = collectives.allreduce(self._pg, self._flags(), abort).tolist()
        W = self._plan.world_size
        leavers |= {self._plan.members[i] for i in range(W) if flags[2 + i] > 0}
        if failed:
            give_up, backoff = self._verdict(failed, abort)
            if give_up:
                return self._end("failed")
            if backoff > 0:
                log.info("supervisor %s: the script failed; waiting %g s before it starts again", self.me, backoff)
                abort.wait(backoff)
        self._share_snapshot(abort)
        if self._rank == 0:
            self._snaps.save(wait=False)
        # The next plan (None: every member leaves, on_leave); the run loop enters it
        # (a planned leaver of it leaves there).
        return self._session.gen.change(leavers, EventKind.LEAVE if leavers else kind)

    def _verdict(self, failed: Sequence[str], abort) -> tuple[bool, float]:
        """Rank 0 adds this failure to the job's list (the store) and decides, for
        everyone: stop the job (the restart limit) or wait the back-off."""
        header = torch.zeros(2, dtype=torch.int64)
        if self._rank == 0:
            now = time.time()
            try:
                raw = self._store.get(Keys.SCRIPT_FAILURES) if self._store.check([Keys.SCRIPT_FAILURES]) else b"[]"
                times = [float(t) for t in json.loads(raw)]
            except (ValueError, TypeError, ForgedValue):
                times = []
            times = self._limit.recent(times + [now], now)
            self._store.set(Keys.SCRIPT_FAILURES, json.dumps(times))
            give_up = self._limit.gives_up(times, now)
            if give_up:
                line = ""
                for w in failed:
                    try:
                        line = json.loads(self._store.get(Keys.script_failure(w))).get("line", "") or line
                    except (ValueError, ForgedValue, AttributeError):
                        pass
                    if line:
                        break
                self._failure = self._limit.message(len(times), line)
                log.error("supervisor %s: the job stops: %s", self.me, self._failure)
            header[0], header[1] = int(give_up), int(self._limit.backoff(times, now) * 1000)
        give_up, backoff_ms = (int(x) for x in collectives.broadcast(self._pg, header, 0, abort).tolist())
        return bool(give_up), backoff_ms / 1000.0

    def _share_snapshot(self, abort) -> None:
        """Rank 0 packs its script directory (no script runs) and broadcasts it."""
        snaps = self._snaps
        if self._rank == 0:
            snaps.take()
        data, (counter,) = transfer.broadcast_bytes(self._pg, snaps.snap[1] if self._rank == 0 else None, 0,
                                                    self._rank, abort, meta=[snaps.counter])
        if self._rank != 0:
            snaps.snap = (counter, data)

    def _end(self, reason: str) -> None:
        """The job ends (a stop request, rank 0's script finished, or the script failed
        `max_restarts` times: "failed", the reason in the status and the done key)."""
        grace = self.stop_grace
        if reason == "finished" and self._child is not None:
            try:  # the other ranks' scripts are finishing too: let them
                self._child.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                grace = 5.0
        self._stop_child(grace)
        self._over = True
        self._session.gen.done()
        if self._rank == 0:
            snaps, report = self._snaps, self._session.report
            snaps.take()
            snaps.save(wait=True)
            if reason == "stop":
                report.stopped(snaps.counter)
            self._write_status(time.monotonic())
            done = {"script_step": self._tracker.step}
            if reason == "failed":
                done["failed"] = self._failure
                report.stopped(snaps.counter, failed=self._failure)
            report.done(snaps.counter, reason, **done)
        log.info("supervisor %s: the job ends (%s)", self.me, reason)
        return None

    def _stop_child(self, grace: float | None = None) -> None:
        self._snaps.join_live()
        if self._child is not None:
            rc = self._child.stop(self.stop_grace if grace is None else grace)
            self._child.pump.join()
            log.info("supervisor %s: the script exited (%s)", self.me, rc)
        self._read_progress()  # its last reports

    # -- checkpoints, status ---------------------------------------------------------
    def _restored_progress(self) -> None:
        """A snapshot restored from a checkpoint: the script's step where it was saved
        (its own output corrects it)."""
        script_step = self._snaps.steps.get(self._snaps.counter)
        if script_step is not None:
            with self._tracker_lock:
                self._tracker.step = script_step

    def _on_checkpoint(self, info) -> None:  # writer thread
        self._session.report.checkpointed(info, snapshot=info.step, script_step=self._snaps.steps.get(info.step))

    # -- the script's progress ------------------------------------------------------
    def _on_output(self, values) -> None:  # an output thread: a progress pattern matched
        with self._tracker_lock:
            if self._step_from == "report" and "step" in values:
                values = {k: v for k, v in values.items() if k != "step"}  # report() is the better source
            elif "step" in values:
                self._step_from = "output"
            self._tracker.update(values)

    def _read_progress(self) -> None:
        for line in self._progress_file.poll():
            if "checkpoint" in line:
                self._snaps.announced = True
                continue
            with self._tracker_lock:
                if line.get("step") is not None:
                    self._step_from = "report"
                self._tracker.update(line, now=float(line.get("t") or time.time()))

    def _seed_progress(self) -> None:
        """A new rank 0 starts from the step the previous one last wrote (it resumes near it)."""
        status = self._session.read(get_status)
        step = status.get("step") if isinstance(status, dict) else None
        if isinstance(step, int):
            with self._tracker_lock:
                self._tracker.step = step

    def _write_status(self, now: float) -> None:
        t = self._tracker
        running = self._running_since is not None
        script = {"step": t.step, "step_from": self._step_from, "loss": t.loss, "samples": t.samples,
                  "samples_per_s": t.samples_per_s, "steps_per_s": t.steps_per_s, "epoch": t.epoch,
                  "updated": t.updated, "running": running, "running_since": self._running_since,
                  "ever_running": self._ever_running,
                  "metrics": dict(t.metrics)}
        extra = {"snapshot": self._snaps.counter, "script": script}
        if self._failure is not None:
            extra["failed"] = self._failure
        self._session.report.status(now, step=t.step, epoch=t.epoch, position=0,  # epoch: None while unknown
                                    samples_per_s=t.samples_per_s,  # None while unknown: not "0.0 samples/s"
                                    loss=t.loss, restarts=max(0, self._snaps.starts - 1), extra=extra)


# ---- the command line ----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m eltctl_runtime.restart",
        description="Run an unmodified torchrun script as a member of an eltctl job (restart mode).")
    ap.add_argument("--stop-grace", type=float, default=DEFAULT_STOP_GRACE_S,
                    help="seconds the script has to exit after SIGTERM before SIGKILL (default 30)")
    ap.add_argument("--script-dir", type=Path, default=None,
                    help="where the script's own checkpoint directories live (one per slot); "
                         "default: script-checkpoints beside ELTCTL_CHECKPOINT_DIR")
    ap.add_argument("--no-warm", action="store_true",
                    help="start each generation's script cold (default: a process with torch already "
                         "imported waits for it, for `python script.py` and `python -m module` commands)")
    ap.add_argument("--progress", default=None,
                    help="a regex with named groups (step, loss, samples, samples_per_s, ...) or a name in "
                         "eltctl_runtime.restart.progress.PATTERNS, matched against rank 0's output lines")
    ap.add_argument("--max-restarts", type=int, default=RestartLimit.max_restarts,
                    help="the job stops once the script failed this often within --restart-window "
                         "(0: never; default 5)")
    ap.add_argument("--restart-window", type=float, default=RestartLimit.window_s,
                    help="seconds (default 600)")
    ap.add_argument("--checkpoint-poll", type=float, default=DEFAULT_CHECKPOINT_POLL_S,
                    help="how often rank 0 looks for a new complete checkpoint of its script to mirror "
                         "while it runs (seconds, default 2)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the script's command")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the script's command after --")
    if args.stop_grace <= 0:
        ap.error("--stop-grace must be positive")
    if args.max_restarts < 0 or args.restart_window <= 0 or args.checkpoint_poll <= 0:
        ap.error("--max-restarts must be >= 0, --restart-window and --checkpoint-poll positive")
    if args.progress:
        try:
            compile_progress(args.progress)
        except ValueError as e:
            ap.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    cfg = RuntimeConfig.from_env()
    base = args.script_dir
    if base is None:
        if cfg.checkpoint_dir is None:
            ap.error("give --script-dir (or set ELTCTL_CHECKPOINT_DIR)")
        base = cfg.checkpoint_dir.parent / "script-checkpoints"
    sup = Supervisor(cfg, command, base / slot_of(cfg.worker_id), stop_grace=args.stop_grace,
                     warm=not args.no_warm, progress=args.progress,
                     limit=RestartLimit(max_restarts=args.max_restarts, window_s=args.restart_window),
                     checkpoint_poll_s=args.checkpoint_poll)
    # End as a worker ends (exiting.py): once run() returns, the process exits without the
    # interpreter's teardown, whose destructors of the gloo groups this process held (the
    # last generation's, and the dropped ones collectives.bury keeps) can abort it when a
    # peer closes its side meanwhile: seen in CI, a supervisor whose job had ended cleanly
    # exited -6 (terminate called after throwing gloo::IoException).
    exiting.arm()
    try:
        return sup.run()
    except ExcludedFromJob as e:
        log.error("%s", e)
        return 3

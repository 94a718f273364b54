"""Restart mode: an unmodified torchrun script under eltctl's membership.

`python -m eltctl_runtime.restart [--stop-grace S] [--script-dir D] -- <command>`
runs in place of the training script, one per slot. This supervisor is a member
of the job exactly like an ElasticJob worker (the same ELTCTL_* environment,
join queue, leave/dead keys, generation plans (membership.py), membership
state machine (generation.py: it runs the whole machine, with the hooks below)
and control thread (control.py)), so the host daemon, owner yield, scale, down and logs
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
import ctypes
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from ..member import collectives, exiting
from ..store.auth import Forgeries, ForgedValue
from ..member.collectives import Aborted
from ..config import Device, RuntimeConfig
from ..member.control import ControlThread
from ..member.generation import ExcludedFromJob, GenerationHooks, Generations
from ..member.plan import Plan, choose_source, job_store, scan_joiners
from .progress import ENV_PROGRESS, ProgressFile, ProgressTracker, compile_progress
from ..protocol import EventKind, Keys, add_event, put_dead, status_document
from .snapshots import pack_dir, unpack_dir
from .watch import CheckpointWatch, Listing, LiveSnapshots, OutputPump, RestartLimit, Take, group_pids, listing, progress_matcher, writers_under
from ..train.state import tensor_bytes
from ..store import client as storeclient

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
SNAPSHOT_FORMAT = "eltctl-restart-snapshot"
MASTER_BYTES = 128  # room for rank 0's script store `addr:port` (an IPv6 address with its port fits)
SCRIPT_DIR_PLACEHOLDER = "{checkpoint_dir}"
# The child's environment: eltctl's own variables are the supervisor's, not the script's
# (ELTCTL_JOB stays: it marks the job's processes for the daemon and `down`).
_CHILD_DROPS = ("ELTCTL_STORE", "ELTCTL_WORKER_ID", "ELTCTL_DEVICE", "ELTCTL_LOCAL_GPU",
                "ELTCTL_HANG_TIMEOUT", "ELTCTL_MIN_WORKERS", "ELTCTL_MAX_WORKERS", "ELTCTL_AUDIT",
                "ELTCTL_SECRET_FILE")  # the script has no business with the store or its secret
_PR_SET_PDEATHSIG = 1
_PYTHON = re.compile(r"python[\d.]*$")
WARM_MODULE = "eltctl_runtime.restart.warmstart"


# ---- pure parts ---------------------------------------------------------------


def host_of(worker: str) -> str:
    return worker.split("/", 1)[0]


def slot_of(worker: str) -> str:
    parts = worker.split("/")
    return parts[1] if len(parts) > 2 else "0"


def torchrun_env(members: Sequence[str], me: str, master_addr: str, master_port: int, restarts: int,
                 run_id: str, gpus: bool) -> dict[str, str]:
    """torchrun's environment for `me` in a generation of `members` (rank order).
    LOCAL_RANK is the order among the members on its host, GROUP_RANK the host's
    index in order of its first member; with `gpus`, CUDA_VISIBLE_DEVICES lists the
    host's member GPUs (their slots) in LOCAL_RANK order, so `cuda:LOCAL_RANK` is
    this member's GPU."""
    hosts: list[str] = []
    for w in members:
        if host_of(w) not in hosts:
            hosts.append(host_of(w))
    local = [w for w in members if host_of(w) == host_of(me)]
    rank, world = members.index(me), len(members)
    env = {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local.index(me)),
        "LOCAL_WORLD_SIZE": str(len(local)), "GROUP_RANK": str(hosts.index(host_of(me))),
        "GROUP_WORLD_SIZE": str(len(hosts)), "ROLE_NAME": "default", "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restarts), "TORCHELASTIC_RUN_ID": run_id,
        # env:// connects as a client to the store rank 0's supervisor hosts (ScriptStore),
        # as torchrun's agent store: no script hosts one on a port it must find free first.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(slot_of(w) for w in local)
    return env


def expand_command(command: Sequence[str], script_dir: Path) -> list[str]:
    return [a.replace(SCRIPT_DIR_PLACEHOLDER, str(script_dir)) for a in command]


def warm_form(argv: Sequence[str]) -> tuple[str, list[str], bool] | None:
    """(interpreter, the script's argv, whether it is `-m module`) when `argv` is
    `python script.py ...` or `python -m module ...` (no interpreter options), the
    forms a warm interpreter (warmstart.py) can run; None otherwise."""
    if len(argv) < 2 or not _PYTHON.match(os.path.basename(argv[0])):
        return None
    if argv[1] == "-m":
        return (argv[0], list(argv[2:]), True) if len(argv) > 2 else None
    if argv[1].startswith("-"):
        return None
    return argv[0], list(argv[1:]), False


# ---- the script's process ------------------------------------------------------


try:  # looked up here, not in the forked child (no dynamic loading between fork and exec)
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None


def _child_setup() -> None:
    """In the child before exec: its own process group, and SIGKILL when the
    supervisor dies (a supervisor killed with SIGKILL leaves no orphan)."""
    os.setpgrp()
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Child:
    """The script's process (its own group) in one generation."""

    def __init__(self, proc: subprocess.Popen, pump: OutputPump) -> None:
        self.proc = proc
        self.pump = pump  # its output, passed through to ours
        self.stopping = False

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str], pump: OutputPump) -> "Child":
        proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=_child_setup, close_fds=True)
        pump.attach(proc.stdout, proc.stderr)
        return cls(proc, pump)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace: float) -> int:
        """SIGTERM to its group, up to `grace` seconds to exit, then SIGKILL; the exit code."""
        self.stopping = True
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log.warning("the script (pid %d) did not exit within %g s of SIGTERM; killing it",
                            self.proc.pid, grace)
        _killpg(self.proc.pid, signal.SIGKILL)  # and anything it left in its group
        return self.proc.wait()


class Warm:
    """The next generation's process, started ahead with torch imported
    (warmstart.py); `hand` gives it the script to run."""

    def __init__(self, proc: subprocess.Popen, pipe: int, ready: int, pump: OutputPump) -> None:
        self.proc = proc
        self.pump = pump
        self._pipe: int | None = pipe
        self._ready: int | None = ready  # read end: one byte once torch is imported

    @classmethod
    def start(cls, python: str, env: Mapping[str, str], pump: OutputPump) -> "Warm":
        r, w = os.pipe()
        rr, rw = os.pipe()
        try:
            proc = subprocess.Popen([python, "-m", WARM_MODULE, str(r), str(rw)], env=dict(env),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(r, rw), preexec_fn=_child_setup, close_fds=True)
            pump.attach(proc.stdout, proc.stderr)
        except BaseException:
            os.close(w)
            os.close(rr)
            raise
        finally:
            os.close(r)
            os.close(rw)
        return cls(proc, w, rr, pump)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until it has imported torch; False if it died or the time ran out."""
        if self._ready is None:
            return self.proc.poll() is None
        readable, _, _ = select.select([self._ready], [], [], timeout)
        ok = bool(readable) and os.read(self._ready, 1) == b"1"
        os.close(self._ready)
        self._ready = None
        return ok

    def hand(self, argv: Sequence[str], module: bool, env: Mapping[str, str]) -> Child | None:
        """The warm process now runs the script; None if it is gone (start one cold)."""
        if self.proc.poll() is not None or self._pipe is None:
            self.discard()
            return None
        try:
            os.write(self._pipe, (json.dumps({"argv": list(argv), "module": module, "env": dict(env)}) + "\n").encode())
        except OSError:
            self.discard()
            return None
        os.close(self._pipe)
        self._pipe = None
        if self._ready is not None:
            os.close(self._ready)
            self._ready = None
        return Child(self.proc, self.pump)

    def discard(self) -> None:
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self._ready is not None:
            os.close(self._ready)
            self._ready = None
        _killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class ScriptStore:
    """The scripts' rendezvous store (their env:// MASTER_ADDR:MASTER_PORT) for one
    generation, hosted by rank 0's supervisor: a libuv TCPStore server on a socket
    bound to the data-plane address (`addr`, where the other members reach this host;
    never every interface) and listening before its port is published, so nobody can
    take the port between a probe and the script's bind. The scripts connect as
    clients (TORCHELASTIC_USE_AGENT_STORE). One per generation: a fresh store, as
    re-used keys hang (pytorch#55967). `open()` binds, `close()` stops the server."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.port: int | None = None
        self._server = None

    def open(self) -> "ScriptStore":
        family = socket.AF_INET6 if ":" in self.addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.addr, 0))
            sock.listen(socket.SOMAXCONN)
            self.port = sock.getsockname()[1]
        except OSError:
            sock.close()
            raise
        fd = sock.detach()  # the server owns the listening socket from here
        try:
            self._server = dist.TCPStore(self.addr, self.port, is_master=True, wait_for_workers=False,
                                         timeout=timedelta(seconds=60), master_listen_fd=fd, use_libuv=True)
        except BaseException:
            os.close(fd)
            raise
        return self

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    def close(self) -> None:
        self._server = None  # the TCPStore's destructor stops the server and closes its socket


# ---- the supervisor --------------------------------------------------------------


class Supervisor:
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
        self._poll_s = checkpoint_poll_s
        self._progress_file = ProgressFile(self.progress_path)
        self._tracker = ProgressTracker()
        self._tracker_lock = threading.Lock()
        self._step_from: str | None = None  # "report" | "output": where the script's step came from
        self._last_progress_poll = 0.0
        self._running_since: float | None = None  # wall time the scripts counted as training
        self._ever_running = False  # they did in some generation of this supervisor
        self._failure: str | None = None  # the job stopped on the restart limit: why
        self._failure_noted = False  # this generation's child's failure is in the store
        self._ckpt_watch = CheckpointWatch()
        self._announced = False  # the script called checkpoint_saved since the last look
        self._last_look = 0.0
        self._live: threading.Thread | None = None  # rank 0: a snapshot taken while the script runs
        self._live_snaps: LiveSnapshots | None = None  # how it is taken (made at the first one)
        self._snap_steps: dict[int, int | None] = {}  # snapshot counter -> the script's step when it was taken
        self.argv = expand_command(command, self.script_dir)
        self.stop_grace = stop_grace
        self._keep = keep
        self._warm_form = warm_form(self.argv) if warm else None
        self._warm: Warm | None = None
        self._child_t = 0.0
        self._child_warm = False
        self._gen: Generations | None = None  # the membership state machine (generation.py); made in run()
        self._script_store: ScriptStore | None = None  # rank 0: this generation's scripts' store
        self._child: Child | None = None
        self._child_ran = False  # a child ran in the current generation
        self._snap: tuple[int, bytes] | None = None  # (snapshot counter, tar) held in memory
        self._unpacked: int | None = None  # the counter whose tar is in script_dir
        self._saved = 0  # the newest counter this supervisor saved as an eltctl checkpoint
        self._starts = 0  # how often the job's scripts were started (job-wide, agreed)
        self._t_change: float | None = None  # when the pending change became known (monotonic)
        self._change_kind: EventKind | None = None
        self._last_status = 0.0
        self._last_ckpt: dict | None = None
        self._member = False
        self._over = False  # left, finished or stopped: nothing more to do
        self._ckpt = None
        self._control: ControlThread | None = None
        self._forgeries = Forgeries()  # forged store values read, over all of this supervisor's connections

    # -- the membership state machine's view --------------------------------------------
    @property
    def _plan(self) -> Plan | None:
        return self._gen.plan if self._gen is not None else None

    @property
    def _rank(self) -> int:
        return self._gen.rank if self._gen is not None else -1

    @property
    def _pg(self):
        return self._gen.pg if self._gen is not None else None

    # -- lifecycle -------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        self._bind = collectives.bind_address(cfg.store_host, cfg.store_port)
        self._store = self._connect()
        if cfg.checkpoint_dir is not None:
            from ..checkpoint.store import CheckpointStore

            self._ckpt = CheckpointStore(cfg.checkpoint_dir, keep=self._keep, on_committed=self._on_checkpoint)
        self._control = ControlThread(self._connect, self.me, cfg.hang_timeout_s, cfg.max_workers)
        self._control.start()
        hooks = GenerationHooks(before_group=self._before_group, on_group=self._on_group, on_leave=self._on_leave,
                                on_abort=self._on_abort)
        self._gen = Generations(self.me, lambda: self._store, self._control, hooks, device=torch.device("cpu"),
                                bind_host=self._bind, max_workers=cfg.max_workers,
                                hang_timeout_s=cfg.hang_timeout_s, label="supervisor",
                                group_name="supervisors' group")
        old = signal.signal(signal.SIGTERM, lambda *_: self._control.request_local_leave())
        try:
            self._prewarm()
            if self._warm is not None and not self._warm.wait_ready(WARM_READY_S):
                log.warning("supervisor %s: the warm interpreter was not ready within %g s; joining anyway",
                            self.me, WARM_READY_S)
            plan = self._admit()
            # enter each generation (on_group starts the script), watch it, and after
            # an abort (on_abort) the roll call: generation.Generations.run
            self._gen.run(plan, lambda: self._watch(self._gen.abort),
                          alive=lambda: str(self._snap[0] if self._snap else 0))
            return 0
        except BaseException as e:
            if self._member and not self._over and not isinstance(e, ExcludedFromJob):
                log.error("supervisor %s: leaving abruptly: %r", self.me, e)
                try:
                    put_dead(self._store, self.me)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
            raise
        finally:
            self._join_live()
            if self._child is not None:
                self._child.stop(grace=min(self.stop_grace, 5.0))
            if self._warm is not None:
                self._warm.discard()
            if self._ckpt is not None:
                self._ckpt.close()
            self._control.close()
            signal.signal(signal.SIGTERM, old)
            self._gen.close()
            self._close_script_store()

    def _connect(self):
        cfg = self.cfg
        raw = storeclient.connect(cfg.store_spec, 60)
        return job_store(raw, cfg.job, cfg.secret, self._forgeries, cfg.run_id())  # run id: read at every connect

    # -- admission (as ElasticJob._admit) -----------------------------------------
    def _admit(self) -> Plan | None:
        """Wait to be a member (membership.await_admission); None: the job is done,
        or this supervisor was asked to leave first."""
        cfg = self.cfg

        def asked_to_leave() -> bool:
            if not self._control.requests.leave:
                return False
            log.info("supervisor %s: asked to leave before it was admitted", self.me)
            put_dead(self._store, self.me)  # so that nobody admits it any more
            return True

        plan = self._gen.admit(min_workers=cfg.min_workers, give_up=asked_to_leave)
        self._member = plan is not None
        return plan

    def _scan_joiners(self, after: int) -> tuple[list[tuple[int, str]], int]:
        return scan_joiners(self._store, after)

    # -- the membership state machine's hooks (generation.GenerationHooks) ---------------
    def _before_group(self, plan: Plan) -> None:
        self._child, self._child_ran = None, False
        self._close_script_store()  # the last generation's scripts have exited

    def _on_group(self, plan: Plan) -> None:
        """The supervisors' group is formed and checked: agree on the snapshot,
        unpack it and start the script (the watch follows: _watch)."""
        me, st, abort = self.me, self._store, self._gen.abort
        if self._rank == 0:
            self._script_store = ScriptStore(self._bind).open()
            st.set(Keys.master(plan.generation), self._script_store.endpoint)  # signed; for who looks
        restored = self._sync(abort)
        addr, _, port = self._master(abort).rpartition(":")
        counter, data = self._snap
        if self._unpacked != counter:
            unpack_dir(data, self.script_dir)
            self._unpacked = counter
        self.script_dir.mkdir(parents=True, exist_ok=True)
        if self._rank == 0:
            self._ckpt_watch.unpacked(listing(self.script_dir))  # the directory is snapshot `counter`
            if counter > self._saved:
                self._save_checkpoint(wait=False)
        restarts = self._starts
        if self._rank == 0 and self._tracker.step is None:
            self._seed_progress()
        self._running_since, self._failure_noted = None, False
        self._progress_file.poll()
        self._progress_file.reset()
        with self._tracker_lock:
            self._tracker.reset()
        env = _child_env(os.environ, self.script_dir, self.progress_path)
        env.update(torchrun_env(plan.members, me, addr, int(port), restarts, self.cfg.job,
                                gpus=self.cfg.device is Device.CUDA))
        self._child = self._start_child(env)
        self._child_ran = True
        self._starts += 1
        now = time.monotonic()
        log.info("supervisor %s: started the script (pid %d, %s) as rank %d of %d in generation %d (%s), "
                 "restart %d, snapshot %d; its store (MASTER_ADDR:MASTER_PORT) %s:%s", me, self._child.proc.pid,
                 "warm" if self._child_warm else "cold", self._rank, plan.world_size, plan.generation,
                 plan.kind.value, restarts, counter, addr, port)
        if self._rank == 0:  # every generation's start is an event, the job's first too
            kind = EventKind.RESTORE if restored else (self._change_kind or plan.kind)
            pause = round(now - self._t_change, 4) if self._t_change is not None else None
            self._event({"kind": kind.value, "mode": "restart", "generation": plan.generation,
                         "world_size": plan.world_size, "members": list(plan.members), "joined": list(plan.joined),
                         "left": list(plan.left), "lost": list(plan.lost), "restarts": restarts,
                         "from_step": counter, "step": counter, "pause_s": pause})
        self._t_change, self._change_kind = None, None
        if self._rank == 0:
            self._write_status(now)

    def _on_leave(self, plan: Plan | None) -> None:
        if plan is None:
            log.info("supervisor %s: every member leaves; the job pauses at snapshot %d", self.me, self._snap[0])
        self._over = True

    def _on_abort(self, error: Aborted) -> None:
        """Stop the script; rank 0 snapshots its directory if a script ran (the roll call follows)."""
        self._t_change = self._t_change or time.monotonic()
        self._stop_child()
        if self._rank == 0 and self._child_ran:
            self._take_snapshot()
        self._change_kind = None

    def _close_script_store(self) -> None:
        if self._script_store is not None:
            self._script_store.close()
            self._script_store = None

    def _start_child(self, env: Mapping[str, str]) -> Child:
        """The script in the warm process if there is one, else cold; then the next warm one."""
        child, self._child_warm = None, False
        if self._warm is not None:
            _python, argv, module = self._warm_form
            child, self._warm = self._warm.hand(argv, module, env), None
        self._child_warm = child is not None
        if child is None:
            child = Child.start(self.argv, env, self._pump())
        self._child_t = time.monotonic()
        return child

    def _pump(self) -> OutputPump:
        return OutputPump(progress_matcher(self._patterns, self._on_output) if self._patterns else None)

    def _prewarm(self) -> None:
        if self._warm_form is not None and self._warm is None:
            try:
                self._warm = Warm.start(self._warm_form[0],
                                        _child_env(os.environ, self.script_dir, self.progress_path), self._pump())
            except OSError as e:
                log.warning("supervisor %s: no warm interpreter (%s); scripts start cold", self.me, e)
                self._warm_form = None

    def _sync(self, abort) -> bool:
        """Agree on the newest snapshot and the start count; True if it came from
        an eltctl checkpoint (no member held one)."""
        has = self._snap is not None
        counter = self._snap[0] if has else 0
        report = torch.tensor([int(has), counter, self._starts], dtype=torch.int64)
        reports = [t.tolist() for t in collectives.allgather(self._pg, report, abort)]
        self._starts = max(r[2] for r in reports)
        transfer = choose_source([(bool(r[0]), int(r[1])) for r in reports])
        if not transfer.needed:
            return False
        restored = False
        if self._rank == transfer.source:
            if transfer.restore:
                restored = self._restore()
            counter, data = self._snap
            header = torch.tensor([len(data), counter, self._starts, int(restored)], dtype=torch.int64)
        else:
            header = torch.zeros(4, dtype=torch.int64)
        header = collectives.broadcast(self._pg, header, transfer.source, abort)
        n, counter, starts, restored = (int(x) for x in header.tolist())
        self._starts = max(self._starts, starts)
        if n and self._plan.world_size > 1:
            buf = (_as_tensor(self._snap[1]) if self._rank == transfer.source
                   else torch.empty(n, dtype=torch.uint8))
            buf = collectives.broadcast(self._pg, buf, transfer.source, abort)
            if self._rank != transfer.source:
                self._snap = (counter, tensor_bytes(buf))
        elif self._rank != transfer.source:
            self._snap = (counter, b"")
        return bool(restored)

    def _master(self, abort) -> str:
        """Rank 0's script store (`addr:port`), broadcast over the supervisors' group
        (whose members the signed rendezvous vouches for): nothing written to the store
        after rank 0 wrote gen/<g>/master can redirect the scripts or abort the generation."""
        buf = torch.zeros(MASTER_BYTES, dtype=torch.uint8)
        if self._rank == 0:
            raw = self._script_store.endpoint.encode()
            buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if self._plan.world_size > 1:
            buf = collectives.broadcast(self._pg, buf, 0, abort)
        return tensor_bytes(buf).rstrip(b"\0").decode()

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
            if self._running_since is None and (now - self._child_t >= SETTLE_S or self._tracker.step is not None
                                                and self._tracker.updated is not None
                                                and self._tracker.updated >= time.time() - (now - self._child_t)):
                # every member's script ran past the settle time (no failure flag came up) or reported a step
                self._running_since = time.time()
                self._ever_running = True
            if r == 0 and now - self._last_look >= self._poll_s:
                self._last_look = now
                self._look_for_checkpoint()
            if r == 0 and now - self._last_status >= STATUS_EVERY_S:
                self._write_status(now)
            if self._warm is None and now - self._child_t >= PREWARM_AFTER_S:
                self._prewarm()
            abort.wait(TICK_S)

    def _flags(self) -> torch.Tensor:
        W, r = self._plan.world_size, self._rank
        req = self._control.requests
        flags = torch.zeros(2 + 3 * W, dtype=torch.int64)
        flags[0] = int(req.stop)
        # The control thread may still report a join against the previous plan
        # (the one this generation admitted): check the queue against this plan.
        # (the queue is read, never its unsigned counter: membership.scan_joiners)
        flags[1] = int(req.join and any(w not in self._plan.members
                                        for _, w in self._scan_joiners(self._plan.join_upto)[0]))
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
            self._save_checkpoint(wait=False)
        # The next plan (None: every member leaves, on_leave); the run loop enters it
        # (a planned leaver of it leaves there).
        return self._gen.change(leavers, EventKind.LEAVE if leavers else kind)

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
        if self._rank == 0:
            self._take_snapshot()
            counter, data = self._snap
            header = torch.tensor([len(data), counter], dtype=torch.int64)
        else:
            header = torch.zeros(2, dtype=torch.int64)
        n, counter = (int(x) for x in collectives.broadcast(self._pg, header, 0, abort).tolist())
        buf = _as_tensor(self._snap[1]) if self._rank == 0 else torch.empty(n, dtype=torch.uint8)
        if n and self._plan.world_size > 1:
            buf = collectives.broadcast(self._pg, buf, 0, abort)
        if self._rank != 0:
            self._snap = (counter, tensor_bytes(buf) if n else b"")

    def _take_snapshot(self) -> None:
        counter = (self._snap[0] if self._snap else 0) + 1
        self._snap = (counter, pack_dir(self.script_dir))
        self._unpacked = counter  # the directory is the snapshot
        log.info("supervisor %s: snapshot %d of %s (%d bytes)", self.me, counter, self.script_dir,
                 len(self._snap[1]))

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
        self._gen.done()
        if self._rank == 0:
            self._take_snapshot()
            self._save_checkpoint(wait=True)
            if reason == "stop":
                self._event({"kind": EventKind.STOP.value, "mode": "restart", "generation": self._plan.generation,
                             "step": self._snap[0]})
            self._write_status(time.monotonic())
            done = {"step": self._snap[0], "reason": reason, "script_step": self._tracker.step}
            if reason == "failed":
                done["failed"] = self._failure
                self._event({"kind": EventKind.STOP.value, "mode": "restart", "generation": self._plan.generation,
                             "step": self._snap[0], "failed": self._failure})
            self._store.set(Keys.DONE, json.dumps(done))
        log.info("supervisor %s: the job ends (%s)", self.me, reason)
        return None

    def _stop_child(self, grace: float | None = None) -> None:
        self._join_live()
        if self._child is not None:
            rc = self._child.stop(self.stop_grace if grace is None else grace)
            self._child.pump.join()
            log.info("supervisor %s: the script exited (%s)", self.me, rc)
        self._read_progress()  # its last reports

    # -- checkpoints, status, events -------------------------------------------------
    def _restore(self) -> bool:
        """No member holds a snapshot: the newest eltctl checkpoint's, if any."""
        self._snap = (0, b"")
        if self._ckpt is None:
            return False
        found = self._ckpt.latest_valid()
        if found is None:
            return False
        info, state = found
        if not isinstance(state, dict) or state.get("format") != SNAPSHOT_FORMAT:
            log.warning("supervisor %s: the checkpoint %s is not a restart-mode snapshot; starting afresh",
                        self.me, info.path)
            return False
        self._snap = (info.step, tensor_bytes(state["tar"]))
        self._saved = info.step
        script_step = int(state.get("script_step", -1))
        if script_step >= 0:
            self._snap_steps[info.step] = script_step
            with self._tracker_lock:
                self._tracker.step = script_step  # where it was when saved; its own output corrects it
        # The generation that ran after this snapshot used the saved count: the
        # restored scripts get a higher one (TORCHELASTIC_RESTART_COUNT only grows).
        self._starts = max(self._starts, int(state.get("starts", 0)) + 1)
        log.info("supervisor %s: restored snapshot %d from %s", self.me, info.step, info.path)
        return True

    def _save_checkpoint(self, wait: bool) -> None:
        if self._ckpt is None or self._snap is None or self._snap[0] <= self._saved:
            return
        counter, data = self._snap
        self._snap_steps[counter] = self._tracker.step
        script_step = self._tracker.step
        self._ckpt.save_async(counter, {"format": SNAPSHOT_FORMAT, "tar": _as_tensor(data), "starts": self._starts,
                                        "script_step": script_step if script_step is not None else -1},
                              meta={"mode": "restart", "snapshot": counter, "script_step": script_step})
        self._saved = counter
        if wait:
            self._ckpt.wait()

    def _on_checkpoint(self, info) -> None:  # writer thread
        self._last_ckpt = {"step": info.step, "time": info.created, "path": str(info.path),
                           "snapshot": info.step, "script_step": self._snap_steps.get(info.step)}

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
                self._announced = True
                continue
            with self._tracker_lock:
                if line.get("step") is not None:
                    self._step_from = "report"
                self._tracker.update(line, now=float(line.get("t") or time.time()))

    def _seed_progress(self) -> None:
        """A new rank 0 starts from the step the previous one last wrote (it resumes near it)."""
        try:
            if self._store.check([Keys.STATUS]):
                step = json.loads(self._store.get(Keys.STATUS)).get("step")
                if isinstance(step, int):
                    with self._tracker_lock:
                        self._tracker.step = step
        except (ValueError, ForgedValue, AttributeError):
            pass

    # -- rank 0: mirroring the script's checkpoints while it runs ----------------------
    def _look_for_checkpoint(self) -> None:
        """Pack the script's directory in the background when it holds a new complete checkpoint."""
        if self._ckpt is None or self._child is None or self._child.stopping or (
                self._live is not None and self._live.is_alive()):
            return
        current = listing(self.script_dir)
        announced, self._announced = self._announced, False
        writers = self._writers() if current else []
        how = self._ckpt_watch.look(current, writers, announced)
        if how is None:
            return
        self._live = threading.Thread(target=self._live_snapshot, args=(how, current), name="live-snapshot",
                                      daemon=True)
        self._live.start()

    def _writers(self) -> list[str]:
        """The files under the script's directory its processes hold open for writing (relative)."""
        child = self._child
        if child is None:
            return []
        root = str(self.script_dir.resolve())
        return [os.path.relpath(w, root) for w in writers_under(group_pids(child.proc.pid), self.script_dir)]

    def _live_snapshot(self, how: Take, judged: Listing) -> None:
        if self._live_snaps is None:
            self._live_snaps = LiveSnapshots(self.script_dir, lambda: bool(self._writers()))
        got = self._live_snaps.take(how, judged, self._ckpt_watch.last_taken)
        if got is None:
            log.info("supervisor %s: no consistent copy of the script's directory this time (%s); next look",
                     self.me, how.value)
            return
        before, data = got
        self._ckpt_watch.taken(before)
        counter = (self._snap[0] if self._snap else 0) + 1
        self._snap = (counter, data)
        self._unpacked = counter
        log.info("supervisor %s: snapshot %d of %s while the script runs (script step %s, %d bytes)", self.me,
                 counter, self.script_dir, self._tracker.step, len(data))
        self._save_checkpoint(wait=False)

    def _join_live(self) -> None:
        if self._live is not None:
            self._live.join()
            self._live = None

    def _write_status(self, now: float) -> None:
        self._last_status = now
        plan = self._plan
        t = self._tracker
        running = self._running_since is not None
        script = {"step": t.step, "step_from": self._step_from, "loss": t.loss, "samples": t.samples,
                  "samples_per_s": t.samples_per_s, "steps_per_s": t.steps_per_s, "epoch": t.epoch,
                  "updated": t.updated, "running": running, "running_since": self._running_since,
                  "ever_running": self._ever_running,
                  "metrics": dict(t.metrics)}
        extra = {"snapshot": self._snap[0] if self._snap else 0, "script": script}
        if self._failure is not None:
            extra["failed"] = self._failure
        doc = status_document(generation=plan.generation, world_size=plan.world_size, members=plan.members,
                              step=t.step, epoch=t.epoch, position=0,  # epoch: None while unknown
                              samples_per_s=t.samples_per_s,  # None while unknown: not "0.0 samples/s"
                              loss=t.loss, checkpoint=self._last_ckpt, mode="restart",
                              restarts=max(0, self._starts - 1), forged=self._forgeries.counts(), extra=extra)
        try:
            self._store.set(Keys.STATUS, json.dumps(doc))
        except Exception as e:  # noqa: BLE001 - status is advisory
            log.warning("supervisor %s: could not write status: %s", self.me, e)

    def _event(self, ev: dict) -> None:
        ev.setdefault("time", time.time())
        add_event(self._store, ev)
        log.info("supervisor %s: event %s", self.me, json.dumps(ev))


def _as_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _child_env(base: Mapping[str, str], script_dir: Path, progress_path: Path) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _CHILD_DROPS}
    env["ELTCTL_CHECKPOINT_DIR"] = str(script_dir)
    env[ENV_PROGRESS] = str(progress_path)
    # Its output reaches the worker's log (and the progress patterns) through a pipe:
    # unbuffered, as on a terminal, so a line is seen when it is printed.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


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

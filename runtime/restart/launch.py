"""The script's processes in restart mode: its command and environment (torchrun's,
for its rank in a generation), its process group started cold or handed to a warm
interpreter (warmstart.py) that already imported torch, and the rendezvous store
its processes meet on (`ScriptStore`, hosted by rank 0's supervisor).

The supervisor (supervisor.py) decides when a generation's script starts and
stops; everything here is how.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import signal
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Sequence

import torch.distributed as dist

from ..daemon.forkserver import ForkServer, Forked
from ..member.plan import host_of
from .progress import ENV_PROGRESS
from .warmstart import warm_form  # noqa: F401 - the supervisor's name for it
from .watch import OutputPump

log = logging.getLogger("eltctl_runtime")

SCRIPT_DIR_PLACEHOLDER = "{checkpoint_dir}"
# The child's environment: eltctl's own variables are the supervisor's, not the script's
# (ELTCTL_JOB stays: it marks the job's processes for the daemon and `down`).
_CHILD_DROPS = ("ELTCTL_STORE", "ELTCTL_WORKER_ID", "ELTCTL_DEVICE", "ELTCTL_LOCAL_GPU",
                "ELTCTL_HANG_TIMEOUT", "ELTCTL_MIN_WORKERS", "ELTCTL_MAX_WORKERS", "ELTCTL_AUDIT",
                "ELTCTL_SECRET_FILE")  # the script has no business with the store or its secret
_PR_SET_PDEATHSIG = 1
WARM_MODULE = "eltctl_runtime.restart.warmstart"


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

    def __init__(self, proc: subprocess.Popen | Forked, pump: OutputPump) -> None:
        self.proc = proc  # a Popen, or forked by the supervisor's fork server (the same calls)
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

    def __init__(self, proc: subprocess.Popen | Forked, pipe: int, ready: int, pump: OutputPump) -> None:
        self.proc = proc
        self.pump = pump
        self._pipe: int | None = pipe
        self._ready: int | None = ready  # read end: one byte once torch is imported

    @classmethod
    def start(cls, python: str, env: Mapping[str, str], pump: OutputPump,
              forks: ForkServer | None = None, *, wait: bool = True) -> "Warm":
        """`python -m warmstart`, forked from `forks` (the supervisor's fork server: no import of
        torch for each generation; `wait=False`: only from a fork server already up) where it
        can, else started plainly."""
        r, w = os.pipe()
        rr, rw = os.pipe()
        argv = [python, "-m", WARM_MODULE, str(r), str(rw)]
        try:
            proc = cls._forked(forks, argv, env, pump, (r, rw), wait) if forks is not None else None
            if proc is None:
                proc = subprocess.Popen(argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, pass_fds=(r, rw), preexec_fn=_child_setup,
                                        close_fds=True)
                pump.attach(proc.stdout, proc.stderr)
        except BaseException:
            os.close(w)
            os.close(rr)
            raise
        finally:
            os.close(r)
            os.close(rw)
        return cls(proc, w, rr, pump)

    @staticmethod
    def _forked(forks: ForkServer, argv: list[str], env: Mapping[str, str], pump: OutputPump,
                pass_fds: tuple[int, int], wait: bool) -> Forked | None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = forks.try_spawn(argv, env, Path.cwd(), None, pass_fds=pass_fds, streams=(out_w, err_w),
                                   group=True, start=wait)
        finally:
            os.close(out_w)
            os.close(err_w)
        if proc is None:
            os.close(out_r)
            os.close(err_r)
            return None
        pump.attach(os.fdopen(out_r, "rb", buffering=0), os.fdopen(err_r, "rb", buffering=0))
        return proc

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


class Launcher:
    """How each generation's script starts: handed to a warm interpreter started ahead
    (`prewarm`) when there is one, else cold. The warm interpreters are forks of one fork
    server (daemon/zygote.py: torch imported once per supervisor, not once per
    generation), or plain `python -m warmstart` where it cannot serve."""

    def __init__(self, argv: Sequence[str], warm: bool, host: str, job: str, who: str) -> None:
        self.argv = list(argv)
        self._form = warm_form(self.argv) if warm else None
        self._forks = ForkServer(host, job)
        self._who = who
        self.warm: Warm | None = None
        self.last_warm = False  # the last start was handed to a warm interpreter
        self.started_t = 0.0  # when the last script started (monotonic)

    def prewarm(self, env: Mapping[str, str], pump: OutputPump, wait: bool = True) -> None:
        """The next generation's warm interpreter (`wait`: for the fork server's torch import;
        without it, forked only from one already up, else started plainly)."""
        if self._form is not None and self.warm is None:
            try:
                self.warm = Warm.start(self._form[0], env, pump, self._forks, wait=wait)
            except OSError as e:
                log.warning("supervisor %s: no warm interpreter (%s); scripts start cold", self._who, e)
                self._form = None

    def start(self, env: Mapping[str, str], pump: OutputPump) -> Child:
        """The script in the warm process if there is one, else cold."""
        child = None
        if self.warm is not None and self._form is not None:
            _python, argv, module = self._form
            child, self.warm = self.warm.hand(argv, module, env), None
        self.last_warm = child is not None
        if child is None:
            child = Child.start(self.argv, env, pump)
        self.started_t = time.monotonic()
        return child

    def close(self) -> None:
        if self.warm is not None:
            self.warm.discard()
            self.warm = None
        self._forks.close()


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


def child_env(base: Mapping[str, str], script_dir: Path, progress_path: Path) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _CHILD_DROPS}
    env["ELTCTL_CHECKPOINT_DIR"] = str(script_dir)
    env[ENV_PROGRESS] = str(progress_path)
    # Its output reaches the worker's log (and the progress patterns) through a pipe:
    # unbuffered, as on a terminal, so a line is seen when it is printed.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


"""The daemon's side of its fork server (zygote.py): start it, fork workers through it.

`ForkServer.spawn` stands in for procs.start_worker when the command is `python
script.py ...` or `python -m module ...` (no interpreter options) and ELTCTL_FORK_SERVER
is not "0" (in the daemon's environment or the job's env). The first call starts the
zygote (the workers' interpreter as their PATH finds it, with their environment less
eltctl's own variables and CUDA_VISIBLE_DEVICES: `shared_env`) and waits for its
imports, which a worker started the plain way would have spent too; each later worker
is a fork, without torch's import (about 3.5 CPU-s here, with the torch._dynamo that
torch's optimizers import lazily; tens of milliseconds forked). A worker whose
interpreter or shared environment differs from the zygote's gets a new zygote (the
job's env changed). It answers None, and the daemon starts that worker the plain way,
whenever the zygote cannot serve: another form of command, no interpreter on PATH,
torch does not import there, or the zygote died without answering. What a forked
worker looks like from outside (its session, descriptors, directory, environment,
command line, exit status) is what Popen would have made (zygote.py).

A forked worker is the zygote's child, not the daemon's: its exit status comes in a
message (`Forked.poll`). If the zygote dies, its workers run on (their parent is then
init) and are `orphaned`: the daemon treats them as adopted ones (liveness from /proc,
no exit status). The zygote ends when the daemon closes it (`close`, at the daemon's
exit) or exits (its socket closes); after IDLE_S without a worker of its own it is
closed too, so a host whose GPUs went back to their owners does not keep an
interpreter with torch in memory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Mapping, Sequence

from ..restart.warmstart import warm_form
from .courtesy import Courtesy

log = logging.getLogger("eltctl_runtime.daemon")

ENV_SWITCH = "ELTCTL_FORK_SERVER"  # "0" (the daemon's or the job's env): every worker is started the plain way
CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"
READY_TIMEOUT_S = 180.0  # torch's import on a busy host
REPLY_TIMEOUT_S = 30.0
IDLE_S = 600.0
PYTHONS = ("python", "python3")
PAD_VAR = "ELTCTL_ZYGOTE_PAD"  # the zygote's room for its workers' environments (zygote.py)
PAD_SLACK = 4096  # bytes of room beyond the first worker's environment and command line
MAX_MESSAGE = 1 << 20
MAX_FDS = 16


def shared_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment shares with the zygote's: all but eltctl's own variables and
    the GPU it sees (nothing torch's import reads; runtime/ reads none of its variables at import,
    and CUDA reads CUDA_VISIBLE_DEVICES when it first initialises, after the fork)."""
    return {k: v for k, v in env.items() if not k.startswith("ELTCTL_") and k != CUDA_DEVICES}


def _serialized(items: Sequence[str]) -> int:
    return sum(len(s.encode("utf-8", "surrogateescape")) + 1 for s in items)


def forkable(argv: Sequence[str]) -> bool:
    """`python script ...` or `python -m module ...`: what the zygote can become (warm_form)."""
    return warm_form(argv) is not None


class Forked:
    """A worker forked by the zygote: what the daemon (and tests) use of a Popen. One forked
    with `group` (restart mode's) dies with its zygote (PR_SET_PDEATHSIG): once the zygote is
    gone without reporting its exit, it reads as killed by SIGKILL, as a Popen would."""

    def __init__(self, server: "ForkServer", pid: int, zygote: int, group: bool = False) -> None:
        self._server = server
        self.pid = pid
        self._zygote = zygote  # which of the server's zygotes forked it (a pid alone is reused)
        self._dies_with_zygote = group
        self.returncode: int | None = None

    @property
    def orphaned(self) -> bool:
        """The zygote died before it reported this worker's exit: no status will come."""
        return self.returncode is None and self._server.lost(self.pid, self._zygote)

    def poll(self) -> int | None:
        if self.returncode is None:
            # The server hands a status out once: a second thread's poll that found None must not
            # write None over what the first one got (seen in the CI run of eabdc90: three runtime
            # tests waited for a worker that had exited)
            code = self._server.exit_code(self.pid, self._zygote)
            if code is None and self._dies_with_zygote and self._server.lost(self.pid, self._zygote):
                code = -signal.SIGKILL
            if code is not None:
                self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if self.orphaned:
                raise ChildProcessError(f"pid {self.pid}: its fork server died; no exit status will come")
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


class ForkServer:
    """One zygote at a time, started at the first `spawn` (`job`: the ELTCTL_JOB the zygote
    carries, so that whatever finds a job's processes by their environment finds it too;
    `output`: where its own output goes, as Popen's stdout, None for the caller's)."""

    def __init__(self, host: str, job: str | None = None, output: int | None = None) -> None:
        self._host = host
        self._job = job
        self._output = output  # the zygote's stdout and stderr (its import's warnings): None, the daemon's
        self._enabled = os.environ.get(ENV_SWITCH, "1") != "0"
        self._lock = threading.RLock()  # spawn, the status reads and close may come from several threads
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._python: str | None = None  # the zygote's interpreter, as the workers' PATH finds it
        self._env: dict[str, str] | None = None  # the workers' shared_env it was started with
        self._zygote = 0  # the number of the zygote now (or last) started: each start counts one up
        self._exits: dict[tuple[int, int], int] = {}  # (zygote, pid) -> exit status, until it is read
        self._mine: set[int] = set()  # forked by the zygote now up and not yet reported ended
        self._idle_since = time.monotonic()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path | None,
              courtesy: Courtesy | None = None, device: str = "cpu", pass_fds: Sequence[int] = (), *,
              streams: tuple[int, int] | None = None, group: bool = False, start: bool = True) -> Forked | None:
        """A worker forked as procs.start_worker would start `argv`; None: start it the plain way.

        Restart mode's supervisor (restart/launch.py) asks for what its Popen makes instead:
        `streams`, the write ends of its stdout and stderr pipes (instead of `log_path`), and
        `group`, a process group of its own (not a session) that dies with the zygote, which
        ends with the supervisor. `pass_fds` land at their numbers here, as with Popen.
        `start=False`: only from a zygote that is already up (no wait for torch's import)."""
        if not self._enabled or env.get(ENV_SWITCH) == "0" or not forkable(argv):
            return None
        python = shutil.which(argv[0], path=env.get("PATH", os.defpath))
        if python is None:
            return None
        with self._lock:
            for attempt in (1, 2):
                base = shared_env(env)
                if self._sock is not None and (base != self._env or python != self._python):
                    log.info("host %s: the workers' interpreter or environment changed; a new fork server starts",
                             self._host)
                    self.close()
                if self._sock is None and (not start or not self._start(python, base, argv, env)):
                    return None
                reply = self._request(argv, env, cwd, log_path, courtesy, device, pass_fds, streams, group)
                if "spawned" in reply:
                    pid = int(reply["spawned"])
                    self._mine.add(pid)
                    return Forked(self, pid, self._zygote, group)
                why = reply.get("failed", "no answer")
                if attempt == 1 and "does not fit" in why:  # a longer environment than the zygote has room for
                    self.close()
                    continue
                log.warning("host %s: the fork server could not start a worker (%s); starting it the plain way",
                            self._host, why)
                if "failed" not in reply:
                    self.close()
                return None
        return None

    def try_spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path | None,
                  courtesy: Courtesy | None = None, device: str = "cpu", pass_fds: Sequence[int] = (),
                  **how) -> Forked | None:
        """`spawn`, and None (start it the plain way) if the fork server itself fails."""
        try:
            return self.spawn(argv, env, cwd, log_path, courtesy, device, pass_fds, **how)
        except Exception:  # noqa: BLE001 - never a reason not to start the worker
            log.exception("host %s: the fork server failed; starting the worker the plain way", self._host)
            self.close()
            return None

    def exit_code(self, pid: int, zygote: int) -> int | None:
        with self._lock:
            self._drain()
            return self._exits.pop((zygote, pid), None)

    def lost(self, pid: int, zygote: int) -> bool:
        """Its zygote ended before it reported `pid`'s exit: no status will come."""
        with self._lock:
            self._drain()
            return (zygote != self._zygote or self._sock is None) and (zygote, pid) not in self._exits

    def tick(self, now: float) -> None:
        """Close an idle zygote (no worker of its own for IDLE_S)."""
        with self._lock:
            self._drain()
            if self._mine:
                self._idle_since = now
            elif self._sock is not None and now - self._idle_since > IDLE_S:
                log.info("host %s: no worker for %.0f s: the fork server ends", self._host, IDLE_S)
                self.close()

    def close(self) -> None:
        """End the zygote (its forked workers run on, `orphaned`) and forget it."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                self._proc = None
            self._mine.clear()  # orphaned from here (`lost`): their zygote is gone
            self._env = self._python = None

    # -- internals --------------------------------------------------------------------------------
    def _start(self, python: str, base: dict[str, str], argv: Sequence[str], env: Mapping[str, str]) -> bool:
        zenv = dict(base)
        if self._job:
            zenv["ELTCTL_JOB"] = self._job
        # Room for a worker's environment and command line over the zygote's own (zygote.py).
        pad_env = max(0, _serialized([f"{k}={v}" for k, v in env.items()]) -
                      _serialized([f"{k}={v}" for k, v in zenv.items()])) + PAD_SLACK
        zenv[PAD_VAR] = "x" * pad_env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._zygote += 1
        zygote_argv = [python, "-m", "eltctl_runtime.daemon.zygote", str(theirs.fileno())]
        pad_arg = max(0, _serialized([python, *argv[1:]]) - _serialized(zygote_argv)) + PAD_SLACK
        try:
            proc = subprocess.Popen([*zygote_argv, " " * pad_arg], env=zenv, stdin=subprocess.DEVNULL,
                                    stdout=self._output, stderr=self._output, pass_fds=(theirs.fileno(),),
                                    close_fds=True)
        except OSError as e:
            log.warning("host %s: the fork server did not start (%s): workers start the plain way", self._host, e)
            ours.close()
            self._enabled = False
            return False
        finally:
            theirs.close()
        self._proc, self._sock = proc, ours
        t0 = time.monotonic()
        reply = self._receive(lambda m: "ready" in m or "error" in m, READY_TIMEOUT_S)
        if reply is None or "error" in reply:
            log.warning("host %s: the fork server is not usable (%s): workers start the plain way", self._host,
                        reply.get("error") if reply else "no answer")
            self.close()
            self._enabled = False
            return False
        self._env, self._python = base, python
        self._idle_since = time.monotonic()
        log.info("host %s: fork server pid %d ready in %.1f s (%s)", self._host, proc.pid, time.monotonic() - t0,
                 python)
        return True

    def _request(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path | None,
                 courtesy: Courtesy | None, device: str, pass_fds: Sequence[int],
                 streams: tuple[int, int] | None, group: bool) -> dict:
        spec = {"argv": list(argv), "env": dict(env), "cwd": str(cwd), "device": device,
                "courtesy": asdict(courtesy) if courtesy is not None else None,
                "fds_at": list(pass_fds), "group": group, "streams": "pipes" if streams else "log"}
        assert self._sock is not None
        try:
            self._sock.settimeout(REPLY_TIMEOUT_S)
            message = [json.dumps({"spawn": spec}).encode()]
            if streams is not None:
                socket.send_fds(self._sock, message, [*streams, *pass_fds])
            else:
                assert log_path is not None
                with open(log_path, "ab", buffering=0) as logf:
                    socket.send_fds(self._sock, message, [logf.fileno(), *pass_fds])
            return self._receive(lambda m: "spawned" in m or "failed" in m, REPLY_TIMEOUT_S) or {}
        except OSError as e:
            return {"error": str(e)}

    def _note(self, msg: dict) -> None:
        if "exit" in msg:
            pid = int(msg["exit"])
            self._exits[(self._zygote, pid)] = int(msg["code"])
            self._mine.discard(pid)

    def _receive(self, want, timeout: float) -> dict | None:
        """The next message `want` accepts (others are noted), or None: timed out or closed."""
        deadline = time.monotonic() + timeout
        assert self._sock is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._sock.settimeout(left)
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                return None
            if not data:
                return None
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            if want(msg):
                return msg
            self._note(msg)

    def _drain(self) -> None:
        if self._sock is None:
            return
        self._sock.settimeout(0.0)
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                log.warning("host %s: the fork server ended; its workers run on, watched as adopted ones",
                            self._host)
                self.close()
                return
            try:
                self._note(json.loads(data))
            except ValueError:
                pass

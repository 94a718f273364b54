"""The job's state directory on the control machine, and the files in it.

`${XDG_STATE_HOME:-~/.local/state}/eltctl/<job>/` holds what the controller keeps
between runs and what the commands read (docs/control-plane.md, "Files"):

    controller.lock   flock'ed by the live controller for its whole life
    controller.json   {pid, started, inventory, store: {address, port, pid}, socket}
    control.sock      the command socket
    status.json       the status document, rewritten about once a second
    hosts.json        the controller's memory about hosts (removed, benched, ...)
    controller.log, storekeeper.log

Everything written here is written atomically (a temporary file renamed into
place), so a reader never sees half a document, whatever dies when. This module
imports nothing heavy: the CLI commands use it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


def state_root(environ: Mapping[str, str] | None = None) -> Path:
    """`$XDG_STATE_HOME/eltctl`, or `~/.local/state/eltctl` (the XDG default)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME", "").strip()
    # The XDG spec says a relative value is invalid and must be ignored.
    root = Path(base) if base and os.path.isabs(base) else Path(env.get("HOME") or Path.home()) / ".local" / "state"
    return root / "eltctl"


@dataclass(frozen=True)
class StateDir:
    """The paths of one job's state directory. Creating one touches nothing on disk."""

    path: Path

    @classmethod
    def for_job(cls, job: str, environ: Mapping[str, str] | None = None) -> "StateDir":
        return cls(state_root(environ) / job)

    @property
    def lock(self) -> Path:
        return self.path / "controller.lock"

    @property
    def controller_json(self) -> Path:
        return self.path / "controller.json"

    @property
    def socket(self) -> Path:
        return self.path / "control.sock"

    @property
    def status_json(self) -> Path:
        return self.path / "status.json"

    @property
    def hosts_json(self) -> Path:
        return self.path / "hosts.json"

    @property
    def controller_log(self) -> Path:
        return self.path / "controller.log"

    @property
    def storekeeper_log(self) -> Path:
        return self.path / "storekeeper.log"

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)


def write_json_atomic(path: Path, document: Any) -> None:
    """Write `document` as JSON to `path` so that readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: Path) -> Any | None:
    """The document at `path`, or None when it is missing or not valid JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class ControllerLock:
    """The flock that makes a controller the only one of its job.

    The lock is held by an open file descriptor, so it goes away with the process
    however it dies: a stale lock file never blocks the next controller.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock without waiting; False when another process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def lock_holder(path: Path) -> int | None:
    """The pid written in the lock file when that process is alive, else None.

    Only a hint for messages: testing the flock itself would briefly take it and
    could make a starting controller believe another one runs.
    """
    try:
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def pid_alive(pid: int | None) -> bool:
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own exited child not yet reaped) is not alive for our purposes.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True

"""The host daemon's view of local processes: the single-instance lock, /proc
lookups, and starting and signalling worker processes.

Thin and Linux-specific (it reads /proc); every decision about what to do with
processes lives in logic.py. Whether a pid is alive and what a pid file says
are the runtime's shared helpers (pids.py). Nothing here keeps state except
`PidLock`, which holds its file descriptor (and so its flock) for the daemon's
life.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from ..files import remove, try_flock
from ..pids import pid_alive, read_pid_file
from .courtesy import Courtesy, preexec


# ---------------------------------------------------------------------------- the pid lock


class AlreadyRunning(RuntimeError):
    """Another daemon holds the pid file's lock."""

    def __init__(self, path: Path, pid: int | None) -> None:
        super().__init__(f"another daemon (pid {pid if pid else 'unknown'}) holds {path}")
        self.path = path
        self.pid = pid


class PidLock:
    """`daemon.pid`, flocked for the daemon's whole life: one daemon per (job, host).

    The lock is on the file, and the file is removed on a clean exit, so after
    taking the lock we check that the path still names the file we locked (a
    daemon exiting between our open and our flock would leave us holding a lock
    on a deleted file while a third daemon creates a new one)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = try_flock(self.path, 0o644)
            if fd is None:
                raise AlreadyRunning(self.path, read_pid_file(self.path))
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Remove the pid file, then drop the lock (in that order: see the class doc)."""
        if self._fd is None:
            return
        remove(self.path)
        os.close(self._fd)
        self._fd = None


# ---------------------------------------------------------------------------- /proc


def environ_of(pid: int) -> dict[str, str] | None:
    """The environment a process started with; None if gone or unreadable
    (another user's process)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def is_visible(pid: int) -> bool:
    """Whether the pid exists in our pid namespace at all."""
    return os.path.exists(f"/proc/{pid}")


def parent_map() -> dict[int, int]:
    """pid -> parent pid for every process we can see."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and len(fields) > 2:
                out[int(entry)] = int(fields[1])
    return out


def user_of(pid: int) -> str | None:
    """The login name owning a process (its real uid), or None if gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    uid = int(line.split()[1])
                    break
            else:
                return None
    except OSError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def worker_identity(pid: int, job: str) -> str | None:
    """ELTCTL_WORKER_ID of a live process of `job`, or None if the pid is gone,
    not ours, or was reused by an unrelated process."""
    if not pid_alive(pid):
        return None
    env = environ_of(pid)
    if not env or env.get("ELTCTL_JOB") != job:
        return None
    return env.get("ELTCTL_WORKER_ID") or None


def session_leaders_of(job: str, prefix: str) -> dict[int, str]:
    """pid -> ELTCTL_WORKER_ID of every live session leader (a worker: the daemon
    starts each in its own session, so its children are not listed) whose
    environment holds ELTCTL_JOB=<job> and a worker id starting with `prefix`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) != pid:
                continue
        except OSError:
            continue
        wid = worker_identity(pid, job)
        if wid and wid.startswith(prefix):
            found[pid] = wid
    return found


# ---------------------------------------------------------------------------- workers


def start_worker(argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path,
                 courtesy: Courtesy | None = None, device: str = "cpu",
                 pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """A worker in its own session (so a signal to its group reaches everything
    it started, and a daemon killed with SIGKILL leaves it running), stdin
    /dev/null, stdout and stderr appended to its log, at the `courtesy`'s nice
    level, I/O class and memory limit (courtesy.py; set in the child before exec,
    so every thread and process of the worker inherits them). `pass_fds`:
    descriptors it inherits (its GPU claim, runtime/claims.py)."""
    setup = preexec(courtesy, device) if courtesy is not None else None
    with open(log_path, "ab", buffering=0) as log:
        return subprocess.Popen(list(argv), env=dict(env), cwd=str(cwd), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                preexec_fn=setup, pass_fds=tuple(pass_fds))


def signal_group(pid: int, sig: int) -> bool:
    """Signal a worker's process group (its pid: it leads its own session);
    False if it is already gone."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        pass
    except PermissionError:
        return False
    try:  # not a group leader any more (should not happen): the process alone
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


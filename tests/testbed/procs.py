"""Processes of a simulated host: finding them, killing them, and foreign users.

All simulated hosts share one kernel, so "the processes of host h1" are those
whose environment carries h1's `ELTSIM_STATE` (a path unique to one test bed's
host): every session gets it from sshd's SetEnv, so anything started over SSH
inherits it unless the command scrubs its environment. sshd's own processes
cannot be found that way (sshd's setproctitle overwrites the memory that
/proc/PID/environ shows); they are the descendants of the listener we started
(each connection's sshd calls setsid, but keeps its parent).
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import time

FOREIGN_USER = "eltsim"


def host_pids(state_path: str, *, prefix: bool = False) -> list[int]:
    """Live pids whose environment holds ELTSIM_STATE=<state_path> (not ourselves).

    prefix=True matches every state file under a directory (a whole test bed).
    """
    marker = b"\0ELTSIM_STATE=" + state_path.encode() + (b"" if prefix else b"\0")
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = b"\0" + f.read() + b"\0"
        except OSError:
            continue
        if marker in env and is_alive(int(entry)):
            found.append(int(entry))
    return found


def process_starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if rest[0] in (b"Z", b"X") else int(rest[19])


def is_alive(pid: int) -> bool:
    """Running or sleeping; a zombie is dead (its memory and GPU are gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def descendants(root: int) -> list[int]:
    """Every live process below `root` in the parent tree (not `root` itself)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_host_processes(state_path: str, rounds: int = 20, *, prefix: bool = False) -> list[int]:
    """SIGKILL every process of the host until none is left; return the pids killed.

    Repeated because a process may fork while we scan.
    """
    killed: list[int] = []
    for _ in range(rounds):
        pids = host_pids(state_path, prefix=prefix)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return killed


def stop_popen(proc: subprocess.Popen, *, group: bool = True) -> None:
    """SIGKILL a child we started (and its process group) and reap it."""
    if proc.poll() is None:
        try:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def ensure_foreign_user(name: str = FOREIGN_USER) -> pwd.struct_passwd | None:
    """The system user that plays "somebody else"; created once if we are root.

    None when it cannot exist (not root, no useradd): callers fall back to the
    current user.
    """
    for attempt in range(10):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
        if os.geteuid() != 0:
            return None
        try:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                 "--shell", "/usr/sbin/nologin", name],
                check=False, capture_output=True, timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        # Another test session may hold the passwd lock; try again.
        time.sleep(0.1 * (attempt + 1))
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def start_as_user(argv: list[str], user: pwd.struct_passwd | None) -> subprocess.Popen:
    """Start `argv` in its own session, as `user` when given (we must be root)."""
    if user is not None and user.pw_uid != os.geteuid():
        argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *argv]
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin"}, start_new_session=True, cwd="/",
    )

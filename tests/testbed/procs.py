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

import grp
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


LOGIN_PREFIX = "eltsim-"


def login_account_name(host: str) -> str:
    """The local account a simulated host's sessions log in as (`add_host(login=True)`)."""
    return (LOGIN_PREFIX + "".join(c if c.isalnum() or c in "-_" else "-" for c in host).lower())[:32]


def ensure_login_user(name: str) -> pwd.struct_passwd | None:
    """A local account a simulated host's sessions log in as, other than ours (as on a lab
    where the hosts' accounts differ from the control machine's); created once if we are root.

    Unlike the foreign user it has a shell, bash (sshd runs commands with it; Debian's bash
    sources the host's .bashrc, which starts in the host's HOME) and an unlocked
    password field (`*`: no password can match, but sshd with `UsePAM no` refuses a
    locked `!` account even for a key). None when it cannot exist (not root, no useradd).
    Accounts are kept after the test session, like the foreign user: another session
    running beside this one may be logged in as the same name, and everything they own
    lies in a test bed's directory, which goes with it.
    """
    for attempt in range(10):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            entry = None
        if entry is not None:
            return entry
        if os.geteuid() != 0:
            return None
        try:
            gid = ensure_login_group()
            subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/",
                            "--shell", "/bin/bash", "--password", "*",
                            *(["--groups", LOGIN_GROUP] if gid is not None else []), name],
                           check=False, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        time.sleep(0.1 * attempt)  # another test session may hold the passwd lock
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


LOGIN_GROUP = "eltsim-logins"  # every login account is a member: what they may traverse is granted to it


def ensure_login_group() -> int | None:
    """The gid of LOGIN_GROUP, created once if we are root (None when it cannot exist)."""
    for attempt in range(10):
        try:
            return grp.getgrnam(LOGIN_GROUP).gr_gid
        except KeyError:
            pass
        if os.geteuid() != 0:
            return None
        try:
            subprocess.run(["groupadd", "--system", LOGIN_GROUP], check=False, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        time.sleep(0.1 * attempt)
    return None


_ACL_XATTR = "system.posix_acl_access"
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_ACL_UNDEFINED = 0xFFFFFFFF


def grant_group_traverse(path: str, gid: int) -> None:
    """Let group `gid` reach `path`: each directory above it that others cannot enter
    (`/root` 0700 holding the test interpreter, say) gets a POSIX ACL entry `group:gid:--x`.

    Narrower than `chmod o+x`: only the test bed's login accounts gain it. The entry is
    written through the ACL's extended attribute (no `setfacl` needed) and kept, as the
    accounts are; it is idempotent."""
    import struct

    real = os.path.realpath(path)
    parts = real.split("/")[1:-1]
    for i in range(len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        st = os.stat(d)
        if st.st_mode & 0o001:
            continue
        try:
            raw = os.getxattr(d, _ACL_XATTR)
        except OSError:
            raw = b""
        entries: dict[tuple[int, int], int] = {}
        if len(raw) >= 4:
            for off in range(4, len(raw), 8):
                tag, perm, ident = struct.unpack_from("<HHI", raw, off)
                entries[(tag, ident)] = perm
        else:
            mode = st.st_mode
            entries = {(_ACL_USER_OBJ, _ACL_UNDEFINED): (mode >> 6) & 7,
                       (_ACL_GROUP_OBJ, _ACL_UNDEFINED): (mode >> 3) & 7,
                       (_ACL_OTHER, _ACL_UNDEFINED): mode & 7}
        if entries.get((_ACL_GROUP, gid), 0) & 1:
            continue
        entries[(_ACL_GROUP, gid)] = entries.get((_ACL_GROUP, gid), 0) | 1
        group_class = [p for (t, _i), p in entries.items() if t in (_ACL_USER, _ACL_GROUP, _ACL_GROUP_OBJ)]
        entries[(_ACL_MASK, _ACL_UNDEFINED)] = 0
        for perm in group_class:
            entries[(_ACL_MASK, _ACL_UNDEFINED)] |= perm
        data = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, p, i) for (t, i), p in sorted(entries.items()))
        os.setxattr(d, _ACL_XATTR, data)


def chown_tree(root: str, uid: int, gid: int) -> None:
    """`chown -R uid:gid root` (links themselves, never what they point at)."""
    os.chown(root, uid, gid, follow_symlinks=False)
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(parent, name), uid, gid, follow_symlinks=False)


def start_as_user(argv: list[str], user: pwd.struct_passwd | None) -> subprocess.Popen:
    """Start `argv` in its own session, as `user` when given (we must be root)."""
    if user is not None and user.pw_uid != os.geteuid():
        argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *argv]
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin"}, start_new_session=True, cwd="/",
    )

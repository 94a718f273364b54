"""The job's store's addresses ("specs") and its listening sockets.

    unix:/abs/path/store.sock   eltctl's store on a Unix socket (the "ssh" mode)
    tcp:HOST:PORT               eltctl's store on TCP (the direct mode)
    HOST:PORT                   a c10d TCPStore (a job run without eltctl's keeper, the tests)

`parse_spec` is the one grammar every client uses; `bind_unix` makes the 0600 socket
in a 0700 directory of this account's own, `bind_tcp` the direct mode's listener;
`unix_connect` reaches a socket whose path is longer than sun_path holds. Standard
library only (the server: eltctl_runtime.store.server, which re-exports these names).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

SCHEME_UNIX = "unix:"
SCHEME_TCP = "tcp:"
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with its NUL
BACKLOG = 512  # pending connects a listening store socket queues


@dataclass(frozen=True)
class Spec:
    kind: str  # "unix", "tcp" (this server) or "c10d" (a TCPStore)
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"{SCHEME_UNIX}{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME_TCP if self.kind == 'tcp' else ''}{host}:{self.port}"


def parse_spec(spec: str) -> Spec:
    """A store address (the module's grammar); ValueError names what is wrong."""
    spec = spec.strip()
    if spec.startswith(SCHEME_UNIX):
        path = spec[len(SCHEME_UNIX):]
        if not path.startswith("/"):
            raise ValueError(f"store {spec!r}: a unix: address takes an absolute path")
        return Spec("unix", path=path)
    kind = "c10d"
    if spec.startswith(SCHEME_TCP):
        kind, spec = "tcp", spec[len(SCHEME_TCP):]
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"store {spec!r} is not unix:/path, tcp:host:port or host:port")
    return Spec(kind, host=host.strip("[]"), port=int(port))


def _short_unix_path(path: str) -> tuple[str, int | None]:
    """`path`, or, when longer than sun_path holds, the same file named through an
    O_PATH descriptor of its directory (/proc/self/fd/N/name; close N afterwards)."""
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        return path, None
    parent, name = os.path.split(path)
    fd = os.open(parent or ".", os.O_PATH | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/{name}", fd


def unix_connect(path: str, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    short, fd = _short_unix_path(path)
    try:
        sock.connect(short)
    except BaseException:
        sock.close()
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return sock


def bind_unix(path: str | Path, backlog: int | None = BACKLOG) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 from its creation (umask), in a
    directory that must be this account's own (made when missing, tightened to 0700). A
    stale socket file is replaced; any other file there is an error. `backlog` None:
    bound, not yet listening (a connect is refused until someone calls listen)."""
    path = str(path)
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, mode=0o700, exist_ok=True)
    st = os.stat(parent)
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(parent, 0o700)  # ours: tightened (an older eltctl made it 0755)
        st = os.stat(parent)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(errno.EPERM, f"the store's directory {parent} must be this account's own and "
                                           f"mode 0700 (it is {stat.S_IMODE(st.st_mode):o}, owner {st.st_uid})")
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    short, fd = _short_unix_path(path)
    old = os.umask(0o177)
    try:
        sock.bind(short)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
        if fd is not None:
            os.close(fd)
    if backlog is not None:
        sock.listen(backlog)
    return sock


def bind_tcp(address: str, port: int, backlog: int | None = BACKLOG) -> socket.socket:
    """A listening TCP socket on `address`:`port` (0: one the OS picks); `backlog` None:
    bound, not yet listening."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except BaseException:
        sock.close()
        raise
    if backlog is not None:
        sock.listen(backlog)
    return sock


__all__ = ["BACKLOG", "SCHEME_TCP", "SCHEME_UNIX", "UNIX_PATH_MAX", "Spec", "bind_tcp", "bind_unix", "parse_spec",
           "unix_connect"]

"""The job's store: a small key-value server with c10d's semantics, and its wire protocol.

Standard library only (the store keeper on the control side serves it; the client,
`eltctl_runtime.storeclient.SocketStore`, is a `torch.distributed.Store`).

Why not c10d's TCPStore: it listens on TCP, so every account of the machine (and of
a host, through an SSH port forward) can connect, read, write, and wedge it (one
byte on a raw connection stalls its non-libuv server for seconds); it has no size
limits. This server listens on a **Unix socket** in a 0700 directory (only the job's
own account can connect: the kernel checks it) and, for the warned
`[controller] store = "direct"` mode only, on TCP. Either way:

- each connection is served on its own: a client that sends part of a frame and
  goes silent is dropped after `Limits.frame_timeout_s`, and never delays another;
- values, keys, the number of keys, the bytes held and the connections are limited
  (`Limits`); a request over a limit is answered with an error that names the limit
  (the client raises `StoreRefused` with that text), and counted (`StoreServer.stats`).

Addresses ("specs"), one grammar for every client (`parse_spec`):

    unix:/abs/path/store.sock   this server on a Unix socket
    tcp:HOST:PORT               this server on TCP (the direct mode)
    HOST:PORT                   a c10d TCPStore (a job run without eltctl's keeper, the tests)

The protocol: every message is a frame, a 4-byte big-endian length then the body.
A request's body is one op byte then a list of byte strings; a response's is one
status byte then a list of byte strings (`encode`, `decode`). A connection's requests
are answered one at a time, in order: a client may send several before reading the
answers (pipelining: the control thread sends its heartbeat and its reads as one
write, runtime/control.py), and one that waits (GET, WAIT, MULTI_GET of a missing key)
holds the ones behind it. GET and WAIT carry their timeout (ms) and the server answers
TIMEOUT when it passes. PEEK reads several keys at once and never waits (each answer
is b"\\1" + the value, or b"\\0" for a missing key).

The server parses frames as they arrive (an asyncio Protocol per connection, no task
per request): a request costs it a few tens of microseconds (benchmarks/store_ops.py).
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("eltctl_runtime.sockstore")

SCHEME_UNIX = "unix:"
SCHEME_TCP = "tcp:"
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with its NUL
BACKLOG = 512  # pending connects a listening store socket queues
_LEN = struct.Struct(">I")


class Op(enum.IntEnum):
    SET = 1
    GET = 2  # blocks until the key exists or the timeout passes
    ADD = 3
    CHECK = 4
    WAIT = 5
    DELETE_KEY = 6
    COMPARE_SET = 7  # c10d: an empty expected sets an absent key; returns the current value
    NUM_KEYS = 8
    MULTI_GET = 9
    MULTI_SET = 10
    APPEND = 11
    LIST_KEYS = 12
    PING = 13
    PEEK = 14  # several keys' values, never waiting: b"\1" + value, or b"\0" when missing


_WAITING_OPS = (Op.GET, Op.WAIT, Op.MULTI_GET)
_OP_NAMES = {int(op): op.name for op in Op}
_READ_AHEAD = 1 << 20  # bytes buffered behind a waiting request before reading pauses


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1  # a malformed request
    TIMEOUT = 2
    REFUSED = 3  # over a limit


class StoreError(RuntimeError):
    """A store request failed."""


class StoreTimeout(StoreError):
    """GET or WAIT timed out (c10d raises on a timeout as well)."""


class StoreRefused(StoreError):
    """The server refused the request: it is over one of its limits (the text says which)."""


class StoreClosed(StoreError, ConnectionError):
    """The connection is gone (the keeper died, or dropped this client); a new client
    is needed, as with a TCPStore whose server went away."""


@dataclass(frozen=True)
class Limits:
    max_value: int = 4 << 20  # bytes of one value
    max_key: int = 4096  # bytes of one key
    max_keys: int = 200_000
    max_total: int = 1 << 30  # bytes of keys and values held
    max_connections: int = 4096
    max_frame: int = 16 << 20  # bytes of one request (a MULTI_SET carries several values)
    max_timeout_s: float = 3600.0  # a GET or WAIT waits at most this long
    frame_timeout_s: float = 10.0  # a frame begun must be complete within this


# --------------------------------------------------------------------------- addresses

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


def answers(path: str, timeout: float = 2.0) -> bool:
    """Whether a store server answers at the Unix socket `path` (a PING round trip)."""
    try:
        sock = unix_connect(path, timeout)
    except OSError:
        return False
    try:
        sock.sendall(encode(Op.PING))
        head = sock.recv(4)
        return len(head) == 4
    except OSError:
        return False
    finally:
        sock.close()


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


# --------------------------------------------------------------------------- frames

def encode(head: int, items: list[bytes] | tuple[bytes, ...] = ()) -> bytes:
    """A frame: length, then the op (or status) byte, the count and each item."""
    parts = [bytes((head,)), _LEN.pack(len(items))]
    for item in items:
        parts.append(_LEN.pack(len(item)))
        parts.append(item)
    body = b"".join(parts)
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> tuple[int, list[bytes]]:
    """A frame's body as (op or status, items); ValueError when malformed."""
    if len(body) < 5:
        raise ValueError("a frame of fewer than 5 bytes")
    (count,) = _LEN.unpack_from(body, 1)
    items, at = [], 5
    for _ in range(count):
        if at + 4 > len(body):
            raise ValueError("a frame cut short")
        (n,) = _LEN.unpack_from(body, at)
        at += 4
        if at + n > len(body):
            raise ValueError("a frame cut short")
        items.append(body[at:at + n])
        at += n
    if at != len(body):
        raise ValueError("trailing bytes after a frame's items")
    return body[0], items


def _int(b: bytes) -> int:
    return int(b.decode("ascii"))


# --------------------------------------------------------------------------- the server

class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Bad(Exception):
    pass


class _Connection(asyncio.Protocol):
    """One client connection. Frames are parsed as bytes arrive and answered in order;
    a request that waits for a key holds the ones behind it until it is answered (the
    client's pipelined requests stay in step). A frame begun must be complete within
    `Limits.frame_timeout_s` (else the connection is dropped, counted "slow_frame");
    between frames a connection may idle for ever. While a request waits the connection
    is still read (a client that leaves is seen at once and its wait abandoned), up to
    _READ_AHEAD bytes; while the client does not read its answers, nothing more is read."""

    def __init__(self, server: "StoreServer") -> None:
        self._srv = server
        self._t: asyncio.Transport | None = None
        self._buf = bytearray()
        self._discard = 0  # bytes of a refused oversized frame still to skip
        self._waiting: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._closed = False
        self._write_paused = False
        self._read_paused = False

    # -- asyncio's callbacks ------------------------------------------------------
    def connection_made(self, transport) -> None:
        self._t = transport
        srv, lim = self._srv, self._srv.limits
        with srv._lock:
            srv._stats["accepted"] += 1
            over = srv._connections >= lim.max_connections
            if not over:
                srv._connections += 1
                self._counted = True
        if over:
            message = f"the store refused a connection: it has {lim.max_connections} open (its limit)"
            srv._count_refusal("connections", message)
            transport.write(encode(Status.REFUSED, [message.encode()]))
            self._close()
            return
        srv._conns.add(self)

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if self._discard:
            n = min(self._discard, len(data))
            self._discard -= n
            data = data[n:]
            if self._discard:
                return
            self._disarm()
        self._buf += data
        self._process()

    def eof_received(self) -> None:
        if self._waiting is not None:  # the client left while it waited: its slot is freed now
            self._waiting.cancel()
        return None  # the transport closes (after what is left to write)

    def connection_lost(self, exc) -> None:
        self._closed = True
        self._disarm()
        if self._waiting is not None:
            self._waiting.cancel()
        srv = self._srv
        srv._conns.discard(self)
        if self._counted:
            self._counted = False
            with srv._lock:
                srv._connections -= 1

    def pause_writing(self) -> None:
        self._write_paused = True
        self._reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._reading()
        self._process()

    # -- frames ---------------------------------------------------------------------
    def _process(self) -> None:
        srv, lim, buf = self._srv, self._srv.limits, self._buf
        while not self._closed and self._waiting is None and not self._write_paused and len(buf) >= 4:
            (size,) = _LEN.unpack_from(buf)
            if size > lim.max_frame:
                message = (f"a request of {size} bytes is over the store's limit of {lim.max_frame} bytes "
                           f"per request ({lim.max_value} per value)")
                srv._count_refusal("frame_size", message)
                self._t.write(encode(Status.REFUSED, [message.encode()]))  # the client reads it after sending
                if len(buf) - 4 >= size:
                    del buf[:4 + size]
                    continue
                self._discard = size - (len(buf) - 4)
                buf.clear()
                self._disarm()
                self._arm()  # the rest must come within the frame timeout too
                return
            if len(buf) < 4 + size:
                break
            body = bytes(buf[4:4 + size])
            del buf[:4 + size]
            self._disarm()
            self._request(body)
        if self._closed:
            return
        if buf and self._waiting is None and not self._write_paused:
            self._arm()  # a frame begun
        self._reading()

    def _request(self, body: bytes) -> None:
        srv = self._srv
        with srv._lock:
            srv._stats["requests"] += 1
            srv._ops[body[0] if body else -1] += 1
        try:
            op, items = decode(body)
            if op in _WAITING_OPS and not srv._present(items[:-1]):
                self._waiting = asyncio.ensure_future(srv._handle_waiting(op, items))
                self._waiting.add_done_callback(self._answered)
                return
            self._answer(srv._handle(op, items), None)
        except Exception as exc:  # noqa: BLE001 - sorted out in _answer
            self._answer(None, exc)

    def _answered(self, task: asyncio.Task) -> None:
        self._waiting = None
        if task.cancelled() or self._closed:
            return
        exc = task.exception()
        self._answer(None if exc is not None else task.result(), exc)
        self._process()

    def _answer(self, out: list[bytes] | None, exc: BaseException | None) -> None:
        srv = self._srv
        status = Status.OK
        if isinstance(exc, _Refused):
            srv._count_refusal(exc.reason, str(exc))
            status, out = Status.REFUSED, [str(exc).encode()]
        elif isinstance(exc, StoreTimeout):
            status, out = Status.TIMEOUT, [str(exc).encode()]
        elif isinstance(exc, (_Bad, ValueError, UnicodeDecodeError, KeyError)):
            srv._count_refusal("malformed", f"a malformed request: {exc}")
            self._t.write(encode(Status.ERROR, [f"a malformed request: {exc}".encode()]))
            self._close()  # the stream may be out of step: drop it
            return
        elif exc is not None:  # a bug: this connection ends, the server goes on
            log.error("store: a connection ended on an unexpected error", exc_info=exc)
            self._close()
            return
        self._t.write(encode(status, out))

    # -- the frame timer, reading, closing ------------------------------------------
    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._srv.limits.frame_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_slow(self) -> None:
        self._timer = None
        self._srv._count_refusal("slow_frame", f"a connection did not finish a frame within "
                                               f"{self._srv.limits.frame_timeout_s:g} s and was dropped")
        self._close()

    def _reading(self) -> None:
        """Read unless the client does not read its answers, or too much waits behind a
        waiting request."""
        pause = self._write_paused or (self._waiting is not None and len(self._buf) >= _READ_AHEAD)
        if pause != self._read_paused and not self._closed:
            self._read_paused = pause
            (self._t.pause_reading if pause else self._t.resume_reading)()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._disarm()
            if self._waiting is not None:
                self._waiting.cancel()
            self._t.close()


class StoreServer:
    """The store's data and its listeners. `listen_unix` / `listen_tcp` bind at once (so
    a taken port or a bad directory raises in the caller), `start` serves them on an
    asyncio loop on a thread of its own, `stop` ends it. `set` writes a key from
    the serving process itself (the keeper's marks)."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self._data: dict[str, bytes] = {}
        self._total = 0
        self._waiters: dict[str, set[asyncio.Future]] = {}
        self._socks: list[socket.socket] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._conns: set[_Connection] = set()
        self._connections = 0
        self._lock = threading.Lock()  # stats read from other threads
        self._stats = Counter()
        self._ops = Counter()
        self._refused = Counter()
        self._last_refusal = ""
        self._last_refusal_at = 0.0
        self.unix_path: str | None = None
        self._inode: tuple[int, int] | None = None
        self.tcp_address: tuple[str, int] | None = None

    # -- listeners ---------------------------------------------------------------
    # listen_unix/listen_tcp bind the address; the sockets listen from start() on, so
    # nobody's connect succeeds before: the store keeper writes its run id in between
    # (eltctl/storekeeper.py), and a client that connected read the new one.
    def listen_unix(self, path: str | Path) -> str:
        self._socks.append(bind_unix(path, backlog=None))
        self.unix_path = str(path)
        st = os.stat(self.unix_path)
        self._inode = (st.st_dev, st.st_ino)
        return self.unix_path

    def listen_tcp(self, address: str, port: int = 0) -> int:
        sock = bind_tcp(address, port, backlog=None)
        self._socks.append(sock)
        self.tcp_address = (address, sock.getsockname()[1])
        return self.tcp_address[1]

    @property
    def specs(self) -> list[str]:
        out = []
        if self.unix_path:
            out.append(f"{SCHEME_UNIX}{self.unix_path}")
        if self.tcp_address:
            out.append(str(Spec("tcp", host=self.tcp_address[0], port=self.tcp_address[1])))
        return out

    # -- life --------------------------------------------------------------------
    def start(self) -> None:
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                for sock in self._socks:
                    if sock.family == socket.AF_UNIX:
                        coro = loop.create_unix_server(lambda: _Connection(self), sock=sock, backlog=BACKLOG)
                    else:
                        coro = loop.create_server(lambda: _Connection(self), sock=sock, backlog=BACKLOG)
                    self._servers.append(loop.run_until_complete(coro))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                failed.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            for server in self._servers:
                server.close()
            for conn in list(self._conns):
                conn._close()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(asyncio.sleep(0))  # the closed transports' last callbacks
            loop.close()

        self._thread = threading.Thread(target=run, name="eltctl-store", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def stop(self, timeout: float = 5.0) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if self.unix_path:  # unless another server bound the path since
            try:
                st = os.stat(self.unix_path)
                if (st.st_dev, st.st_ino) == self._inode:
                    os.unlink(self.unix_path)
            except OSError:
                pass

    def __enter__(self) -> "StoreServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def set(self, key: str, value: bytes | str) -> None:
        """Write a key from this process (thread-safe; before `start` too)."""
        value = value.encode() if isinstance(value, str) else value
        if self._loop is None or not self._loop.is_running():
            self._put(key.encode(), value)
            return
        asyncio.run_coroutine_threadsafe(self._set_async(key.encode(), value), self._loop).result(10)

    async def _set_async(self, key: bytes, value: bytes) -> None:
        self._put(key, value)

    def stats(self) -> dict:
        """What the server did: its connections, requests (`requests_by_op`: per op),
        and every refusal by reason (over a limit, a frame not finished in time, a
        malformed frame). Refusals from the job's own clients are bugs; many of them
        mean someone else is connecting."""
        with self._lock:
            return {"connections": self._connections, "accepted": self._stats["accepted"],
                    "requests": self._stats["requests"],
                    "requests_by_op": {_OP_NAMES.get(op, str(op)): n for op, n in self._ops.items()},
                    "keys": len(self._data), "bytes": self._total,
                    "refused": sum(self._refused.values()), "refused_by_reason": dict(self._refused),
                    "last_refusal": self._last_refusal, "last_refusal_at": self._last_refusal_at}

    def _count_refusal(self, reason: str, message: str) -> None:
        with self._lock:
            self._refused[reason] += 1
            self._last_refusal, self._last_refusal_at = message, time.time()

    def _present(self, keys: list[bytes]) -> bool:
        """Whether every key exists: a GET of them answers at once, no need to watch."""
        try:
            return all(k.decode() in self._data for k in keys)
        except UnicodeDecodeError:
            return True  # _handle refuses it

    # -- the ops -----------------------------------------------------------------
    def _check_key(self, key: bytes) -> bytes:
        if len(key) > self.limits.max_key:
            raise _Refused("key_size", f"a key of {len(key)} bytes is over the store's limit of "
                                       f"{self.limits.max_key} bytes per key")
        return key

    def _check_put(self, key: bytes, value: bytes) -> None:
        lim = self.limits
        self._check_key(key)
        if len(value) > lim.max_value:
            raise _Refused("value_size", f"a value of {len(value)} bytes is over the store's limit of "
                                         f"{lim.max_value} bytes per value (key {key[:80].decode(errors='replace')!r})")
        old = self._data.get(key.decode())
        if old is None and len(self._data) >= lim.max_keys:
            raise _Refused("keys", f"the store holds {len(self._data)} keys, its limit: a new key is refused")
        grow = len(value) - (len(old) if old is not None else -len(key))
        if self._total + grow > lim.max_total:
            raise _Refused("total", f"the store holds {self._total} bytes; {grow} more would pass its limit "
                                    f"of {lim.max_total} bytes")

    def _put(self, key: bytes, value: bytes) -> None:
        name = key.decode()
        old = self._data.get(name)
        self._total += len(value) - (len(old) if old is not None else -len(key))
        self._data[name] = value
        for fut in self._waiters.pop(name, ()):
            if not fut.done():
                fut.set_result(None)

    def _timeout(self, raw: bytes) -> float:
        return min(max(_int(raw) / 1000.0, 0.0), self.limits.max_timeout_s)

    async def _until(self, name: str, deadline: float) -> None:
        while name not in self._data:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"the key {name!r} did not appear in time")
            fut = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(name, set()).add(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                pass
            finally:
                waiting = self._waiters.get(name)
                if waiting is not None:
                    waiting.discard(fut)
                    if not waiting:
                        del self._waiters[name]

    async def _handle_waiting(self, op: int, items: list[bytes]) -> list[bytes]:
        """GET, WAIT or MULTI_GET of a key that is missing: waits for every key (or the
        request's timeout), then answers."""
        if op == Op.GET and len(items) != 2:
            raise _Bad("GET takes a key and a timeout")
        if not items:
            raise _Bad("no timeout")
        *keys, timeout = items
        deadline = time.monotonic() + self._timeout(timeout)
        for key in keys:
            await self._until(self._check_key(key).decode(), deadline)
        if op == Op.WAIT:
            return []
        return [self._data[k.decode()] for k in keys]

    def _handle(self, op: int, items: list[bytes]) -> list[bytes]:
        """A request answered now (GET, WAIT and MULTI_GET only when their keys exist)."""
        data = self._data
        if op == Op.SET:
            key, value = items
            self._check_put(key, value)
            self._put(key, value)
            return []
        if op == Op.PEEK:
            out = []
            for key in items:
                value = data.get(self._check_key(key).decode())
                out.append(b"\0" if value is None else b"\1" + value)
            return out
        if op == Op.GET:
            key, timeout = items
            self._timeout(timeout)
            return [data[self._check_key(key).decode()]]
        if op == Op.ADD:
            key, amount = items
            name = self._check_key(key).decode()
            value = str(_int(data.get(name, b"0")) + _int(amount)).encode()
            self._check_put(key, value)
            self._put(key, value)
            return [value]
        if op == Op.CHECK:
            return [b"1" if all(k.decode() in data for k in items) else b"0"]
        if op == Op.WAIT:
            *keys, timeout = items
            self._timeout(timeout)
            for key in keys:
                self._check_key(key)
            return []
        if op == Op.DELETE_KEY:
            (key,) = items
            old = data.pop(key.decode(), None)
            if old is not None:
                self._total -= len(key) + len(old)
            return [b"1" if old is not None else b"0"]
        if op == Op.COMPARE_SET:
            key, expected, desired = items
            current = data.get(self._check_key(key).decode())
            if (current is None and expected == b"") or (current is not None and current == expected):
                self._check_put(key, desired)
                self._put(key, desired)
                return [desired]
            return [current if current is not None else expected]
        if op == Op.NUM_KEYS:
            return [str(len(data)).encode()]
        if op == Op.MULTI_GET:
            *keys, timeout = items
            self._timeout(timeout)
            return [data[self._check_key(k).decode()] for k in keys]
        if op == Op.MULTI_SET:
            if len(items) % 2:
                raise _Bad("MULTI_SET takes pairs")
            pairs = list(zip(items[0::2], items[1::2]))
            for key, value in pairs:
                self._check_put(key, value)
            for key, value in pairs:
                self._put(key, value)
            return []
        if op == Op.APPEND:
            key, value = items
            new = data.get(self._check_key(key).decode(), b"") + value
            self._check_put(key, new)
            self._put(key, new)
            return []
        if op == Op.LIST_KEYS:
            return [k.encode() for k in data]
        if op == Op.PING:
            return []
        raise _Bad(f"unknown op {op}")


__all__ = ["Limits", "Op", "Spec", "Status", "StoreClosed", "StoreError", "StoreRefused", "StoreServer",
           "StoreTimeout", "answers", "bind_tcp", "bind_unix", "decode", "encode", "parse_spec", "unix_connect"]

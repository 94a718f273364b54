"""The job's store: a small key-value server with c10d's semantics, and its wire protocol.

Standard library only (the store keeper on the control side serves it; the client,
`eltctl_runtime.store.client.SocketStore`, is a `torch.distributed.Store`).

Why not c10d's TCPStore: it listens on TCP, so every account of the machine (and of
a host, through an SSH port forward) can connect, read, write, and wedge it (one
byte on a raw connection stalls its non-libuv server for seconds); it has no size
limits. This server listens on a **Unix socket** in a 0700 directory (only the job's
own account can connect: the kernel checks it) and, for the warned
`[controller] store = "direct"` mode only, on TCP. Either way:

- each connection is served on its own: a client that sends part of a frame and
  goes silent is dropped after `Limits.frame_timeout_s`, and never delays another;
- a connection that sends nothing is closed after `Limits.silent_timeout_s`, one idle
  between requests after `Limits.idle_timeout_s`; at the connection limit the longest
  idle one is closed to make room (a flood of idle connections never locks the job's
  clients out). Such a close is announced with a CLOSED frame that the server sends
  before it reads anything more, so the client knows its request was not read and
  sends it again on a new connection (store/client.py);
- values, keys, the number of keys, the bytes held, the size of an answer and the
  connections are limited (`Limits`); a request over a limit is answered with an error
  that names the limit (the client raises `StoreRefused` with that text), and counted
  (`StoreServer.stats`). A MULTI_SET is checked as a whole: all its pairs are stored,
  or none. The connection limit is kept below the process's open-file limit
  (`connection_cap`, `raise_nofile`: the keeper raises it to its hard limit), so the
  limit refuses a connection before `accept` could fail for want of descriptors;
- a counter (a key ADD wrote) stays an integer: a non-integer write to it is refused,
  and ADD on a value that is not an integer is refused cleanly (the connection stays).

Addresses ("specs": `unix:/path`, `tcp:HOST:PORT`, or a c10d TCPStore's `HOST:PORT`)
and the listening sockets: eltctl_runtime.store.address; the limits: .limits; the
protocol (frames, statuses): .wire; the operations' numbers and the store's own
operations (PING, PEEK, LIST_KEYS: what this server answers, in one place with how a
client asks): .ops.

The server parses frames as they arrive (an asyncio Protocol per connection, no task
per request): a request costs it a few tens of microseconds (benchmarks/store_ops.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections import Counter
from pathlib import Path

from .address import BACKLOG, SCHEME_TCP, SCHEME_UNIX, UNIX_PATH_MAX, Spec, bind_tcp, bind_unix, parse_spec, unix_connect
from .limits import ACCEPT_BURST, FD_RESERVE, Limits, connection_cap, raise_nofile
from .ops import BY_CODE as _OWN_OPS, Malformed as _Bad, Refused as _Refused
from .wire import _LEN, Op, Status, StoreClosed, StoreError, StoreRefused, StoreTimeout, decode, encode

log = logging.getLogger("eltctl_runtime.store.server")

_WAITING_OPS = (Op.GET, Op.WAIT, Op.MULTI_GET)
_OP_NAMES = {int(op): op.name for op in Op}
_READ_AHEAD = 1 << 20  # bytes buffered behind a waiting request before reading pauses
_BIG_ANSWER = 1 << 20  # an answer this big is checked against the unread answers' limit


# The wire (ops, statuses, frames, errors), the limits and the addresses:
# eltctl_runtime.store.wire, .limits and .address (re-exported here).


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


def _int(b: bytes) -> int:
    return int(b.decode("ascii"))


def _is_int(b: bytes) -> bool:
    """Whether ADD can count on `b` (what ADD itself writes: ASCII decimal digits)."""
    try:
        int(b.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True


def _counter_refusal(name: str, what: str, current: bytes = b"") -> str:
    if what == "ADD":
        return (f"the key {name[:80]!r} holds {current[:40]!r}, not an integer: ADD refused (a counter is "
                "written by ADD only)")
    return f"the key {name[:80]!r} is a counter (written by ADD): {what} is refused there"


# --------------------------------------------------------------------------- the server

class _Connection(asyncio.Protocol):
    """One client connection. Frames are parsed as bytes arrive and answered in order;
    a request that waits for a key holds the ones behind it until it is answered (the
    client's pipelined requests stay in step). A frame begun must be complete within
    `Limits.frame_timeout_s` (else the connection is dropped, counted "slow_frame");
    a connection that never sends a byte is closed after `Limits.silent_timeout_s`,
    one idle between requests after `Limits.idle_timeout_s` (`StoreServer._sweep`;
    counted as "silent_closed" and "idle_closed", not as refusals). While a request waits the connection
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
        self._last = time.monotonic()  # when it was last seen busy (by the sweep: once a pass)
        self._busy = False  # a request since the sweep's last pass
        self._spoke = False  # a byte received

    # -- asyncio's callbacks ------------------------------------------------------
    def connection_made(self, transport) -> None:
        self._t = transport
        srv, lim = self._srv, self._srv.limits
        with srv._lock:
            srv._stats["accepted"] += 1
            over = srv._connections >= lim.max_connections
        if over and srv._evict():  # the longest idle (a silent one first) makes room
            over = False
        with srv._lock:
            if not over:
                srv._connections += 1
                self._counted = True
        if over:
            message = f"the store refused a connection: it has {lim.max_connections} open (its limit)"
            srv._count_refusal("connections", message)
            transport.write(encode(Status.REFUSED, [message.encode()]))
            self._close()
            return
        srv._conns[self] = None
        srv._silent[self] = None

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if not self._spoke:
            self._spoke = True
            self._srv._silent.pop(self, None)
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
        self._release()

    def _release(self) -> None:
        """Out of the server's books: its slot is free for the next connection."""
        srv = self._srv
        srv._conns.pop(self, None)
        srv._silent.pop(self, None)
        srv._backlogged.pop(self, None)
        if self._counted:
            self._counted = False
            with srv._lock:
                srv._connections -= 1

    def pause_writing(self) -> None:
        self._write_paused = True
        self._srv._backlogged[self] = None
        self._reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._srv._backlogged.pop(self, None)
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
        self._busy = True
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
        self._busy = True
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
        elif out and (len(out) > 1 or len(out[0]) >= _BIG_ANSWER):
            size = sum(map(len, out)) + 4 * len(out)
            if size > srv.limits.max_response:
                message = srv._response_refusal(size)
                srv._count_refusal("response_size", message)
                status, out = Status.REFUSED, [message.encode()]
            elif size >= _BIG_ANSWER and srv._unread() + size > srv.limits.max_unread:
                message = (f"the store holds {srv._unread()} bytes of answers its clients have not read; an answer "
                           f"of {size} more would pass its limit of {srv.limits.max_unread}: try again later")
                srv._count_refusal("unread", message)
                status, out = Status.REFUSED, [message.encode()]
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

    @property
    def idle(self) -> bool:
        """Between requests: nothing waits, no frame begun (a client that does not read
        its answers counts as idle: it asks for nothing the server could go on with)."""
        return self._waiting is None and not self._buf and not self._discard

    def goodbye(self, message: str) -> None:
        """Close an idle connection, saying so first: the client sends again, on a new
        connection, whatever it sent after this (nothing more is read here)."""
        if not self._closed:
            self._t.write(encode(Status.CLOSED, [message.encode(), self._srv.instance]))
            self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._disarm()
            if self._waiting is not None:
                self._waiting.cancel()
            if self._t.get_write_buffer_size():
                self._t.abort()  # a client that does not read would hold the descriptor for ever
            else:
                self._t.close()
            self._release()  # the descriptor goes in this loop pass: the slot is free now


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
        self._conns: dict[_Connection, None] = {}  # open connections, oldest first
        self._silent: dict[_Connection, None] = {}  # those that have not sent a byte yet, oldest first
        self._backlogged: dict[_Connection, None] = {}  # those whose clients do not read their answers
        self._counters: set[str] = set()  # keys ADD wrote: they stay integers
        # this server's identity (PING answers it; so does a CLOSED frame): a client that
        # was closed as idle sends again only to the same server, not to a keeper's successor
        self.instance = os.urandom(8).hex().encode()
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
                    # asyncio's backlog is also how many it accepts in one pass: kept small
                    # (FD_RESERVE), and the kernel's queue set to BACKLOG afterwards
                    if sock.family == socket.AF_UNIX:
                        coro = loop.create_unix_server(lambda: _Connection(self), sock=sock, backlog=ACCEPT_BURST)
                    else:
                        coro = loop.create_server(lambda: _Connection(self), sock=sock, backlog=ACCEPT_BURST)
                    self._servers.append(loop.run_until_complete(coro))
                    sock.listen(BACKLOG)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                failed.append(exc)
                ready.set()
                return
            ready.set()
            loop.call_later(self._sweep_every(), self._sweep)
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

    # -- idle connections ----------------------------------------------------------
    def _sweep_every(self) -> float:
        lim = self.limits
        return max(0.05, min(1.0, lim.silent_timeout_s / 4, lim.idle_timeout_s / 4))

    def _sweep(self) -> None:
        """Close the connections that never spoke within the silent timeout, and those
        idle past the idle timeout (a few thousand at most: one pass a second)."""
        now, lim = time.monotonic(), self.limits
        for conn in self._conns:  # the idle clock, at the sweep's resolution: no clock read per request
            if conn._busy or not conn.idle:
                conn._busy, conn._last = False, now
        for conn in list(self._silent):
            if now - conn._last < lim.silent_timeout_s:
                break  # oldest first: the rest are younger
            with self._lock:  # not a refusal: a client may connect and think (torch clones stores)
                self._stats["silent_closed"] += 1
            conn.goodbye(f"the store closed a connection that sent nothing within {lim.silent_timeout_s:g} s")
        for conn in list(self._conns):
            if conn.idle and now - conn._last >= lim.idle_timeout_s:
                with self._lock:
                    self._stats["idle_closed"] += 1
                conn.goodbye(f"the store closed a connection idle for {lim.idle_timeout_s:g} s")
        self._loop.call_later(self._sweep_every(), self._sweep)

    def _evict(self) -> bool:
        """At the connection limit: close the connection that has sent nothing for the
        longest, else the one idle the longest (at least `Limits.evict_idle_s`), to make room for
        a new one. Counted ("evicted"): at the limit, someone holds many connections."""
        victim = next(iter(self._silent), None)
        if victim is None:
            now, idlest = time.monotonic(), None
            for conn in self._conns:
                if (not conn._busy and conn.idle and now - conn._last >= self.limits.evict_idle_s
                        and (idlest is None or conn._last < idlest._last)):
                    idlest = conn
            victim = idlest
        if victim is None:
            return False
        message = (f"the store closed a connection idle for {time.monotonic() - victim._last:.1f} s: it has "
                   f"{self.limits.max_connections} open (its limit)")
        self._count_refusal("evicted", message)
        victim.goodbye(message)
        return True

    def _unread(self) -> int:
        """Bytes of answers buffered for clients that do not read them (a connection
        that reads keeps less than asyncio's high-water mark, 64 KiB, buffered)."""
        return sum(conn._t.get_write_buffer_size() for conn in self._backlogged)

    def _response_refusal(self, size: int) -> str:
        return (f"an answer of {size} bytes is over the store's limit of {self.limits.max_response} bytes per "
                "answer: ask for fewer keys at once")

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
                    "requests": self._stats["requests"], "idle_closed": self._stats["idle_closed"],
                    "silent_closed": self._stats["silent_closed"],
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

    def _check_item(self, key: bytes, value: bytes) -> str:
        """One key and value against the per-item limits; the key's name."""
        self._check_key(key)
        if len(value) > self.limits.max_value:
            raise _Refused("value_size", f"a value of {len(value)} bytes is over the store's limit of "
                                         f"{self.limits.max_value} bytes per value (key {key[:80].decode(errors='replace')!r})")
        name = key.decode()
        if name in self._counters and not _is_int(value):
            raise _Refused("counter", _counter_refusal(name, "a value that is not an integer"))
        return name

    def _check_put(self, key: bytes, value: bytes, name: str | None = None) -> None:
        """One key and value against every limit (`name`: the key's, its value known to
        be an integer: ADD's own)."""
        lim = self.limits
        if name is None:  # _check_item, inline: SET is the hot path
            if len(key) > lim.max_key:
                self._check_key(key)
            if len(value) > lim.max_value:
                self._check_item(key, value)
            name = key.decode()
            if name in self._counters and not _is_int(value):
                raise _Refused("counter", _counter_refusal(name, "a value that is not an integer"))
        old = self._data.get(name)
        if old is None and len(self._data) >= lim.max_keys:
            raise _Refused("keys", f"the store holds {len(self._data)} keys, its limit: a new key is refused")
        grow = len(value) - (len(old) if old is not None else -len(key))
        if self._total + grow > lim.max_total:
            raise _Refused("total", f"the store holds {self._total} bytes; {grow} more would pass its limit "
                                    f"of {lim.max_total} bytes")

    def _check_puts(self, pairs: list[tuple[bytes, bytes]]) -> None:
        """A MULTI_SET's pairs against the limits as a whole (a key named twice: its last
        value), as if each were stored: the keys and bytes they add together must fit."""
        lim, data = self.limits, self._data
        final = {self._check_item(key, value): (key, value) for key, value in pairs}
        new = sum(1 for name in final if name not in data)
        if new and len(data) + new > lim.max_keys:
            raise _Refused("keys", f"the store holds {len(data)} keys; a MULTI_SET of {new} new keys would pass "
                                   f"its limit of {lim.max_keys}: refused as a whole")
        grow = 0
        for name, (key, value) in final.items():
            old = data.get(name)
            grow += len(value) - (len(old) if old is not None else -len(key))
        if self._total + grow > lim.max_total:
            raise _Refused("total", f"the store holds {self._total} bytes; a MULTI_SET of {grow} more would pass "
                                    f"its limit of {lim.max_total} bytes: refused as a whole")

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
        """A request answered now (GET, WAIT and MULTI_GET only when their keys exist):
        c10d's operations here, the store's own in store/ops.py."""
        data = self._data
        if op == Op.SET:
            key, value = items
            self._check_put(key, value)
            self._put(key, value)
            return []
        own = _OWN_OPS.get(op)  # the store's own operations (store/ops.py)
        if own is not None:
            return own.serve(self, items)
        if op == Op.GET:
            key, timeout = items
            self._timeout(timeout)
            return [data[self._check_key(key).decode()]]
        if op == Op.ADD:
            key, amount = items
            name = self._check_key(key).decode()
            step = _int(amount)
            current = data.get(name, b"0")
            try:
                value = str(int(current) + step).encode()
            except ValueError:
                raise _Refused("counter", _counter_refusal(name, "ADD", current)) from None
            self._check_put(key, value, name)
            self._put(key, value)
            self._counters.add(name)
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
            self._counters.discard(key.decode())
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
            if len(pairs) == 1:
                self._check_put(*pairs[0])
            else:
                self._check_puts(pairs)
            for key, value in pairs:
                self._put(key, value)
            return []
        if op == Op.APPEND:
            key, value = items
            new = data.get(self._check_key(key).decode(), b"") + value
            self._check_put(key, new)
            self._put(key, new)
            return []
        raise _Bad(f"unknown op {op}")


__all__ = ["ACCEPT_BURST", "BACKLOG", "FD_RESERVE", "SCHEME_TCP", "SCHEME_UNIX", "UNIX_PATH_MAX", "Limits", "Op",
           "Spec", "Status", "StoreClosed", "StoreError", "StoreRefused", "StoreServer", "StoreTimeout", "answers",
           "bind_tcp", "bind_unix", "connection_cap", "decode", "encode", "parse_spec", "raise_nofile",
           "unix_connect"]

"""The store's client, and `connect`: the one way every process reaches the job's store.

`SocketStore` is a `torch.distributed.Store` speaking eltctl_runtime.store.server's
protocol (over a Unix socket, or TCP in the direct mode), so it serves everywhere a
c10d store does: `PrefixStore`, gloo's and NCCL's rendezvous, the signed job store.
Keep a Python reference to it while C++ uses it (a temporary handed straight to
PrefixStore is collected, and the next call fails with "Not implemented").

One socket per client, one request at a time under a lock; `clone()` opens a new
connection. A GET or WAIT waits at most the store's timeout (then raises
`StoreTimeout`, as TCPStore raises DistStoreError). A lost connection raises
`StoreClosed` on every later call: the callers make a new client (runtime/store/loss.py,
the daemon's link, the controller's keeper supervision), as with a TCPStore.

torch is imported on first use, not at import (the controller imports this module
and its CLI commands must not load torch): `SocketStore` and `KeptPrefixStore` are
built then (PEP 562's module `__getattr__`). The controller and the host daemons,
which never form a process group, use `connect(..., plain=True)`: a `PlainSocketStore`
(the same requests, `_Wire`, no torch) under a `PlainPrefixStore`, so neither pays
torch's import (seconds of CPU, far more on a loaded host) before its first read.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Callable

from .ops import PEEK, as_bytes as _b, bind_client, bind_prefix, peeked as _peeked
from .server import Op, Status, StoreClosed, StoreError, StoreRefused, StoreTimeout, _LEN, decode, encode, parse_spec, unix_connect

DEFAULT_TIMEOUT_S = 300.0
_MARGIN_S = 10.0  # a blocking GET's socket waits this much past the server's own timeout
_CONNECT_RETRY_S = 0.1


def _open(spec: str, timeout: float) -> socket.socket:
    """A connected socket; retried (the keeper may be starting, or busy) until `timeout`."""
    where = parse_spec(spec)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if where.kind == "unix":
                return unix_connect(where.path, max(timeout, 1.0))
            sock = socket.create_connection((where.host, where.port), timeout=max(timeout, 1.0))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except (FileNotFoundError, ConnectionRefusedError, BlockingIOError) as exc:
            # BlockingIOError: a Unix socket's backlog is full (a flood of connections
            # the server is still accepting and refusing): it drains
            if time.monotonic() + _CONNECT_RETRY_S >= deadline:
                raise StoreClosed(f"the store at {spec} does not answer: {exc}") from exc
            time.sleep(_CONNECT_RETRY_S)
        except OSError as exc:
            raise StoreClosed(f"cannot connect to the store at {spec}: {exc}") from exc


# A request that waits (GET, WAIT, MULTI_GET of a missing key) holds the connection's lock
# while the store waits, so it goes out in slices of at most this long: another thread's
# request on the same client waits at most a slice for the lock. (A process group's
# construction abandoned on an abort goes on waiting for its peers' addresses for the
# backend's 300 s; with one long WAIT the roll call behind it could not write a word.)
_WAIT_SLICE_S = 0.5


def sliced_wait(store, keys: list[str], timeout: timedelta | None) -> None:
    """`store.wait(keys, timeout)` (`timeout` None: the store's) as waits of at most
    _WAIT_SLICE_S: a client that serializes its requests (c10d's TCPStore holds its lock
    through a wait) is free for another thread's between them. A wait that fails well
    before its slice ends (not a timeout: the connection lost) raises at once."""
    if timeout is None:
        timeout = getattr(store, "timeout", None)  # the store's own (c10d's stores carry one)
    total = timeout.total_seconds() if isinstance(timeout, timedelta) else 300.0
    deadline = time.monotonic() + total
    while True:
        left = deadline - time.monotonic()
        slice_s = min(_WAIT_SLICE_S, max(left, 0.001))
        t0 = time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=slice_s))
            return
        except Exception:  # noqa: BLE001 - c10d's timeout is a DistStoreError, a SocketStore's a StoreTimeout
            if left <= _WAIT_SLICE_S or time.monotonic() - t0 < slice_s / 2:
                raise


class _Wire:
    """The client's protocol: every request, over `self._sock` under `self._lock`, with
    `self._seconds()` the store timeout. No torch: `SocketStore` (a dist.Store, built on
    first use) and `PlainSocketStore` (for the processes that only read and write keys:
    the controller, the host daemons) both take these methods."""

    def _call(self, op: Op, items: list[bytes], wait_s: float | None = None) -> list[bytes]:
        return self._raise(self._exchange([encode(op, items)], wait_s)[0], wait_s)

    def _waiting(self, frames: Callable[[bytes], list[bytes]], wait_s: float) -> list[tuple[int, list[bytes]]]:
        """Answers to `frames(timeout_ms)`, whose first request waits: sent again in slices
        of at most _WAIT_SLICE_S until it is answered or `wait_s` has passed."""
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            slice_s = min(_WAIT_SLICE_S, max(left, 0.0))
            answers = self._exchange(frames(str(int(slice_s * 1000)).encode()), slice_s)
            if answers[0][0] != Status.TIMEOUT or left <= _WAIT_SLICE_S:
                return answers

    def pipeline(self, requests: list[tuple[Op, list[bytes]]]) -> list[list[bytes]]:
        """Several requests sent at once (one write) and their answers read (one round
        trip); none may wait (GET or WAIT of a missing key would hold the others). The
        first one that failed raises, after every answer was read (the connection stays
        in step)."""
        answers = self._exchange([encode(op, items) for op, items in requests], None)
        return [self._raise(a, None) for a in answers]

    def _exchange(self, frames: list[bytes], wait_s: float | None) -> list[tuple[int, list[bytes]]]:
        """Send `frames`, read one answer each: [(status, items)]. When the server had
        closed the connection as idle (its CLOSED frame comes first: it read none of
        them), they are sent once more on a new connection to the same store."""
        with self._lock:
            answers = self._exchange_once(frames, wait_s)
            if answers[0][0] == Status.CLOSED:
                said = answers[0][1]
                self._sock = _open(self.spec, min(max(self._seconds(), 1.0), 30.0))
                if len(said) > 1:  # only to the same server: a new keeper is a lost store to the callers
                    pong = self._exchange_once([encode(Op.PING)], None)[0]
                    if pong[0] != Status.OK or pong[1][:1] != said[1:2]:
                        self._drop()
                        raise StoreClosed(f"the store at {self.spec} was replaced since it closed this idle "
                                          "connection")
                answers = self._exchange_once(frames, wait_s)
                if answers[0][0] == Status.CLOSED:
                    self._drop()
                    raise StoreClosed(f"the store at {self.spec} closed a new connection at once: "
                                      f"{answers[0][1][0].decode(errors='replace') if answers[0][1] else ''}")
        return answers

    def _exchange_once(self, frames: list[bytes], wait_s: float | None) -> list[tuple[int, list[bytes]]]:
        """One try of `_exchange` (the lock held): the answers, or [CLOSED] alone."""
        sock = self._sock
        if sock is None:
            raise StoreClosed(f"the connection to the store at {self.spec} was lost")
        answers: list[tuple[int, list[bytes]]] = []
        buf = b""
        try:
            sock.settimeout((wait_s + _MARGIN_S) if wait_s is not None else max(self._seconds(), 1.0))
            try:
                sock.sendall(frames[0] if len(frames) == 1 else b"".join(frames))
            except OSError:
                sock.settimeout(1.0)  # the server may have said why before it closed: read that
            while len(answers) < len(frames):
                if len(buf) >= 4:
                    (size,) = _LEN.unpack_from(buf)
                    if len(buf) >= 4 + size:
                        answers.append(decode(buf[4:4 + size]))
                        buf = buf[4 + size:]
                        if answers[-1][0] == Status.CLOSED:  # nothing after it was read
                            break
                        continue
                    chunk = sock.recv(max(4 + size - len(buf), 1 << 16))
                else:
                    chunk = sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionResetError("the store closed the connection")
                buf = buf + chunk if buf else chunk
        except (OSError, ValueError) as exc:
            closed = self._said_closed(sock, answers, buf)
            self._drop()
            if closed:
                return [(Status.CLOSED, [])]
            refused = [a for a in answers if a[0] != Status.OK]
            if refused:  # it said why before it closed (e.g. over its connections)
                self._raise(refused[0], wait_s)
            raise StoreClosed(f"the connection to the store at {self.spec} was lost: {exc}") from exc
        if answers[-1][0] == Status.CLOSED:
            self._drop()
            if len(answers) > 1:  # the first ones were served: not sent again (not all can be repeated)
                raise StoreClosed(f"the store at {self.spec} closed the connection as idle after answering "
                                  f"{len(answers) - 1} requests of a pipelined batch")
        return answers

    @staticmethod
    def _said_closed(sock: socket.socket, answers: list, buf: bytes) -> bool:
        """Whether the server's first word on a connection that failed (a send into a
        closed socket) was CLOSED: read what it left, without waiting."""
        if answers:
            return False
        try:
            sock.settimeout(0.0)
            while len(buf) < 9:
                chunk = sock.recv(64)
                if not chunk:
                    break
                buf += chunk
        except OSError:
            pass
        return len(buf) >= 5 and buf[4] == Status.CLOSED

    def _raise(self, answer: tuple[int, list[bytes]], wait_s: float | None) -> list[bytes]:
        status, out = answer
        if status == Status.OK:
            return out
        message = out[0].decode(errors="replace") if out else "no reason given"
        if status == Status.TIMEOUT:
            raise StoreTimeout(f"store {self.spec}: timed out after {wait_s or 0:g} s: {message}")
        if status == Status.REFUSED:
            raise StoreRefused(f"store {self.spec} refused the request: {message}")
        raise StoreError(f"store {self.spec}: {message}")

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    # -- c10d's Store ------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._call(Op.SET, [_b(key), _b(value)])

    def get(self, key: str) -> bytes:
        wait = self._seconds()
        return self._raise(self._waiting(lambda ms: [encode(Op.GET, [_b(key), ms])], wait)[0], wait)[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(Op.ADD, [_b(key), str(int(amount)).encode()])[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(Op.CHECK, [_b(k) for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait = self._seconds(timeout)
        raw = [_b(k) for k in keys]
        self._raise(self._waiting(lambda ms: [encode(Op.WAIT, [*raw, ms])], wait)[0], wait)

    def delete_key(self, key: str) -> bool:
        return self._call(Op.DELETE_KEY, [_b(key)])[0] == b"1"

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call(Op.COMPARE_SET, [_b(key), _b(expected), _b(desired)])[0]

    def num_keys(self) -> int:
        return int(self._call(Op.NUM_KEYS, [])[0])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        wait = self._seconds()
        raw = [_b(k) for k in keys]
        return self._raise(self._waiting(lambda ms: [encode(Op.MULTI_GET, [*raw, ms])], wait)[0], wait)

    def multi_set(self, keys: list[str], values: list) -> None:
        if len(keys) != len(values):
            raise ValueError("multi_set: as many values as keys")
        items: list[bytes] = []
        for k, v in zip(keys, values):
            items += [_b(k), _b(v)]
        self._call(Op.MULTI_SET, items)

    def append(self, key: str, value) -> None:
        self._call(Op.APPEND, [_b(key), _b(value)])

    # -- beyond c10d: the store's own operations (store/ops.py: bound below, as
    # `ping`, `peek_many`, `list_keys`, ...), and polls in one round trip built of them --
    def set_and_peek(self, sets: list[tuple[str, bytes]], keys: list[str]) -> list[bytes | None]:
        """Write `sets` and read `keys` (as peek_many) in one round trip (pipelined)."""
        items: list[bytes] = []
        for k, v in sets:
            items += [_b(k), _b(v)]
        reqs = ([(Op.MULTI_SET, items)] if items else []) + [(PEEK.code, PEEK.request(keys))]
        return _peeked(self.pipeline(reqs)[-1])

    def wait_and_peek(self, keys: list[str], timeout: timedelta | None = None) -> list[bytes | None]:
        """WAIT for `keys` (`timeout`: the store's when None), then their values as
        peek_many: one round trip (the server answers a connection's requests in order,
        so the PEEK sent behind the WAIT is answered once the keys are there)."""
        wait = self._seconds(timeout)
        raw = [_b(k) for k in keys]
        answers = self._waiting(lambda ms: [encode(Op.WAIT, [*raw, ms]), encode(PEEK.code, raw)], wait)
        self._raise(answers[0], wait)
        return _peeked(self._raise(answers[1], wait))

    def has_extended_api(self) -> bool:
        return True

    def clone(self):
        return type(self)(self.spec, self.timeout)


bind_client(_Wire)  # the store's own operations: one method each (store/ops.py)


class PlainSocketStore(_Wire):
    """A client of the job's store without torch (`connect(..., plain=True)`): the same
    requests as `SocketStore`, for a process that never forms a process group (the
    controller, the host daemons), so it does not pay torch's import (seconds of CPU,
    far more on a loaded host) before its first read."""

    def __init__(self, spec: str, timeout: float | timedelta = DEFAULT_TIMEOUT_S) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        self.spec = spec
        self._lock = threading.Lock()
        self._sock: socket.socket | None = _open(spec, seconds)
        self.timeout = timedelta(seconds=seconds)

    def __repr__(self) -> str:
        return f"PlainSocketStore({self.spec!r})"

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def _seconds(self, timeout: timedelta | float | None = None) -> float:
        if timeout is None:
            timeout = self.timeout
        return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)



class PlainPrefixStore:
    """`base`'s keys under `prefix/` (as c10d's PrefixStore joins them), without torch:
    `prefix_store` over a PlainSocketStore."""

    def __init__(self, prefix: str, base) -> None:
        self.prefix = prefix
        self.base = base

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value) -> None:
        self.base.set(self._full(key), value)

    def get(self, key: str) -> bytes:
        return self.base.get(self._full(key))

    def add(self, key: str, amount: int) -> int:
        return self.base.add(self._full(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self.base.check([self._full(k) for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.base.wait([self._full(k) for k in keys], timeout)

    def delete_key(self, key: str) -> bool:
        return self.base.delete_key(self._full(key))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.base.compare_set(self._full(key), expected, desired)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.base.multi_get([self._full(k) for k in keys])

    def multi_set(self, keys: list[str], values: list) -> None:
        self.base.multi_set([self._full(k) for k in keys], values)

    def append(self, key: str, value) -> None:
        self.base.append(self._full(key), value)

    def num_keys(self) -> int:
        return self.base.num_keys()

    def set_and_peek(self, sets: list[tuple[str, bytes]], keys: list[str]) -> list[bytes | None]:
        return self.base.set_and_peek([(self._full(k), v) for k, v in sets], [self._full(k) for k in keys])

    def has_extended_api(self) -> bool:
        return True


bind_prefix(PlainPrefixStore)  # the store's own operations on keys, under the prefix (store/ops.py)


_BUILT: dict = {}


def _build() -> dict:
    """The classes that subclass torch's (torch imported here, once)."""
    if _BUILT:
        return _BUILT
    import torch.distributed as dist

    class SocketStore(dist.Store):
        def __init__(self, spec: str, timeout: float | timedelta = DEFAULT_TIMEOUT_S) -> None:
            super().__init__()
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            self.spec = spec
            self._lock = threading.Lock()
            self._sock: socket.socket | None = _open(spec, seconds)
            self.set_timeout(timedelta(seconds=seconds))

        def __repr__(self) -> str:
            return f"SocketStore({self.spec!r})"

        # -- the wire ----------------------------------------------------------------
        def _seconds(self, timeout: timedelta | float | None = None) -> float:
            if timeout is None:
                timeout = self.timeout
            return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)

        def clone(self) -> "SocketStore":
            return SocketStore(self.spec, self.timeout)

    # The wire methods (_Wire) go into the class's own namespace, not a mixin base: the
    # dist.Store subclass is laid out as a hand-written one for torch's C++ dispatch.
    for name, fn in vars(_Wire).items():
        if not name.startswith("__") and name not in vars(SocketStore):
            setattr(SocketStore, name, fn)

    class KeptPrefixStore(dist.PrefixStore):
        """A PrefixStore that holds a Python reference to its base store: C++ alone does
        not keep a Python-defined store (SocketStore) alive."""

        def __init__(self, prefix: str, base: dist.Store) -> None:
            super().__init__(prefix, base)
            self.base = base
            self.prefix = prefix

        def _full(self, key: str) -> str:
            return f"{self.prefix}/{key}"  # c10d's PrefixStore joins so

        def set_and_peek(self, sets: list[tuple[str, bytes]], keys: list[str]) -> list[bytes | None]:
            """`sets` written, then `keys` read as peek_many: one round trip on a SocketStore."""
            fn = getattr(self.base, "set_and_peek", None)
            if fn is not None:
                return fn([(self._full(k), v) for k, v in sets], [self._full(k) for k in keys])
            for k, v in sets:
                self.set(k, v)
            return self.peek_many(keys)

        def wait_and_peek(self, keys: list[str], timeout: timedelta | None = None) -> list[bytes | None]:
            """WAIT for `keys`, then peek_many them: one round trip on a SocketStore."""
            fn = getattr(self.base, "wait_and_peek", None)
            if fn is not None:
                return fn([self._full(k) for k in keys], timeout)
            sliced_wait(self, keys, timeout)
            return self.peek_many(keys)


    # The store's own operations on keys (store/ops.py: peek_many, ...): one request on a
    # SocketStore, their fallback from c10d's operations on another store (c10d's).
    bind_prefix(KeptPrefixStore)
    _BUILT.update(SocketStore=SocketStore, KeptPrefixStore=KeptPrefixStore)
    return _BUILT


def __getattr__(name: str):
    if name in ("SocketStore", "KeptPrefixStore"):
        return _build()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prefix_store(prefix: str, base):
    """`base` under `prefix` (a torch PrefixStore; over a PlainSocketStore a
    PlainPrefixStore), `base` kept alive with it: build every PrefixStore over a
    connected client with this."""
    if isinstance(base, PlainSocketStore):
        return PlainPrefixStore(prefix, base)
    return _build()["KeptPrefixStore"](prefix, base)


def connect(spec: str, timeout: float, plain: bool = False):
    """A client of the job's store at `spec` (eltctl_runtime.store.server's grammar):
    `unix:/path` and `tcp:host:port` are the keeper's store (`SocketStore`; with
    `plain`, a `PlainSocketStore`, no torch: for a process that forms no process group);
    a bare `host:port` is a c10d TCPStore (a job run without eltctl's keeper). Raises
    when nothing answers within `timeout`."""
    where = parse_spec(spec)
    if where.kind in ("unix", "tcp"):
        return PlainSocketStore(spec, timeout) if plain else _build()["SocketStore"](spec, timeout)
    import torch.distributed as dist

    return dist.TCPStore(where.host, where.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout))


__all__ = ["KeptPrefixStore", "PlainPrefixStore", "PlainSocketStore", "SocketStore", "StoreClosed", "StoreError",
           "StoreRefused", "StoreTimeout", "connect", "prefix_store", "sliced_wait"]

"""The store's client, and `connect`: the one way every process reaches the job's store.

`SocketStore` is a `torch.distributed.Store` speaking eltctl_runtime.sockstore's
protocol (over a Unix socket, or TCP in the direct mode), so it serves everywhere a
c10d store does: `PrefixStore`, gloo's and NCCL's rendezvous, the signed job store.
Keep a Python reference to it while C++ uses it (a temporary handed straight to
PrefixStore is collected, and the next call fails with "Not implemented").

One socket per client, one request at a time under a lock; `clone()` opens a new
connection. A GET or WAIT waits at most the store's timeout (then raises
`StoreTimeout`, as TCPStore raises DistStoreError). A lost connection raises
`StoreClosed` on every later call: the callers make a new client (runtime/storeloss.py,
the daemon's link, the controller's keeper supervision), as with a TCPStore.

torch is imported on first use, not at import (the controller imports this module
and its CLI commands must not load torch): `SocketStore` and `KeptPrefixStore` are
built then (PEP 562's module `__getattr__`).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

from eltctl_runtime.sockstore import (Op, Status, StoreClosed, StoreError, StoreRefused, StoreTimeout, _LEN, decode,
                                      encode, parse_spec, unix_connect)

DEFAULT_TIMEOUT_S = 300.0
_MARGIN_S = 10.0  # a blocking GET's socket waits this much past the server's own timeout
_CONNECT_RETRY_S = 0.1


def _b(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _open(spec: str, timeout: float) -> socket.socket:
    """A connected socket; retried (the keeper may be starting) until `timeout`."""
    where = parse_spec(spec)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if where.kind == "unix":
                return unix_connect(where.path, max(timeout, 1.0))
            sock = socket.create_connection((where.host, where.port), timeout=max(timeout, 1.0))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if time.monotonic() + _CONNECT_RETRY_S >= deadline:
                raise StoreClosed(f"the store at {spec} does not answer: {exc}") from exc
            time.sleep(_CONNECT_RETRY_S)
        except OSError as exc:
            raise StoreClosed(f"cannot connect to the store at {spec}: {exc}") from exc


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

        def _call(self, op: Op, items: list[bytes], wait_s: float | None = None) -> list[bytes]:
            with self._lock:
                sock = self._sock
                if sock is None:
                    raise StoreClosed(f"the connection to the store at {self.spec} was lost")
                try:
                    sock.settimeout((wait_s + _MARGIN_S) if wait_s is not None else max(self._seconds(), 1.0))
                    try:
                        sock.sendall(encode(op, items))
                    except OSError:
                        sock.settimeout(1.0)  # the server may have said why before it closed: read that
                    (size,) = _LEN.unpack(self._recv(sock, 4))
                    status, out = decode(self._recv(sock, size))
                except (OSError, ValueError) as exc:
                    self._drop()
                    raise StoreClosed(f"the connection to the store at {self.spec} was lost: {exc}") from exc
            if status == Status.OK:
                return out
            message = out[0].decode(errors="replace") if out else "no reason given"
            if status == Status.TIMEOUT:
                raise StoreTimeout(f"store {self.spec}: timed out after {wait_s:g} s: {message}")
            if status == Status.REFUSED:
                raise StoreRefused(f"store {self.spec} refused the request: {message}")
            raise StoreError(f"store {self.spec}: {message}")

        def _recv(self, sock: socket.socket, n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                chunk = sock.recv(min(n - len(buf), 1 << 20))
                if not chunk:
                    raise ConnectionResetError("the store closed the connection")
                buf += chunk
            return bytes(buf)

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
            return self._call(Op.GET, [_b(key), str(int(wait * 1000)).encode()], wait)[0]

        def add(self, key: str, amount: int) -> int:
            return int(self._call(Op.ADD, [_b(key), str(int(amount)).encode()])[0])

        def check(self, keys: list[str]) -> bool:
            return self._call(Op.CHECK, [_b(k) for k in keys])[0] == b"1"

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            wait = self._seconds(timeout)
            self._call(Op.WAIT, [*(_b(k) for k in keys), str(int(wait * 1000)).encode()], wait)

        def delete_key(self, key: str) -> bool:
            return self._call(Op.DELETE_KEY, [_b(key)])[0] == b"1"

        def compare_set(self, key: str, expected, desired) -> bytes:
            return self._call(Op.COMPARE_SET, [_b(key), _b(expected), _b(desired)])[0]

        def num_keys(self) -> int:
            return int(self._call(Op.NUM_KEYS, [])[0])

        def multi_get(self, keys: list[str]) -> list[bytes]:
            wait = self._seconds()
            return self._call(Op.MULTI_GET, [*(_b(k) for k in keys), str(int(wait * 1000)).encode()], wait)

        def multi_set(self, keys: list[str], values: list) -> None:
            if len(keys) != len(values):
                raise ValueError("multi_set: as many values as keys")
            items: list[bytes] = []
            for k, v in zip(keys, values):
                items += [_b(k), _b(v)]
            self._call(Op.MULTI_SET, items)

        def append(self, key: str, value) -> None:
            self._call(Op.APPEND, [_b(key), _b(value)])

        def list_keys(self) -> list[str]:
            return [k.decode() for k in self._call(Op.LIST_KEYS, [])]

        def ping(self) -> None:
            self._call(Op.PING, [])

        def has_extended_api(self) -> bool:
            return True

        def clone(self) -> "SocketStore":
            return SocketStore(self.spec, self.timeout)


    class KeptPrefixStore(dist.PrefixStore):
        """A PrefixStore that holds a Python reference to its base store: C++ alone does
        not keep a Python-defined store (SocketStore) alive."""

        def __init__(self, prefix: str, base: dist.Store) -> None:
            super().__init__(prefix, base)
            self.base = base


    _BUILT.update(SocketStore=SocketStore, KeptPrefixStore=KeptPrefixStore)
    return _BUILT


def __getattr__(name: str):
    if name in ("SocketStore", "KeptPrefixStore"):
        return _build()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prefix_store(prefix: str, base):
    """`base` under `prefix` (a torch PrefixStore), `base` kept alive with it: build
    every PrefixStore over a connected client with this."""
    return _build()["KeptPrefixStore"](prefix, base)


def connect(spec: str, timeout: float):
    """A client of the job's store at `spec` (eltctl_runtime.sockstore's grammar):
    `unix:/path` and `tcp:host:port` are the keeper's store (`SocketStore`); a bare
    `host:port` is a c10d TCPStore (a job run without eltctl's keeper). Raises when
    nothing answers within `timeout`."""
    where = parse_spec(spec)
    if where.kind in ("unix", "tcp"):
        return _build()["SocketStore"](spec, timeout)
    import torch.distributed as dist

    return dist.TCPStore(where.host, where.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout))


__all__ = ["KeptPrefixStore", "SocketStore", "StoreClosed", "StoreError", "StoreRefused", "StoreTimeout", "connect",
           "prefix_store"]

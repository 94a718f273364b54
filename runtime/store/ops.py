"""The store's operations: c10d's, and the store's own, each of these declared once.

c10d's operations (SET .. PING's predecessors in `Op`) are a fixed set: their client
methods are c10d's `Store` API (torch's C++ PrefixStore and the backends' rendezvous
call them), so they are served in store/server.py's `_handle` and asked in
store/client.py's `_Wire`. The store's own operations, which c10d does not have, are
each one `StoreOp` in `OWN` below: its number on the wire, what the server answers,
how a client asks it and reads the answer, which of its arguments are keys (a prefix
store puts its prefix on them) and, where it can be, what it is on a store without
it (c10d's TCPStore, for a job run without eltctl's keeper). The server dispatches
to it, and every client (the plain client, the torch `SocketStore`, both prefix
stores) gets its method from this table: **a new operation is one `StoreOp` here.**

What an own operation may be: it answers at once (a request that waits for keys is
c10d's GET, WAIT or MULTI_GET: the server watches those), it stays within the server's
`Limits` (`serve` runs on the server's loop with the server's own checks:
`_check_key`, `_check_put`, `_put`, `limits.max_response`), and an operation whose
values the job signs is verified by store/auth.py's `SignedStore` as PEEK's are.
Standard library only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .auth import ABSENT


class Refused(Exception):
    """A request over one of the server's limits (`reason`: the limit's name); the
    server answers REFUSED with the text and counts it."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Malformed(Exception):
    """A request the protocol does not allow; the server answers ERROR and drops the
    connection (its stream may be out of step)."""


def as_bytes(value: Any) -> bytes:
    """A key or value as the wire carries it."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


@dataclass(frozen=True)
class StoreOp:
    """One of the store's own operations (the module docstring)."""

    code: int  # its byte on the wire: after c10d's (`Op` lists every number)
    name: str  # its name in `Op` and in the server's stats
    method: str  # the clients' method: `store.<method>(*args)`
    serve: Callable[[Any, list[bytes]], list[bytes]]  # (the StoreServer, request items) -> answer items
    request: Callable[..., list[bytes]]  # the method's arguments -> request items
    answer: Callable[[list[bytes]], Any]  # answer items -> the method's result
    # The method's arguments with every key passed through `under` (a prefix store's
    # prefix); None: it reads or writes no key of its own (PING), or the whole store
    # (LIST_KEYS): a prefix store does not offer it.
    keys: Callable[[Callable[[str], str], tuple], tuple] | None = None
    # On a store that lacks the operation (c10d's): (store, *args) -> the result, from
    # c10d's operations; None: the operation needs eltctl's store.
    fallback: Callable[..., Any] | None = None


# -- PING: whether the store answers, and which server it is ----------------------------

def _serve_ping(srv: Any, items: list[bytes]) -> list[bytes]:
    return [srv.instance]  # a keeper restarted on the same address is another instance


PING = StoreOp(13, "PING", "ping", _serve_ping, request=lambda: [], answer=lambda out: None)


# -- PEEK: several keys' values at once, never waiting ----------------------------------

def _serve_peek(srv: Any, items: list[bytes]) -> list[bytes]:
    """Each key's value as b"\\1" + value, or b"\\0" when it is missing."""
    data = srv._data
    out, size, most = [], 0, srv.limits.max_response
    for key in items:
        value = data.get(srv._check_key(key).decode())
        if value is None:
            out.append(b"\0")
            continue
        size += len(value)
        if size > most:  # refused before more copies are made than the answer may hold
            raise Refused("response_size", srv._response_refusal(
                sum(len(v) + 1 for v in (data.get(k.decode()) for k in items) if v is not None)))
        out.append(b"\1" + value)
    return out


def peeked(items: list[bytes]) -> list[bytes | None]:
    """PEEK's answer: each value, or None for a missing key."""
    return [item[1:] if item[:1] == b"\1" else None for item in items]


def peek_one(store: Any, key: str) -> bytes | None:
    """PEEK of one key from c10d's operations: compare_set with an expected value no
    one writes answers the value there, or that expected value when there is none
    (never waits, creates nothing)."""
    cur = store.compare_set(key, ABSENT, ABSENT)
    return None if cur == ABSENT.encode() else cur


PEEK = StoreOp(14, "PEEK", "peek_many", _serve_peek,
               request=lambda keys: [as_bytes(k) for k in keys], answer=peeked,
               keys=lambda under, args: ([under(k) for k in args[0]],),
               fallback=lambda store, keys: [peek_one(store, k) for k in keys])


# -- LIST_KEYS: every key the store holds -----------------------------------------------

def _serve_list_keys(srv: Any, items: list[bytes]) -> list[bytes]:
    data = srv._data
    size = sum(map(len, data)) + 4 * len(data)  # characters: at most the bytes
    if size > srv.limits.max_response:
        raise Refused("response_size", srv._response_refusal(size))
    return [k.encode() for k in data]


LIST_KEYS = StoreOp(12, "LIST_KEYS", "list_keys", _serve_list_keys,
                    request=lambda: [], answer=lambda out: [k.decode() for k in out])


OWN: tuple[StoreOp, ...] = (LIST_KEYS, PING, PEEK)
BY_CODE: dict[int, StoreOp] = {op.code: op for op in OWN}

# c10d's operations, by their numbers on the wire.
C10D = {"SET": 1, "GET": 2, "ADD": 3, "CHECK": 4, "WAIT": 5, "DELETE_KEY": 6, "COMPARE_SET": 7, "NUM_KEYS": 8,
        "MULTI_GET": 9, "MULTI_SET": 10, "APPEND": 11}

# Every operation's number: GET (and WAIT, MULTI_GET) block until the keys exist or the
# request's timeout passes; COMPARE_SET is c10d's (an empty expected sets an absent key;
# it answers the current value); PEEK never waits (b"\1" + value, or b"\0" when missing).
Op = enum.IntEnum("Op", {**C10D, **{op.name: op.code for op in sorted(OWN, key=lambda o: o.code)}},
                 module=__name__)


def check_table(own: Sequence[StoreOp] = OWN) -> None:
    """The table's own rules: numbers and names unique, none of c10d's taken."""
    codes = [op.code for op in own] + list(C10D.values())
    names = [op.name for op in own] + list(C10D)
    if len(set(codes)) != len(codes) or len(set(names)) != len(names):
        raise ValueError("the store's operations need unique numbers and names (store/ops.py)")
    if any(not 0 < c < 256 for c in codes):
        raise ValueError("an operation's number is one byte (1..255)")


check_table()


def bind_client(cls: type) -> None:
    """Give a client class (store/client.py's `_Wire`) a method per own operation: it
    sends the request (`self._call(code, items)`) and reads the answer."""

    def method_of(op: StoreOp) -> Callable[..., Any]:
        def method(self, *args: Any) -> Any:
            return op.answer(self._call(op.code, op.request(*args)))

        method.__name__ = op.method
        method.__doc__ = f"The store's {op.name} (store/ops.py)."
        return method

    for op in OWN:
        if op.method not in vars(cls):
            setattr(cls, op.method, method_of(op))


def bind_prefix(cls: type) -> None:
    """Give a prefix store class (`prefix`, `base`, `_full(key)`) a method per own
    operation that names keys: its keys under the prefix, asked of the base store; on a
    base without it (c10d's), the operation's fallback on this prefix store."""

    def method_of(op: StoreOp) -> Callable[..., Any]:
        def method(self, *args: Any) -> Any:
            fn = getattr(self.base, op.method, None)
            if fn is not None:
                return fn(*op.keys(self._full, args))
            if op.fallback is None:
                raise NotImplementedError(f"{op.method} needs eltctl's store; {self.base!r} has no {op.name}")
            return op.fallback(self, *args)

        method.__name__ = op.method
        method.__doc__ = f"The store's {op.name} under this prefix (store/ops.py)."
        return method

    for op in OWN:
        if op.keys is not None and op.method not in vars(cls):
            setattr(cls, op.method, method_of(op))


__all__ = ["BY_CODE", "C10D", "LIST_KEYS", "OWN", "Op", "PEEK", "PING", "Malformed", "Refused", "StoreOp",
           "as_bytes", "bind_client", "bind_prefix", "check_table", "peek_one", "peeked"]

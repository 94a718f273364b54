"""The job's store's wire protocol: statuses, frames and the client's errors (the ops: .ops).

The protocol: every message is a frame, a 4-byte big-endian length then the body.
A request's body is one op byte then a list of byte strings; a response's is one
status byte then a list of byte strings (`encode`, `decode`). A connection's requests
are answered one at a time, in order: a client may send several before reading the
answers (pipelining: the control thread sends its heartbeat and its reads as one
write, runtime/control.py), and one that waits (GET, WAIT, MULTI_GET of a missing key)
holds the ones behind it. GET and WAIT carry their timeout (ms) and the server answers
TIMEOUT when it passes. PEEK reads several keys at once and never waits (each answer
is b"\\1" + the value, or b"\\0" for a missing key).

A server that closes an idle connection says so first (CLOSED) and reads nothing
after it: the client sends what it had sent again, on a new connection. Standard
library only (the server: eltctl_runtime.store.server, which re-exports these names;
the client: eltctl_runtime.store.client; the operations themselves: .ops).
"""

from __future__ import annotations

import enum
import struct

from .ops import Op  # every operation's number (store/ops.py: c10d's and the store's own)

_LEN = struct.Struct(">I")


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1  # a malformed request
    TIMEOUT = 2
    REFUSED = 3  # over a limit
    CLOSED = 4  # the server closes this connection (idle) and read none of what followed: send it again


class StoreError(RuntimeError):
    """A store request failed."""


class StoreTimeout(StoreError):
    """GET or WAIT timed out (c10d raises on a timeout as well)."""


class StoreRefused(StoreError):
    """The server refused the request: it is over one of its limits (the text says which)."""


class StoreClosed(StoreError, ConnectionError):
    """The connection is gone (the keeper died, or dropped this client); a new client
    is needed, as with a TCPStore whose server went away."""


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


__all__ = ["Op", "Status", "StoreClosed", "StoreError", "StoreRefused", "StoreTimeout", "decode", "encode"]

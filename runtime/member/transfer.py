"""How a generation's members move bytes and state to each other over their group.

Every member-to-member move of the runtime goes through here: which member holds
the newest state (`gather_holdings`, then `membership.choose_source` through
`choose`), a small JSON value or a byte string from one rank to all
(`broadcast_json`, `broadcast_bytes`: a length header, then the bytes), and a
packed state (`state.pack`'s header and flat bytes) from its source to the ranks
that lack it (`send_packed`). ElasticJob moves the training state with these,
restart mode's supervisor the script directory's snapshots and its scripts'
store, a sharded restore the chunks nobody could read. The bytes <-> tensor
conversions (`as_tensor`, `tensor_bytes`) are here too: tensors are how bytes
travel over a process group.
"""

from __future__ import annotations

import ctypes
import json
import threading
from typing import Any, Sequence

import torch

from . import collectives
from .plan import Transfer, choose_source

_CPU = torch.device("cpu")


def as_tensor(data: bytes) -> torch.Tensor:
    """`data` as a uint8 CPU tensor (a copy: the tensor owns its memory)."""
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor, through torch alone.

    Hosts have Python and torch only: `Tensor.numpy()` raises there ("Numpy is not
    available"), and `bytes(t.untyped_storage())` walks the storage byte by byte
    (about 2 s per MB here). So the bytes are read from the tensor's own memory,
    which a contiguous CPU tensor keeps alive for the duration of the copy.
    """
    t = t.detach().to("cpu").contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return b""
    return bytes((ctypes.c_ubyte * n).from_address(t.data_ptr()))


# ---- who holds the newest state ---------------------------------------------------


def gather_holdings(pg, has: bool, step: int, extra: Sequence[int], abort: threading.Event | None,
                    device: torch.device = _CPU) -> list[tuple[int, ...]]:
    """Every rank's (holds the state, its step, *extra) in rank order: one all-gather
    of small integers (the opening of every state agreement)."""
    report = torch.tensor([int(has), int(step), *(int(x) for x in extra)], dtype=torch.int64, device=device)
    return [tuple(int(x) for x in t.cpu().tolist()) for t in collectives.allgather(pg, report, abort)]


def choose(rows: Sequence[Sequence[int]]) -> tuple[list[tuple[bool, int]], Transfer]:
    """The (holds, step) reports of `gather_holdings`' rows and the transfer they
    call for (membership.choose_source: the same on every rank)."""
    reports = [(bool(r[0]), int(r[1])) for r in rows]
    return reports, choose_source(reports)


# ---- one rank to all ---------------------------------------------------------------


def broadcast_bytes(pg, data: bytes | None, src: int, rank: int, abort: threading.Event | None,
                    meta: Sequence[int] = (), device: torch.device = _CPU) -> tuple[bytes, list[int]]:
    """`data` (and the integers `meta`, as long as on every rank) from rank `src` to
    every rank: a header of its length and `meta`, then the bytes (skipped when empty
    or alone in the group). Returns (the bytes, meta) on every rank."""
    header = torch.zeros(1 + len(meta), dtype=torch.int64)
    if rank == src:
        header = torch.tensor([len(data or b""), *(int(x) for x in meta)], dtype=torch.int64)
    header = collectives.broadcast(pg, header.to(device), src, abort).cpu()
    n, got = int(header[0]), [int(x) for x in header[1:].tolist()]
    if not n or pg.size() == 1:
        return (data or b"") if rank == src else b"", got
    buf = as_tensor(data) if rank == src else torch.empty(n, dtype=torch.uint8)
    buf = collectives.broadcast(pg, buf.to(device), src, abort)
    return (data or b"") if rank == src else tensor_bytes(buf), got


def broadcast_json(pg, obj: Any, src: int, rank: int, abort: threading.Event | None,
                   device: torch.device = _CPU) -> Any:
    """A small JSON value from rank `src` to every rank."""
    data = json.dumps(obj).encode() if rank == src else None
    raw, _ = broadcast_bytes(pg, data, src, rank, abort, device=device)
    return json.loads(raw)  # the source's too: every rank holds its own copy


# ---- a packed state to the ranks that lack it --------------------------------------


def send_packed(pg, packed: tuple[bytes, torch.Tensor] | None, src: int, rank: int, need: Sequence[int],
                abort: threading.Event | None, device: torch.device = _CPU) -> tuple[bytes, torch.Tensor] | None:
    """A packed state (state.pack's header and flat uint8 tensor; `packed` on the
    source) from rank `src` to the ranks of `need` (the others hold it already, or took
    it from a checkpoint themselves). Returns (header, flat) on the ranks of `need`,
    None elsewhere."""
    if not need:
        return None
    world = pg.size()
    if rank == src:
        header, flat = packed
        sizes = torch.tensor([len(header), flat.numel()], dtype=torch.int64)
        hbuf = as_tensor(header)
    # Only some ranks lack the state (a join, a rank that missed a commit, a restore's
    # ranks that cannot read the checkpoint): on gloo the source sends it to them alone.
    # A broadcast would have every member receive it, the members that hold it already
    # included (at world 4 on 2 cores, a join's 600 MB to three ranks: 4-7 s against
    # 1.6-2.7 s at world 2). NCCL keeps the broadcast (its pair streams would be formed
    # here, in the pause); the members skip the unpack either way.
    p2p = device.type == "cpu" and len(need) < world - 1
    if p2p and rank != src and rank not in need:
        return None

    def move(t: torch.Tensor, tag: int) -> torch.Tensor:
        """`t` from the source to the receivers (the source's own comes back)."""
        if not p2p:
            return collectives.broadcast(pg, t.to(device), src, abort).cpu()
        works = ([collectives.send(pg, t, r, tag) for r in need] if rank == src
                 else [collectives.recv(pg, t, src, tag)])
        collectives.wait_p2p(works, abort, "the state's transfer")
        return t

    sizes = move(sizes if rank == src else torch.zeros(2, dtype=torch.int64), 0)
    if rank != src:
        hbuf = torch.empty(int(sizes[0]), dtype=torch.uint8)
        flat = torch.empty(int(sizes[1]), dtype=torch.uint8)
    hbuf, flat = move(hbuf, 1), move(flat, 2)
    if rank not in need:  # a member at the source's step holds its state already
        return None
    return tensor_bytes(hbuf), flat

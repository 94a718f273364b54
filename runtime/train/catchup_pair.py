"""The catch-up pair's transfer (catchup.py): the source sends a joiner the packed state
over a 2-rank gloo group of their own, in chunks that give way to the job's own
reduction: before each chunk the sender waits while the Link says the job's all-reduce
is on the wire (the replicated path marks it from a step's first launch until finish
waited for every one; local steps, a round's averaging). A chunk already in flight when
an all-reduce starts delays it by at most its own time on the link (CHUNK_BYTES / rate,
plus what the socket buffers hold); the state then moves in the gaps (the forward and
backward of every step), instead of halving the all-reduce's bandwidth for its whole
length as one 600 MB send did."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from ..member import collectives, transfer
from ..member.collectives import Aborted
from ..store.auth import SignedStore
from ..store.pgstore import PgStore, PlainPgStore

log = logging.getLogger("eltctl_runtime")

# The state goes in chunks of CHUNK_BYTES, each sent only while the job's own reduction is
# off the wire (Link): a chunk already in flight when an all-reduce starts delays it by at
# most its own time on the link (8 MiB: 67 ms at 1 Gbit/s, plus what the socket buffers hold).
CHUNK_BYTES = 8 << 20


def chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """The [start, end) byte ranges a transfer of `n` bytes goes in: the sender's and the
    receiver's, from the same sizes. Pure."""
    return [(a, min(n, a + chunk)) for a in range(0, n, max(1, chunk))]


class Link:
    """Whether the job's own reduction is on the wire (the source's side): the replicated
    path marks it busy at a step's first all-reduce launch and free once finish waited for
    every one (ReplicatedPath, through CatchUp.tail_summed); local steps, the round's
    averaging. The catch-up sender waits for it to be free before each chunk."""

    def __init__(self) -> None:
        self._free = threading.Event()
        self._free.set()

    def busy(self) -> None:
        self._free.clear()

    def free(self) -> None:
        self._free.set()

    def is_busy(self) -> bool:
        return not self._free.is_set()

    def wait_free(self, stop: threading.Event) -> float:
        """Wait until it is free (or `stop`): the seconds waited."""
        t0 = time.perf_counter()
        while not self._free.wait(0.05) and not stop.is_set():
            pass
        return time.perf_counter() - t0


class Transfer:
    """One background transfer between the source (pair rank 0) and a joiner (pair rank
    1): its group, its thread, and what it carries (the source: the newest packed state
    to send; the joiner: the newest one received)."""

    def __init__(self, store: Any, bind_host: str, prefix: str, sending: bool, who: str, generation: int = 0,
                 plan_json: str = "", link: Link | None = None, chunk: int = CHUNK_BYTES) -> None:
        self._stop = threading.Event()
        self._link, self._chunk = link, chunk  # the sender: each chunk waits for a free link
        self.chunks = 0  # chunks sent or received (tests)
        self._cond = threading.Condition()
        self._next: tuple[int, bytes, torch.Tensor] | None = None  # the source's next message
        self.got: tuple[int, bytes, torch.Tensor] | None = None  # the joiner's newest message
        self.failed: str | None = None
        self._store = PgStore(store, prefix) if isinstance(store, SignedStore) else PlainPgStore(store, prefix)
        self._bind = bind_host
        self._signed = store
        self._generation = generation
        self._gid = collectives.group_id(prefix + plan_json)  # another group's handshake does not verify here
        self._pg = None
        self._who = who
        self._thread = threading.Thread(target=self._run, args=(sending,), name="eltctl-catch-up", daemon=True)
        self._thread.start()

    def offer(self, version: int, packed: tuple[bytes, torch.Tensor]) -> None:
        """The source: send this state (of the round starting at step `version`) next,
        in place of one not yet sent."""
        with self._cond:
            self._next = (version, *packed)
            self._cond.notify_all()

    def wait_for(self, version: int, abort: threading.Event | None) -> bool:
        """The joiner: wait until the state of `version` arrived (True) or the transfer
        broke or was dropped (False)."""
        with self._cond:
            while not (self.got is not None and self.got[0] >= version) and self.failed is None \
                    and not self._stop.is_set() and not (abort is not None and abort.is_set()):
                self._cond.wait(0.05)
            return self.got is not None and self.got[0] == version

    def close(self) -> None:
        """Drop it (a generation change, or done): the thread leaves its waits; the group
        is buried (a send or receive may still be posted on it)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        collectives.bury(self._pg, self._store)
        self._pg = None

    def _run(self, sending: bool) -> None:
        try:
            pg = collectives.run_abortable(lambda: collectives.make_group(
                self._store, 0 if sending else 1, 2, torch.device("cpu"), self._bind), self._stop, "catch-up group")
            if self._stop.is_set():
                collectives.bury(pg, self._store)
                return
            self._pg = pg
            # Every pair signed before a byte of state moves (as the generation's group: collectives.py).
            collectives.verify_pairs(pg, self._signed, self._generation, self._gid, 0 if sending else 1, 2,
                                     torch.device("cpu"), self._stop, listen=self._bind)
            (self._send if sending else self._receive)(pg)
        except Aborted as e:
            if not self._stop.is_set():
                self.failed = str(e)
                log.warning("catch-up transfer %s broke: %s", self._who, e)
        finally:
            with self._cond:
                self._cond.notify_all()

    def _send(self, pg) -> None:
        while True:
            with self._cond:
                while self._next is None and not self._stop.is_set():
                    self._cond.wait(0.5)
                if self._stop.is_set():
                    return
                version, header, flat = self._next
                self._next = None
            sizes = torch.tensor([version, len(header), flat.numel(), self._chunk], dtype=torch.int64)
            collectives.wait_p2p([collectives.send(pg, sizes, 1, 0),
                                  collectives.send(pg, transfer.as_tensor(header), 1, 1)],
                                 self._stop, "the catch-up transfer")
            t0, held = time.perf_counter(), 0.0
            bounds = chunk_bounds(flat.numel(), self._chunk)
            for a, b in bounds:
                if self._link is not None:
                    held += self._link.wait_free(self._stop)  # the job's all-reduce goes first
                if self._stop.is_set():
                    return
                collectives.wait_p2p([collectives.send(pg, flat[a:b], 1, 2)], self._stop, "the catch-up transfer")
                self.chunks += 1
            log.info("catch-up: sent the state of step %d to %s (%.1f MB in %d chunks, %.2f s; %.2f s of it held "
                     "back for the job's reduction)", version, self._who, flat.numel() / 1e6, len(bounds),
                     time.perf_counter() - t0, held)

    def _receive(self, pg) -> None:
        while True:
            sizes = torch.zeros(4, dtype=torch.int64)
            collectives.wait_p2p([collectives.recv(pg, sizes, 0, 0)], self._stop, "the catch-up transfer")
            hbuf = torch.empty(int(sizes[1]), dtype=torch.uint8)
            flat = torch.empty(int(sizes[2]), dtype=torch.uint8)
            collectives.wait_p2p([collectives.recv(pg, hbuf, 0, 1)], self._stop, "the catch-up transfer")
            for a, b in chunk_bounds(flat.numel(), int(sizes[3])):  # the sender's chunks, in its order
                collectives.wait_p2p([collectives.recv(pg, flat[a:b], 0, 2)], self._stop, "the catch-up transfer")
                self.chunks += 1
            with self._cond:
                self.got = (int(sizes[0]), transfer.tensor_bytes(hbuf), flat)
                self._cond.notify_all()
            log.info("catch-up: %s received the state of step %d (%.1f MB)", self._who, int(sizes[0]),
                     flat.numel() / 1e6)

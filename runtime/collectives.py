"""One process group per generation, and collectives that an abort can interrupt.

Raw ProcessGroupGloo / ProcessGroupNCCL objects are built on the generation's
fresh store prefix (re-using keys hangs, pytorch#55967) instead of
init_process_group, and an aborted group is never destroyed on the training
thread: a gloo group's destructor blocks until its stuck collective times out
(58 s measured with a 60 s timeout, even after abort()). A daemon thread keeps
the reference instead, so neither training nor interpreter exit waits for it.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from .netif import BIND_ADDRESS_ENV, local_address_towards

T = TypeVar("T")

# Collectives are waited on by the runtime, which aborts them itself; the
# backend's own timeout only bounds how long a forgotten group lingers.
BACKEND_TIMEOUT = timedelta(seconds=300)


class Aborted(Exception):
    """The current generation was aborted (peer died, hung, or reported an error).
    `backend_error` is True when this rank's own collective failed (e.g. a ring
    neighbour's connection was reset): positive evidence that a peer is gone."""

    def __init__(self, message: str, backend_error: bool = False) -> None:
        super().__init__(message)
        self.backend_error = backend_error


def bind_address(store_host: str, store_port: int) -> str:
    """Where this worker's gloo/NCCL listen: $ELTCTL_BIND_ADDRESS when set (the daemon
    sets it from its SSH connection when the store is reached through an SSH forward
    on 127.0.0.1, which says nothing about the network), else the local address
    towards the store (`local_address_towards`)."""
    chosen = os.environ.get(BIND_ADDRESS_ENV, "").strip()
    return chosen or local_address_towards(store_host, store_port)


def make_group(store, rank: int, size: int, device: torch.device, bind_host: str):
    if device.type == "cuda":
        # Never tear the process down from the watchdog: the runtime aborts
        # the communicator itself and moves to the next generation.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        # As torchft does (torchft/process_group.py): non-blocking communicators,
        # so abort() can interrupt init and collectives; eager connect, so a
        # joiner's NCCL init happens while the group forms, not in step one.
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = BACKEND_TIMEOUT
        opts.config.blocking = False
        opts.global_ranks_in_group = list(range(size))
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        pg._set_sequence_number_for_group()
        pg.eager_connect_single_device(device)
        return pg
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = BACKEND_TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def bury(pg, *keep) -> None:
    """Drop an aborted group without blocking anyone (see module docstring). `keep`:
    what must live as long as the group (its Python store, pgstore.py)."""
    if pg is None:
        return
    abort = getattr(pg, "abort", None)
    if abort is not None and pg.name() == "NCCL":
        try:
            abort()
        except RuntimeError:
            pass  # already aborted by the watchdog
    threading.Thread(target=_hold, args=(pg, keep), name="eltctl-buried-pg", daemon=True).start()


def _hold(pg, keep) -> None:
    time.sleep(BACKEND_TIMEOUT.total_seconds() + 30)
    del pg  # its stuck work has timed out by now, so the destructor is quick
    del keep  # after the group: its destructor may still call its store


def wait_work(work, abort: threading.Event, poll_s: float = 0.02) -> None:
    """Wait for a collective, leaving at once (Aborted) when `abort` is set or
    the backend reports an error (e.g. a ring neighbour's connection reset)."""
    if not work.is_completed():
        done = threading.Event()
        try:
            work.get_future().add_done_callback(lambda _f: done.set())
            waiter = done.wait
        except RuntimeError:  # backends without futures: poll
            def waiter(t: float) -> bool:
                time.sleep(min(t, 0.0005))
                return work.is_completed()
        while not work.is_completed() and not waiter(poll_s):
            if abort.is_set():
                raise Aborted("the generation was aborted while waiting for a collective")
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001 - every backend error means the same here
        raise Aborted(f"collective failed: {e}", backend_error=True) from e


def run_abortable(fn: Callable[[], T], abort: threading.Event, what: str) -> T:
    """Run a blocking call (process group construction) in a helper thread so
    an abort can leave it; an abandoned call finishes or times out on its own."""
    box: dict = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        done.set()

    threading.Thread(target=target, name=f"eltctl-{what}", daemon=True).start()
    while not done.wait(0.02):
        if abort.is_set():
            raise Aborted(f"the generation was aborted during {what}")
    if "error" in box:
        raise Aborted(f"{what} failed: {box['error']}") from box["error"]
    return box["value"]


def allreduce(pg, t: torch.Tensor, abort: threading.Event, op=dist.ReduceOp.SUM) -> torch.Tensor:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    wait_work(pg.allreduce([t], opts), abort)
    return t


def allreduce_async(pg, t: torch.Tensor, op=dist.ReduceOp.SUM):
    """Launch an all-reduce and return its work (wait on it with wait_work)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return pg.allreduce([t], opts)


def broadcast(pg, t: torch.Tensor, root: int, abort: threading.Event) -> torch.Tensor:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    wait_work(pg.broadcast([t], opts), abort)
    return t


def allgather(pg, t: torch.Tensor, abort: threading.Event) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(pg.size())]
    wait_work(pg.allgather([out], [t]), abort)
    return out

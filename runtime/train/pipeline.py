"""The input pipeline: this rank's upcoming shares prepared in worker processes.

`ElasticJob(..., num_workers=N, prefetch_steps=K)` forks N data worker
processes (as `torch.utils.data.DataLoader` does on Linux: the dataset object
is used in the children, never pickled). While the training thread computes a
step, the workers read `dataset[i]` and collate the shares of the next K steps
as the current layout splits them. Batches come back through shared memory
(torch's tensor reductions: the storage travels as a file descriptor, not as
bytes) and are handed to the training thread in order; a small batch (at most
BY_VALUE_MAX_BYTES of tensor data) is pickled by value instead, which costs
less than a shared-memory segment and a passed descriptor per tensor.

Exactly-once does not depend on the prediction. A share is keyed by
`ShareKey(epoch, position, indices)`: the step it belongs to and the exact
index list. The training thread asks for the key its sampler gives now and gets
a batch only under that key; whatever was prepared for a layout that no longer
holds (a resize, a restore, a different split) is discarded when the job says
what it wants next, and what is still queued for it is skipped by the workers.

Results come back over one pipe per worker (pickled synchronously in the
worker with torch's `ForkingPickler`) rather than a `torch.multiprocessing`
queue: an unpicklable batch is then an error of that share, not a result lost
in a queue's feeder thread (a hang), and the training thread waits on the pipes
and the workers' process sentinels at once, so a worker that dies is an error
at once, never a hang. Tasks go to the workers through one shared
`torch.multiprocessing` queue (a free worker takes the next share).

Data workers end with the job: `close()` (the job's `__exit__`) stops them; a
training process that dies takes them along (PR_SET_PDEATHSIG, and a poll of
the parent where prctl is missing). They ignore SIGTERM and SIGINT: a signal
meant for the job (SIGTERM means "leave at the next step boundary") reaches
the training process, which ends them itself.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import pickle
import queue
import random
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready
from multiprocessing.reduction import ForkingPickler  # torch.multiprocessing registers its tensor reductions on it
from typing import Any, Callable

import torch
import torch.multiprocessing as tmp
from torch.utils.data import TensorDataset

from .sampler import SamplerState

log = logging.getLogger("eltctl_runtime")

# How often an idle data worker checks that its parent is still there (the
# backstop where PR_SET_PDEATHSIG is missing).
PARENT_POLL_S = 1.0
# A batch with at most this much tensor data travels by value through the pipe.
BY_VALUE_MAX_BYTES = 256 * 1024
# How long close() lets data workers finish what they are doing before SIGKILL.
CLOSE_GRACE_S = 0.05
_PR_SET_PDEATHSIG = 1
_NO_TASK = 2**62  # cancel_below after close(): every queued task is skipped
# Signals meant for the job, which data workers ignore (the job ends them).
_JOB_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@dataclass(frozen=True)
class ShareKey:
    """One share (or micro-batch of a share) of one step: the step's place in
    the epoch order and the exact indices. Two keys are equal only if the
    batches they name are the same samples in the same order."""

    epoch: int
    position: int
    indices: tuple[int, ...]

    def describe(self) -> str:
        shown = ", ".join(map(str, self.indices[:8])) + (", ..." if len(self.indices) > 8 else "")
        return f"samples [{shown}] ({len(self.indices)}) of epoch {self.epoch} at position {self.position}"


class DataLoadError(RuntimeError):
    """The input pipeline could not produce a share: the dataset or the
    collate function raised in a data worker (the message carries its
    traceback), or a data worker process died."""


def check_pipeline_args(num_workers: int, prefetch_steps: int) -> None:
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be a whole number >= 0 (0: load on the training thread), "
                         f"got {num_workers!r}")
    if not isinstance(prefetch_steps, int) or prefetch_steps < 0:
        raise ValueError(f"prefetch_steps must be a whole number >= 0 (steps prepared ahead), got {prefetch_steps!r}")


def micro_chunks(indices: list[int], micro: int | None) -> list[list[int]]:
    """A share cut into micro-batches of at most `micro` (one empty chunk for
    an empty share: the rank still takes part in the step)."""
    if not micro:
        return [indices]
    return [indices[i : i + micro] for i in range(0, len(indices), micro)] or [[]]


def plan_shares(
    sampler: SamplerState,
    indices_for: Callable[[SamplerState], list[int]],
    *,
    micro: int | None,
    ahead: int,
    steps_left: int | None,
    epochs: int | None,
) -> list[ShareKey]:
    """The keys this rank wants, in training order: the chunks of the step
    `sampler` is at, then those of up to `ahead` following steps as
    `indices_for` splits them now, none past the job's end (`steps_left`
    steps, or the epoch `epochs`). Pure."""
    keys: list[ShareKey] = []
    s = sampler
    for j in range(ahead + 1):
        if j:
            s = s.advanced()
            if (steps_left is not None and j >= steps_left) or (epochs is not None and s.epoch >= epochs):
                break
        keys += [ShareKey(s.epoch, s.position, tuple(c)) for c in micro_chunks(indices_for(s), micro)]
    return keys


class Feeder:
    """Where ElasticJob's batches come from: the dataset on the training thread, or
    (num_workers > 0) a Prefetcher that loads the upcoming shares ahead. The
    constructor forks nothing; `start` does (before the job's threads, its store
    connections and CUDA exist), `close` ends the workers."""

    def __init__(self, dataset: Any, collate: Callable[[list], Any], *, num_workers: int, prefetch_steps: int,
                 pin_memory: bool, seed: int) -> None:
        check_pipeline_args(num_workers, prefetch_steps)
        self.dataset = dataset
        self._collate = collate
        # num_workers > 0: upcoming shares are loaded in data worker processes
        self._pipeline = Prefetcher(dataset, collate, num_workers, seed=seed) if num_workers else None
        self._prefetch_steps = prefetch_steps
        self._pin_memory = pin_memory

    def start(self, *, cuda: bool) -> None:
        if self._pipeline is not None:
            self._pipeline.start(pin_memory=self._pin_memory and cuda)

    def close(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()

    def want(self, sampler: SamplerState, indices_for: Callable[[SamplerState], list[int]], *, micro: int | None,
             steps_left: int | None, epochs: int | None) -> None:
        """This step's chunks, then those of the next prefetch_steps steps as the
        current layout splits them (after a resize or a restore the pipeline
        drops what no longer matches)."""
        if self._pipeline is not None:
            self._pipeline.want(plan_shares(sampler, indices_for, micro=micro, ahead=self._prefetch_steps,
                                            steps_left=steps_left, epochs=epochs))

    def fetch(self, sampler: SamplerState, indices: list[int]) -> Any:
        """The batch of `indices` at the sampler's committed place."""
        if self._pipeline is not None and indices:
            # Only ever the batch of exactly these indices at the sampler's committed place.
            return self._pipeline.get(ShareKey(sampler.epoch, sampler.position, tuple(indices)))
        return fetch_batch(self.dataset, indices, self._collate)


def share_seed(seed: int, key: ShareKey) -> int:
    """The RNG seed a data worker sets before it loads `key` (torch and
    random): a share's random augmentations are the same whichever worker
    loads it, and when it is loaded again."""
    first = key.indices[0] if key.indices else 0
    return (seed * 1_000_003 + key.epoch * 7_919 + key.position * 104_729 + first) & 0x7FFF_FFFF_FFFF_FFFF


def fetch_batch(dataset: Any, indices: list[int], collate: Callable[[list], Any]) -> Any:
    """`collate([dataset[i] for i in indices])`; a TensorDataset is indexed
    with one gather per tensor instead. No indices (a rank without samples in a step:
    a joiner catching up, catchup.py): the batch of one sample cut to none (`emptied`)
    where the collate cannot make an empty batch itself (torch's default_collate)."""
    if isinstance(dataset, TensorDataset):
        idx = torch.tensor(indices, dtype=torch.long)
        return tuple(t[idx] for t in dataset.tensors)
    if not indices:
        try:
            return collate([])
        except Exception:  # noqa: BLE001 - default_collate([]) raises IndexError; others may differ
            return emptied(collate([dataset[0]]))
    return collate([dataset[i] for i in indices])


def emptied(batch: Any) -> Any:
    """A collated batch with none of its samples: tensors cut to length 0 along the
    batch dimension, containers of them kept, a list of plain values (strings,
    numbers: one per sample) emptied."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return type(batch)((k, emptied(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        if any(isinstance(b, (torch.Tensor, dict, list, tuple)) for b in batch):
            items = [emptied(b) for b in batch]
            return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
        return type(batch)() if not hasattr(batch, "_fields") else batch
    return batch


def pin_batch(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, (list, tuple)):
        return type(batch)(pin_batch(b) for b in batch)
    if isinstance(batch, dict):
        return {k: pin_batch(v) for k, v in batch.items()}
    return batch


class Prefetcher:
    """N data worker processes and what they prepare, keyed by ShareKey.

    The constructor does nothing; `start()` forks the workers (call it before
    the process starts threads or opens connections), `close()` ends them.
    `want(keys)` says, in training order, which shares are wanted now (the rest
    is dropped); `get(key)` returns one, waiting for it."""

    def __init__(self, dataset: Any, collate: Callable[[list], Any], num_workers: int, *, seed: int = 0) -> None:
        check_pipeline_args(num_workers, 0)
        if num_workers == 0:
            raise ValueError("a Prefetcher needs at least one worker")
        self._dataset = dataset
        self._collate = collate
        self._n = num_workers
        self._seed = seed
        self._pin = False
        self._procs: list = []
        self._conns: list = []
        self._tasks = None
        self._cancel = None  # shared: workers skip tasks numbered below it
        self._next_tid = 0
        self._pending: dict[ShareKey, int] = {}  # wanted, not arrived: key -> task number
        self._owner: dict[int, ShareKey] = {}  # the same, by task number
        self._ready: dict[ShareKey, tuple[Any, str | None, int]] = {}  # key -> (batch, error, worker)

    @property
    def pids(self) -> list[int]:
        """The data worker processes (empty before start() and after close())."""
        return [p.pid for p in self._procs]

    def prepared(self) -> set[ShareKey]:
        """The shares loaded or being loaded for the training thread."""
        return set(self._ready) | set(self._pending)

    def start(self, *, pin_memory: bool = False) -> None:
        if self._procs:
            return
        self._pin = pin_memory
        ctx = tmp.get_context("fork")
        self._tasks = ctx.Queue()
        self._cancel = ctx.Value("q", 0, lock=False)
        parent = os.getpid()
        # Held back while forking: a child inherits the mask and ignores them
        # before it lets them in; here they are delivered once the mask is restored.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _JOB_SIGNALS)
        try:
            for i in range(self._n):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker_loop, name=f"eltctl-data-{i}", daemon=True,
                                args=(self._dataset, self._collate, self._tasks, self._cancel, writer, parent))
                p.start()
                writer.close()  # the child holds it; later children must not inherit it from us
                self._procs.append(p)
                self._conns.append(reader)
        except BaseException:
            self.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        # multiprocessing's own exit hook would SIGTERM (ignored) and join them: stop them first.
        atexit.register(self.close)

    def close(self) -> None:
        """End every data worker (a short grace, then SIGKILL) and forget
        everything prepared. Idempotent; never blocks long."""
        procs, self._procs = self._procs, []
        if self._cancel is not None:
            self._cancel.value = _NO_TASK
        if procs:
            for _ in procs:
                self._tasks.put(None)
            deadline = time.monotonic() + CLOSE_GRACE_S
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            for p in procs:
                if p.exitcode is None:
                    p.kill()
            for p in procs:
                p.join(5.0)
        if self._tasks is not None:
            self._tasks.cancel_join_thread()  # never wait at exit to flush tasks nobody will read
            self._tasks.close()
            self._tasks = None
        for c in self._conns:
            c.close()
        self._conns = []
        self._pending.clear()
        self._owner.clear()
        self._ready.clear()
        atexit.unregister(self.close)

    # -- what the training thread asks -----------------------------------------------
    def want(self, keys: list[ShareKey]) -> None:
        """Keep or start preparing `keys` (in this order); drop everything else.
        Empty shares are not sent to workers (the caller makes them)."""
        keys = [k for k in keys if k.indices]
        keep = set(keys)
        stale = [k for k in self._ready if k not in keep]
        for k in stale:
            del self._ready[k]
        dropped = [k for k in self._pending if k not in keep]
        if stale or dropped:
            log.info("input pipeline: dropped %d loaded and %d queued shares of a layout that no longer holds",
                     len(stale), len(dropped))
        if dropped:
            # A layout that no longer holds: skip everything queued so far and
            # queue again, in order, what is still wanted (rare: a resize or a restore).
            self._cancel.value = self._next_tid
            self._pending.clear()
            self._owner.clear()
        for k in keys:
            if k not in self._ready and k not in self._pending:
                self._submit(k)

    def get(self, key: ShareKey) -> Any:
        """The batch of `key`, waiting for it. Raises DataLoadError if loading
        it failed or a data worker died."""
        if key not in self._ready and key not in self._pending:
            self._submit(key)
        while key not in self._ready:
            self._receive()
        batch, error, worker = self._ready.pop(key)
        if error is not None:
            raise DataLoadError(
                f"loading {key.describe()} failed in data worker {worker} (pid {self._pid(worker)}); "
                f"the dataset's traceback from that process:\n{error}\n"
                "Fix the dataset or collate_fn; with num_workers=0 the same code runs in the training process.")
        return batch

    # -- internals -------------------------------------------------------------------
    def _submit(self, key: ShareKey) -> None:
        if not self._procs:
            raise RuntimeError("the input pipeline is not running (start() it inside the job)")
        tid = self._next_tid
        self._next_tid += 1
        self._pending[key] = tid
        self._owner[tid] = key
        self._tasks.put((tid, list(key.indices), share_seed(self._seed, key)))

    def _receive(self) -> None:
        """Take whatever arrived (at least one message or one worker's end)."""
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        conns = {id(c): i for i, c in enumerate(self._conns)}
        ready = wait_ready([*self._conns, *sentinels])
        dead = []
        for obj in ready:
            if isinstance(obj, int):
                dead.append(sentinels[obj])
            else:
                self._read(conns[id(obj)])
        for i in dead:
            while self._conns[i].poll(0):  # what it sent before it ended still counts
                self._read(i)
            self._died(i)

    def _read(self, i: int) -> None:
        try:
            data = self._conns[i].recv_bytes()
        except (EOFError, OSError) as e:
            self._died(i, "" if isinstance(e, EOFError) else f" ({type(e).__name__}: {e})")
        try:
            tid, batch, error = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - whatever unpickling a batch raises, say where it came from
            if self._procs[i].exitcode is not None:
                self._died(i, f" ({type(e).__name__}: {e})")
            raise DataLoadError(
                f"a batch from data worker {i} (pid {self._procs[i].pid}) could not be received: "
                f"{type(e).__name__}: {e}. Tensors come through shared memory as file descriptors: "
                "'received 0 items of ancdata' means the open-files limit is reached (raise `ulimit -n`, or call "
                "torch.multiprocessing.set_sharing_strategy('file_system') before the job starts).") from e
        key = self._owner.pop(tid, None)
        if key is None:
            return  # prepared for a layout that no longer holds
        del self._pending[key]
        if batch is not None and self._pin:
            batch = pin_batch(batch)
        self._ready[key] = (batch, error, i)

    def _died(self, i: int, detail: str = "") -> None:
        p = self._procs[i]
        p.join(1.0)  # its pipes close a moment before it can be reaped
        code = p.exitcode
        if code is None:
            how = "stopped answering"
        elif code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        waiting = ", ".join(k.describe() for k in list(self._pending)[:2]) or "nothing"
        hint = "A crash in the dataset's native code leaves its last words in this process's log"
        if code == -signal.SIGKILL:
            hint = "A SIGKILL nobody sent is often the kernel's out-of-memory killer (see `dmesg`)"
        raise DataLoadError(
            f"data worker {i} (pid {p.pid}) {how}{detail} while the job waited for {waiting}; the input pipeline "
            f"cannot go on. {hint}. With num_workers=0 the dataset runs in the training process.")

    def _pid(self, i: int) -> int | None:
        return self._procs[i].pid if i < len(self._procs) else None


# -- the data worker process ----------------------------------------------------------

def _tensor_bytes(batch: Any) -> int:
    """The bytes of tensor data in a batch (tensors in lists, tuples and dicts)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, (list, tuple)):
        return sum(_tensor_bytes(b) for b in batch)
    if isinstance(batch, dict):
        return sum(_tensor_bytes(b) for b in batch.values())
    return 0


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the poll in _worker_loop is the backstop
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _worker_loop(dataset: Any, collate: Callable[[list], Any], tasks, cancel, out, parent: int) -> None:
    for sig in _JOB_SIGNALS:  # they arrive blocked (see Prefetcher.start)
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _JOB_SIGNALS)
    _die_with_parent(parent)
    torch.set_num_threads(1)  # as DataLoader's workers: N of them share the cores with training
    while True:
        try:
            task = tasks.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        tid, indices, seed = task
        if tid < cancel.value:
            continue
        try:
            torch.manual_seed(seed)
            random.seed(seed)
            batch = fetch_batch(dataset, indices, collate)
            if _tensor_bytes(batch) <= BY_VALUE_MAX_BYTES:
                data = pickle.dumps((tid, batch, None), protocol=pickle.HIGHEST_PROTOCOL)
            else:
                data = ForkingPickler.dumps((tid, batch, None))
        except Exception:  # noqa: BLE001 - the dataset's error goes to the training process, with its traceback
            data = ForkingPickler.dumps((tid, None, traceback.format_exc()))
        try:
            out.send_bytes(data)
        except (BrokenPipeError, OSError):
            return  # the training process closed the pipeline

"""ElasticJob: the training script's view of an elastic job.

The script hands over its model, optimizer and dataset and writes an ordinary
loop; one iteration is one global step::

    with ElasticJob(model, opt, data, global_batch_size=64) as job:
        for batch in job:              # this rank's share of the step's global batch
            job.step(loss_fn(model, batch))

The job owns the step boundaries. `step` runs backward with the loss scaled by
this rank's share of the global batch, all-reduces the gradients in one flat
buffer whose tail carries the control scalars (a change is pending, a leave, a
stop, the sample count and the loss sum), steps the optimizer and commits.
Because the control scalars ride with the gradients, every rank learns at the
same step, with no extra round trip, that membership changes after it. A crash
or hang is not noticed by the collective but by the control thread (control.py),
which aborts the wait; the step in flight is dropped and the survivors form the
next generation (membership.py) and agree on the state (state.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset, default_collate

from . import collectives, exiting, state as state_mod
from .collectives import Aborted
from .config import Device, RuntimeConfig
from .control import ControlThread
from .membership import Plan, Verdict, choose_source, decide, job_store, propose, roll_call, scan_joiners
from .protocol import EventKind, Keys, add_event, put_dead, status_document
from .sampler import SamplerState

log = logging.getLogger("eltctl_runtime")

STATUS_EVERY_S = 1.0
# After this rank's own collective failed (a connection reset: some peer is
# gone), a member silent this long is taken as dead without waiting for the
# full hang timeout. A host that vanishes has no daemon left to report it.
CRASH_CONFIRM_S = 2.0
_N_CTRL = 4  # pending, stop, local sample count, local loss sum; then one leave flag per rank
# Megabytes of gradients per all-reduce bucket. DDP's default is 25 MB; smaller
# buckets start sooner in backward.
BUCKET_MB = 4.0


Bucket = tuple[int, int, tuple[int, ...]]  # (start, end) in the flat buffer, parameter indices


def bucket_layout(numels: list[int], bucket_elems: int) -> tuple[list[tuple[int, int]], list[Bucket]]:
    """Where each gradient lives in the flat buffer, and the buckets.

    Gradients are laid out in reverse parameter order, the order backward
    produces them, and cut into contiguous buckets of at least `bucket_elems`
    elements (the last one may be smaller). Returns (offset, numel) per
    parameter and (start, end, parameter indices) per bucket, in launch order.
    Pure: tested by table."""
    offsets: list[tuple[int, int]] = [(0, 0)] * len(numels)
    buckets: list[Bucket] = []
    start = pos = 0
    members: list[int] = []
    for i in reversed(range(len(numels))):
        offsets[i] = (pos, numels[i])
        pos += numels[i]
        members.append(i)
        if pos - start >= bucket_elems:
            buckets.append((start, pos, tuple(members)))
            start, members = pos, []
    if members or not buckets:
        buckets.append((start, pos, tuple(members)))
    return offsets, buckets


@dataclass(frozen=True)
class Commit:
    step: int
    generation: int
    world_size: int
    time: float  # wall clock, time.time()
    loss: float  # global mean loss of the step


class ExcludedFromJob(RuntimeError):
    """This worker is no longer a member (it was hung or partitioned and the
    others went on without it). It must exit without touching anything."""


class ElasticJob:
    """See the module docstring. Nothing happens until `with job:`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        *,
        global_batch_size: int,
        seed: int = 0,
        max_steps: int | None = None,
        epochs: int | None = None,
        micro_batch_size: int | None = None,
        checkpoint_every_steps: int | None = None,
        checkpoint_every_seconds: float | None = None,
        keep_checkpoints: int = 3,
        collate_fn: Callable[[list], Any] | None = None,
        config: RuntimeConfig | None = None,
        fast_exit: bool = True,
        bucket_mb: float = BUCKET_MB,
    ) -> None:
        if max_steps is None and epochs is None:
            raise ValueError("give max_steps or epochs (or both)")
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        self._config = config
        self._sampler = SamplerState(n_samples=len(dataset), global_batch=global_batch_size, seed=seed)
        self._max_steps = max_steps
        self._epochs = epochs
        self._micro = micro_batch_size
        self._ckpt_steps = checkpoint_every_steps
        self._ckpt_seconds = checkpoint_every_seconds
        self._keep = keep_checkpoints
        self._collate = collate_fn or default_collate
        self._fast_exit = fast_exit
        self._params = [p for p in model.parameters() if p.requires_grad]
        if len({p.dtype for p in self._params}) > 1:
            raise ValueError("all trainable parameters must share one dtype (one flat gradient buffer)")
        # The flat buffer holds the gradients in reverse parameter order (backward
        # produces the last layers' gradients first), cut into buckets of about
        # bucket_mb; the control tail follows the last bucket. 0: one bucket,
        # all-reduced after backward.
        elem = self._params[0].element_size() if self._params else 4
        per_bucket = max(1, int(bucket_mb * 2**20) // elem) if bucket_mb > 0 else sys.maxsize
        self._offsets, self._buckets = bucket_layout([p.numel() for p in self._params], per_bucket)
        self._n_grad = self._buckets[-1][1]
        self._bucket_of = {i: b for b, (_s, _e, members) in enumerate(self._buckets) for i in members}
        self._flat: torch.Tensor | None = None
        self._hooks: list = []
        self._launching = False  # inside the backward of a step's last micro-batch
        self._ready: list[int] = []  # per bucket: gradients ready in this backward
        self._fired: set[int] = set()  # parameters whose gradient is ready in this backward
        self._works: list = []  # the all-reduces launched for this step, in bucket order
        self._launch_error: Exception | None = None

        self._plan: Plan | None = None
        self._rank = -1
        self._pg = None
        self._abort = threading.Event()
        self._step = 0
        self._has_state = False
        self._need_recovery = False
        self._peer_gone = False
        self._finished = False
        self._left = False
        self._in_step = False
        self._mb_left = 0
        self._mb_count = 0
        self._loss_sum = 0.0
        self._last_commit_t = 0.0
        self._last_commit: Commit | None = None
        self._pending_event: dict | None = None
        self._last_status_t = 0.0
        self._last_ckpt_t = time.monotonic()
        self._last_ckpt: dict | None = None
        self._last_loss: float | None = None
        self._samples_since = (0, time.monotonic())
        self._audit_fd: int | None = None
        self._ckpt = None
        self._control: ControlThread | None = None
        self._store = None  # the job's PrefixStore over _tcp
        self._tcp = None
        self._old_sigterm = None

    # -- public view -------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._plan.world_size if self._plan else 0

    @property
    def generation(self) -> int:
        return self._plan.generation if self._plan else -1

    @property
    def step_count(self) -> int:
        """Committed global steps."""
        return self._step

    @property
    def epoch(self) -> int:
        return self._sampler.epoch

    @property
    def last_commit(self) -> "Commit | None":
        """The last committed step as it happened (its generation and size,
        before any membership change that followed it)."""
        return self._last_commit

    @property
    def left(self) -> bool:
        """True once this worker has left the job (planned leave or job paused)."""
        return self._left

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    @property
    def config(self) -> RuntimeConfig:
        if self._config is None:
            self._config = RuntimeConfig.from_env()
        return self._config

    def fingerprint(self) -> str:
        """Hash of parameters and optimizer state: identical on every rank."""
        return state_mod.fingerprint(self.model, self.optimizer)

    # -- lifecycle -----------------------------------------------------------
    def __enter__(self) -> "ElasticJob":
        cfg = self.config
        if cfg.device is Device.CUDA:
            torch.cuda.set_device(cfg.local_gpu)
            self._device = torch.device("cuda", cfg.local_gpu)
            self.model.to(self._device)  # warm before registering; parameters stay the optimizer's objects
        else:
            self._device = torch.device("cpu")
        self._bind_host = collectives.local_address_towards(cfg.store_host, cfg.store_port)
        self._tcp = self._connect_raw()
        self._store = job_store(self._tcp, cfg.job)
        if cfg.audit_path is not None:
            self._audit_fd = os.open(cfg.audit_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if cfg.checkpoint_dir is not None:
            from .checkpoint import CheckpointStore

            self._ckpt = CheckpointStore(cfg.checkpoint_dir, keep=self._keep, on_committed=self._on_checkpoint)
        self._control = ControlThread(self._connect, cfg.worker_id, cfg.hang_timeout_s, cfg.max_workers)
        self._control.start()
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                       for i, p in enumerate(self._params)]
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: self._control.request_local_leave())
        self._admit()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            abrupt = not (self._left or self._finished) and self._plan is not None
            if abrupt and not isinstance(exc, ExcludedFromJob):
                # Leaving mid-job (an error in the script, or it left the loop):
                # tell the others at once rather than let them wait for the
                # hang timeout. A planned leave is SIGTERM or request_leave.
                log.error("worker %s: leaving generation %d abruptly: %s", self.worker_id, self.generation,
                          exc if exc is not None else "the script left the loop before the job ended")
                try:
                    put_dead(self._store, self.worker_id)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
            if self._ckpt is not None:
                self._ckpt.close()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            if self._control is not None:
                self._control.close()
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
            if self._audit_fd is not None:
                os.close(self._audit_fd)
            collectives.bury(self._pg)  # never block the exit on a group
            self._pg = None
            if self._fast_exit and exc is None and (self._left or self._finished):
                # Out of the job: the script's code after the loop still runs,
                # but the interpreter's teardown (seconds, GPU memory held) is
                # skipped. See exiting.py.
                exiting.arm()

    def _connect_raw(self):
        cfg = self.config
        return dist.TCPStore(cfg.store_host, cfg.store_port, is_master=False, timeout=timedelta(seconds=60))

    def _connect(self):
        return job_store(self._connect_raw(), self.config.job)

    # -- the loop ------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        while True:
            if self._need_recovery:
                self._recover()
            if self._left or self._finished or self._done():
                self._finish()
                return
            indices = self._sampler.local_indices(self._rank, self.world_size)
            global_count = self._sampler.step_size()
            chunks = [indices]
            if self._micro:
                chunks = [indices[i : i + self._micro] for i in range(0, len(indices), self._micro)] or [[]]
            self._global_count = global_count
            self._local_indices = indices
            self._global_indices = self._sampler.global_indices() if self._audit_fd is not None else []
            self._loss_sum = 0.0
            self._mb_left = len(chunks)
            for chunk in chunks:
                self._mb_count = len(chunk)
                self._in_step = True
                yield self._fetch(chunk)
                if self._in_step:
                    raise RuntimeError("call job.step(loss) once per batch the job yields")

    def _done(self) -> bool:
        if self._max_steps is not None and self._step >= self._max_steps:
            return True
        return self._epochs is not None and self._sampler.epoch >= self._epochs

    def _fetch(self, indices: list[int]) -> Any:
        if isinstance(self.dataset, TensorDataset):
            idx = torch.tensor(indices, dtype=torch.long)
            batch = tuple(t[idx] for t in self.dataset.tensors)
        else:
            batch = self._collate([self.dataset[i] for i in indices])
        if self._device.type == "cuda":
            batch = _to(batch, self._device)
        return batch

    def step(self, loss: torch.Tensor) -> float | None:
        """Backward, gradient all-reduce, optimizer step, commit. `loss` is the
        mean loss over the batch this iteration yielded. Returns the global mean
        loss of the step, or None (a micro-batch before the last one, or the
        step was dropped because the generation was aborted)."""
        if not self._in_step:
            raise RuntimeError("job.step() called outside an iteration of the job")
        self._in_step = False
        n = self._mb_count
        if self._mb_left == 1:
            self._begin_reduce()  # buckets are all-reduced as backward fills them
        try:
            if n > 0:
                (loss * (n / self._global_count)).backward()
                self._loss_sum += float(loss.detach()) * n
        finally:
            self._launching = False
        self._mb_left -= 1
        if self._mb_left > 0:
            return None
        return self._reduce_and_commit()

    def _begin_reduce(self) -> None:
        """Bind every .grad to its view of the flat buffer (so backward
        accumulates in place) and arm the gradient hooks for this backward."""
        flat = self._grad_buffer()
        with torch.no_grad():
            for p, (o, k) in zip(self._params, self._offsets):
                if p.grad is not None and p.grad.data_ptr() == flat[o:o + k].data_ptr():
                    continue
                view = flat[o : o + k].view_as(p)
                if p.grad is None:
                    view.zero_()
                else:  # the script replaced .grad (e.g. zero_grad), or a new buffer after a resize
                    view.copy_(p.grad)
                p.grad = view
        self._ready = [0] * len(self._buckets)
        self._fired = set()
        self._works = []
        self._launch_error = None
        self._launching = True

    def _grad_ready(self, index: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter `index`: launch every bucket
        that is complete, in bucket order (every rank issues the same
        collectives in the same order). The last bucket, which carries the
        control tail, is launched by _reduce_and_commit."""
        if not self._launching or index in self._fired:
            return
        self._fired.add(index)
        o, k = self._offsets[index]
        view = self._flat[o : o + k]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            with torch.no_grad():  # not a view (should not happen): reduce a copy and adopt the view
                view.view_as(p).copy_(p.grad)
                p.grad = view.view_as(p)
        self._ready[self._bucket_of[index]] += 1
        while len(self._works) < len(self._buckets) - 1:
            b = len(self._works)
            if self._ready[b] < len(self._buckets[b][2]):
                break
            self._launch(b)

    def _launch(self, b: int) -> None:
        start, end, _ = self._buckets[b]
        if b == len(self._buckets) - 1:
            end = self._flat.numel()  # the control tail rides with the last bucket
        try:
            self._works.append(collectives.allreduce_async(self._pg, self._flat[start:end]))
        except Exception as e:  # noqa: BLE001 - a broken group: the step is dropped in _reduce_and_commit
            self._launch_error = e
            self._works.append(None)

    def _reduce_and_commit(self) -> float | None:
        W = self.world_size
        req = self._control.requests
        ctrl = torch.zeros(_N_CTRL + W, dtype=torch.float32)
        ctrl[0] = 1.0 if req.any else 0.0
        ctrl[1] = 1.0 if req.stop else 0.0
        ctrl[2] = float(len(self._local_indices))
        ctrl[3] = self._loss_sum
        ctrl[_N_CTRL + self._rank] = 1.0 if req.leave else 0.0
        flat = self._flat
        offset = self._n_grad
        with torch.no_grad():
            flat[offset:].copy_(ctrl)
        # Buckets whose gradients never came (parameters unused in this step, a
        # rank with no samples) go now, in order; then the last one, with the tail.
        while len(self._works) < len(self._buckets):
            self._launch(len(self._works))
        try:
            if self._launch_error is not None:
                raise Aborted(f"an all-reduce could not be launched: {self._launch_error}", backend_error=True)
            for work in self._works:
                collectives.wait_work(work, self._abort)
        except Aborted as e:
            self._works = []
            self._drop_step(str(e), e.backend_error)
            return None
        self._works = []
        tail = flat[offset:].to("cpu", copy=True)  # the buffer is zeroed below
        self.optimizer.step()
        flat.zero_()  # the gradients stay views of the buffer: next backward accumulates in place
        global_loss = float(tail[3]) / max(1.0, float(tail[2]))
        self._commit(global_loss)
        if tail[1] > 0:
            self._stop_job()
        elif tail[0] > 0:
            leavers = {self._plan.members[r] for r in range(W) if tail[_N_CTRL + r] > 0}
            try:
                self._planned_change(leavers)
            except Aborted as e:
                log.warning("worker %s: generation %d aborted while forming: %s", self.worker_id,
                            self.generation, e)
                self._need_recovery = True
        return global_loss

    def _grad_buffer(self) -> torch.Tensor:
        """The flat all-reduce buffer: every gradient (bucket by bucket), then the
        control tail. Parameters' .grad are views into it (as DDP's
        gradient_as_bucket_view), so backward accumulates in place and nothing
        is copied in or out."""
        n = self._n_grad + _N_CTRL + self.world_size
        if self._flat is None or self._flat.numel() != n:
            # The caller copies the current gradients in (they are not views of this one).
            self._flat = torch.zeros(n, dtype=self._params[0].dtype, device=self._device)
        return self._flat

    def _drop_step(self, why: str, backend_error: bool = False) -> None:
        self._peer_gone = backend_error
        log.warning("worker %s: step %d dropped in generation %d: %s (%s)", self.worker_id, self._step + 1,
                    self.generation, why, self._control.abort_reason())
        # A collective that never finished may still write into the buffer: never reuse it.
        self._flat = None
        self.optimizer.zero_grad(set_to_none=True)
        self._need_recovery = True

    def _commit(self, global_loss: float) -> None:
        now = time.monotonic()
        self._step += 1
        self._last_commit = Commit(self._step, self.generation, self.world_size, time.time(), global_loss)
        if self._audit_fd is not None:
            line = json.dumps({"step": self._step, "epoch": self._sampler.epoch, "generation": self.generation,
                               "world_size": self.world_size, "rank": self._rank, "worker": self.worker_id,
                               "indices": self._local_indices, "step_indices": self._global_indices}) + "\n"
            os.write(self._audit_fd, line.encode())
        n_done, since = self._samples_since
        self._samples_since = (n_done + self._global_count, since)
        self._sampler = self._sampler.advanced()
        self._last_loss = global_loss
        if self._pending_event is not None:
            self._emit_event(now)
        self._last_commit_t = now
        if self._rank == 0:
            self._maybe_checkpoint(now)
            if now - self._last_status_t >= STATUS_EVERY_S:
                self._write_status(now)

    # -- membership changes --------------------------------------------------
    def _planned_change(self, leavers: set[str]) -> None:
        plan = self._plan
        survivors = [w for w in plan.members if w not in leavers]
        queue, upto = self._scan_joiners(plan.join_upto)
        kind = EventKind.LEAVE if leavers else EventKind.JOIN
        proposal = propose(plan, survivors, queue, upto, self.config.max_workers, kind, time.time())
        if not proposal.members:
            # Everyone is leaving: keep the newest state on disk and end the job.
            log.info("worker %s: every member leaves at step %d; the job pauses", self.worker_id, self._step)
            if self._rank == 0:
                self._checkpoint_now()
            self._left = True
            return
        decided = self._decide(proposal)
        self._switch(decided, old_t=self._last_commit_t)

    def _stop_job(self) -> None:
        log.info("worker %s: stop requested; ending at step %d", self.worker_id, self._step)
        if self._rank == 0:
            self._checkpoint_now()
            self._event({"kind": EventKind.STOP.value, "generation": self.generation, "step": self._step})
            self._write_status(time.monotonic())
            self._store.set(Keys.DONE, json.dumps({"step": self._step, "reason": "stop"}))
        self._finished = True

    def _recover(self) -> None:
        """Roll call after an abort, then the next generation."""
        self._need_recovery = False
        silence_limit = self.config.hang_timeout_s
        peer_gone, self._peer_gone = self._peer_gone, False
        if peer_gone:
            silence_limit = min(silence_limit, CRASH_CONFIRM_S)
        while True:
            plan = self._plan
            g = plan.generation
            st = self._store
            t_old = self._last_commit_t
            st.compare_set(Keys.abort(g), "", json.dumps({"reason": "error", "worker": self.worker_id}))
            st.set(Keys.alive(g, self.worker_id), str(self._step))
            collectives.bury(self._pg)
            self._pg = None
            decided = None
            while decided is None:
                if st.check([Keys.plan(g + 1)]):
                    decided = Plan.from_json(st.get(Keys.plan(g + 1)))
                    break
                verdicts = {}
                for w in plan.members:
                    if w == self.worker_id:
                        verdicts[w] = Verdict.SURVIVOR
                        continue
                    verdicts[w] = roll_call(
                        alive=st.check([Keys.alive(g, w)]),
                        dead=st.check([Keys.dead(w)]),
                        silent_for_s=self._control.silence(w),
                        hang_timeout_s=silence_limit,
                    )
                if Verdict.UNKNOWN not in verdicts.values():
                    survivors = [w for w in plan.members if verdicts[w] is Verdict.SURVIVOR]
                    lost = [w for w in plan.members if verdicts[w] is Verdict.GONE]
                    crashed = peer_gone or any(st.check([Keys.dead(w)]) for w in lost)
                    kind = EventKind.CRASH if crashed else EventKind.HANG
                    queue, upto = self._scan_joiners(plan.join_upto)
                    decided = self._decide(propose(plan, survivors, queue, upto, self.config.max_workers,
                                                   kind, time.time()))
                    break
                time.sleep(0.01)
            try:
                self._switch(decided, old_t=t_old)
                return
            except Aborted as e:
                log.warning("worker %s: generation %d aborted while forming: %s", self.worker_id,
                            self.generation, e)

    def _decide(self, proposal: Plan) -> Plan:
        """compare_set: the first proposal for a generation wins; everyone adopts it."""
        return decide(self._store, proposal)

    def _scan_joiners(self, after: int) -> tuple[list[tuple[int, str]], int]:
        """Live joiners queued after sequence number `after`, and how far the scan got."""
        return scan_joiners(self._store, after)

    def _switch(self, plan: Plan, old_t: float) -> None:
        """Enter generation `plan` (or leave, if this worker is not in it).
        Raises Aborted if the generation breaks while forming."""
        previous = self._plan
        if self.worker_id not in plan.members:
            if previous is not None and self.worker_id in plan.left:
                log.info("worker %s: left the job at step %d (generation %d)", self.worker_id, self._step,
                         plan.generation)
                self._left = True
                self._plan = plan
                return
            raise ExcludedFromJob(
                f"worker {self.worker_id} is not a member of generation {plan.generation} "
                f"(members: {', '.join(plan.members)}); it was presumed hung or dead and must exit"
            )
        self._plan = plan
        self._rank = plan.members.index(self.worker_id)
        self._abort = self._control.watch(plan)
        if previous is not None and self._pg is not None and plan.lost == ():
            self._pg = None  # a cleanly finished group has no work in flight: dropping it is quick
        store = dist.PrefixStore(Keys.pg_prefix(plan.generation), self._store)
        self._pg = collectives.run_abortable(
            lambda: collectives.make_group(store, self._rank, plan.world_size, self._device, self._bind_host),
            self._abort, f"process group of generation {plan.generation}")
        restored = self._sync_state()
        if previous is not None or restored:
            kind = EventKind.RESTORE if restored else plan.kind
            self._pending_event = {"kind": kind.value, "generation": plan.generation,
                                   "world_size": plan.world_size, "members": list(plan.members),
                                   "joined": list(plan.joined), "left": list(plan.left), "lost": list(plan.lost),
                                   "from_step": self._step, "old_t": old_t if self._has_state_before else None}
        log.info("worker %s: rank %d of %d in generation %d (%s) at step %d", self.worker_id, self._rank,
                 plan.world_size, plan.generation, plan.kind.value, self._step)

    def _sync_state(self) -> bool:
        """Agree on the training state; returns True if it came from a checkpoint."""
        self._has_state_before = self._has_state
        report = torch.tensor([1 if self._has_state else 0, self._step], dtype=torch.int64, device=self._device)
        reports = [(bool(r[0]), int(r[1])) for r in
                   (t.cpu() for t in collectives.allgather(self._pg, report, self._abort))]
        transfer = choose_source(reports)
        if not transfer.needed:
            return False
        restored = False
        if self._rank == transfer.source:
            if transfer.restore:
                restored = self._restore_from_checkpoint()
            header, flat = state_mod.pack(state_mod.capture(self.model, self.optimizer, self._progress()))
            sizes = torch.tensor([len(header), flat.numel(), int(restored)], dtype=torch.int64)
        else:
            sizes = torch.zeros(3, dtype=torch.int64)
        sizes = collectives.broadcast(self._pg, sizes.to(self._device), transfer.source, self._abort).cpu()
        if self._rank == transfer.source:
            hbuf = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        else:
            hbuf = torch.empty(int(sizes[0]), dtype=torch.uint8)
            flat = torch.empty(int(sizes[1]), dtype=torch.uint8)
        if self.world_size > 1:
            hbuf = collectives.broadcast(self._pg, hbuf.to(self._device), transfer.source, self._abort).cpu()
            flat = collectives.broadcast(self._pg, flat.to(self._device), transfer.source, self._abort).cpu()
        if self._rank != transfer.source:
            progress = state_mod.apply(state_mod.unpack(state_mod.tensor_bytes(hbuf), flat), self.model, self.optimizer)
            self._set_progress(progress)
        self._has_state = True
        return bool(sizes[2])

    def _progress(self) -> dict:
        s = self._sampler
        return {"step": self._step, "epoch": s.epoch, "position": s.position, "generation": self.generation,
                "seed": s.seed, "global_batch": s.global_batch, "n_samples": s.n_samples}

    def _set_progress(self, p: dict) -> None:
        self._step = int(p["step"])
        self._sampler = SamplerState(n_samples=self._sampler.n_samples, global_batch=self._sampler.global_batch,
                                     seed=self._sampler.seed, epoch=int(p["epoch"]), position=int(p["position"]))

    def _admit(self) -> None:
        """Register as a (warm) joiner and wait to be a member of a generation."""
        st, me, cfg = self._store, self.worker_id, self.config
        seq = st.add(Keys.JOIN_SEQ, 1)
        st.set(Keys.join(seq), me)
        log.info("worker %s: waiting to be admitted (join #%d)", me, seq)
        known = -1
        orphan_watch: tuple[str, ...] = ()
        while True:
            if st.check([Keys.DONE]):
                log.info("worker %s: the job is already finished; nothing to do", me)
                self._finished = True
                return
            while st.check([Keys.plan(known + 1)]):
                known += 1
            if known >= 0:
                plan = Plan.from_json(st.get(Keys.plan(known)))
                if me in plan.members:
                    break
                if plan.members != orphan_watch:
                    orphan_watch = plan.members
                    self._control.watch(None, others=plan.members)
                # Nobody left to admit us (every member died): restart the job.
                gone = all(st.check([Keys.dead(w)]) or self._control.silence(w) >= cfg.hang_timeout_s
                           for w in plan.members)
                if gone:
                    queue, upto = self._scan_joiners(plan.join_upto)
                    if len(queue) >= cfg.min_workers:
                        self._decide(propose(plan, [], queue, upto, cfg.max_workers, EventKind.RESTORE, time.time()))
                        continue
            else:
                queue, upto = self._scan_joiners(0)
                if len(queue) >= cfg.min_workers:
                    self._decide(propose(None, [], queue, upto, cfg.max_workers, EventKind.START, time.time()))
                    continue
            time.sleep(0.02)
        # A joiner of a running job has no committed step; members of the first
        # generation agree on one (restoring the newest checkpoint) in _switch.
        while True:
            try:
                self._switch(plan, old_t=0.0)
                return
            except Aborted as e:
                log.warning("worker %s: generation %d aborted while forming: %s", me, plan.generation, e)
                self._recover()
                return

    # -- checkpoints, status, events ----------------------------------------
    def _maybe_checkpoint(self, now: float) -> None:
        if self._ckpt is None:
            return
        due = (self._ckpt_steps and self._step % self._ckpt_steps == 0) or (
            self._ckpt_seconds and now - self._last_ckpt_t >= self._ckpt_seconds)
        if due:
            self._last_ckpt_t = now
            self._ckpt.save_async(self._step, state_mod.capture(self.model, self.optimizer, self._progress()))

    def _checkpoint_now(self) -> None:
        if self._ckpt is not None and self._has_state:
            self._ckpt.save_async(self._step, state_mod.capture(self.model, self.optimizer, self._progress()))
            self._ckpt.wait()

    def _restore_from_checkpoint(self) -> bool:
        if self._ckpt is None:
            return False
        found = self._ckpt.latest_valid()
        if found is None:
            return False
        info, saved = found
        self._set_progress(state_mod.apply(saved, self.model, self.optimizer))
        log.info("worker %s: restored step %d from %s", self.worker_id, info.step, info.path)
        return True

    def _on_checkpoint(self, info) -> None:  # writer thread
        self._last_ckpt = {"step": info.step, "time": info.created, "path": str(info.path)}

    def _finish(self) -> None:
        if self._finished or self._left:
            return
        self._finished = True
        if self._rank == 0:
            self._checkpoint_now()
            self._write_status(time.monotonic())
            self._store.set(Keys.DONE, json.dumps({"step": self._step, "reason": "finished"}))

    def _write_status(self, now: float) -> None:
        n, since = self._samples_since
        rate = n / (now - since) if now > since else 0.0
        self._samples_since = (0, now)
        self._last_status_t = now
        status = status_document(generation=self.generation, world_size=self.world_size,
                                 members=self._plan.members, step=self._step, epoch=self._sampler.epoch,
                                 position=self._sampler.position, samples_per_s=round(rate, 2),
                                 loss=self._last_loss, checkpoint=self._last_ckpt)
        try:
            self._store.set(Keys.STATUS, json.dumps(status))
        except Exception as e:  # noqa: BLE001 - status is advisory
            log.warning("worker %s: could not write status: %s", self.worker_id, e)

    def _emit_event(self, now: float) -> None:
        ev, self._pending_event = self._pending_event, None
        if self._rank != 0:
            return
        old_t = ev.pop("old_t")
        ev["pause_s"] = round(now - old_t, 4) if old_t else None
        ev["step"] = self._step
        self._event(ev)

    def _event(self, ev: dict) -> None:
        ev.setdefault("time", time.time())
        add_event(self._store, ev)
        log.info("worker %s: event %s", self.worker_id, json.dumps(ev))


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch

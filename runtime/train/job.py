"""ElasticJob: the training script's view of an elastic job.

The script hands over its model, optimizer and dataset and writes an ordinary
loop; one iteration is one global step::

    with ElasticJob(model, opt, data, global_batch_size=64) as job:
        for batch in job:              # this rank's share of the step's global batch
            job.step(loss_fn(model, batch))

The job owns the step boundaries. `step` runs backward with the loss scaled by
this rank's share of the global batch, reduces the gradients through the
gradient path (gradients.py: the seam; replicated, it all-reduces flat buffers)
whose float32 tail carries the control scalars (ready for a
queued joiner, a leave, a stop, the sample count and the loss sum, each rank's
speed and whether it ran out of memory) and the buffers' updates, unscales and
clips the global gradient, steps the optimizer and commits. Because the control
scalars ride with the gradients, every rank learns at the same step, with no
extra round trip, that membership changes after it, and the split of the next
steps (shares proportional to speed: balance.py). What the commit asks for (a
checkpoint, a stop, a membership change) is done at the boundary, when the loop
asks for the next batch: after the script's own code that follows `job.step()`
(a scheduler step) has run. A crash
or hang is not noticed by the collective but by the control thread (control.py),
which aborts the wait; the step in flight is dropped and the survivors form the
next generation (the membership state machine: generation.py, which restart
mode runs too) and agree on the state (state.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from ..member import collectives, exiting
from . import gradients, state as state_mod
from ..store import loss as storeloss
from ..store.auth import Forgeries
from .balance import Pace, Split, worker_report
from ..member.collectives import Aborted
from ..config import Device, RuntimeConfig
from ..member.control import ControlThread
from ..member.generation import CRASH_CONFIRM_S, ExcludedFromJob, GenerationHooks, Generations  # noqa: F401 - re-exported
from .gradients import GradientPath, ReplicatedPath
from ..member.plan import Plan, choose_source, job_store, receivers
from .pipeline import Prefetcher, ShareKey, check_pipeline_args, fetch_batch, micro_chunks, plan_shares
from ..protocol import EventKind, Keys, add_event, get_restored, get_status, put_dead, status_document
from .sampler import SamplerState
from ..store import client as storeclient

log = logging.getLogger("eltctl_runtime")

STATUS_EVERY_S = 1.0
# A cold start whose host lacks the job's newest checkpoint waits this long for eltctl to deliver it.
RESTORE_WAIT_S = 90.0
CONFIRM_COMMITS = 3  # a new balanced split is adopted once proposed at this many commits in a row
_N_CTRL = gradients.N_CTRL  # join ready, stop, local sample count, local loss sum, checkpoint; then the per-rank slots



def _tail_len(world_size: int) -> int:
    """The control tail: _N_CTRL scalars, a leave flag per rank, a pace slot per
    rank (its smoothed compute seconds per sample, 0: unmeasured; balance.py),
    then an out-of-memory slot per rank (0, or the micro-batch size that rank
    redoes the step with). Each rank fills only its own: the sum is exact."""
    return _N_CTRL + 3 * world_size


def _pace_slot(world_size: int, rank: int) -> int:
    return _N_CTRL + world_size + rank


def _oom_slot(world_size: int, rank: int) -> int:
    return _N_CTRL + 2 * world_size + rank

# Megabytes of gradients per all-reduce bucket. DDP's default is 25 MB; smaller
# buckets start sooner in backward.
BUCKET_MB = 4.0
GRAD_SCALER_KEY = "grad_scaler"  # the scaler's entry among the extra state
bucket_layout = gradients.bucket_layout  # the one-dtype layout (tests use it by this name)


@dataclass(frozen=True)
class Commit:
    step: int
    generation: int
    world_size: int
    time: float  # wall clock, time.time()
    loss: float  # global mean loss of the step
    skipped: bool = False  # the GradScaler found inf/NaN gradients: no optimizer step (samples consumed)


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
        extra_state: dict[str, Any] | None = None,
        max_grad_norm: float | None = None,
        before_optimizer_step: Callable[["ElasticJob"], None] | None = None,
        grad_scaler: Any = None,
        balance: bool = True,
        num_workers: int = 0,
        prefetch_steps: int = 2,
        pin_memory: bool = False,
        shard: str | None = None,
        shard_replicas: int = 1,
        reduce_each_micro_batch: bool = False,
    ) -> None:
        if max_steps is None and epochs is None:
            raise ValueError("give max_steps or epochs (or both)")
        check_pipeline_args(num_workers, prefetch_steps)
        self._extra = _check_extra_state(extra_state, grad_scaler)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        self._max_grad_norm = max_grad_norm
        self._before_optimizer_step = before_optimizer_step
        self._scaler = grad_scaler
        self._grad_norm: float | None = None
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
        # Speed-proportional shares (balance.py): each worker's own smoothed pace,
        # the split in force and the generation it was planned in, the compute
        # time of the step in flight, and what the last commit carried.
        self._balance = balance
        # BatchNorm in training mode needs more than one sample per rank: a balanced
        # split never gives a rank fewer than two then.
        self._min_share = 2 if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                   for m in model.modules()) else 1
        self._pace = Pace()
        self._split = Split(minimum=self._min_share)
        self._proposal: tuple[list[int], int] | None = None  # a new split proposed, and at how many commits in a row
        self._split_gen = -1
        self._t_handed = 0.0
        self._compute_s = 0.0
        self._last_paces: list[float] = []
        self._last_counts: list[int] = []
        # Out of memory on a share: the micro-batch size this rank redoes the
        # step with (0: none this step), and the limit found so far.
        self._oom_retry = 0
        self._oom_limit: int | None = None
        # num_workers > 0: upcoming shares are loaded in data worker processes (pipeline.py)
        self._pipeline = Prefetcher(dataset, self._collate, num_workers, seed=seed) if num_workers else None
        self._prefetch_steps = prefetch_steps
        self._pin_memory = pin_memory
        self._params = [p for p in model.parameters() if p.requires_grad]
        # torch.compile's module: no global forward hook while it runs (_forward_abortable)
        self._compiled = type(model).__name__ == "OptimizedModule"
        # How the step's gradients are reduced and applied (gradients.py: the seam).
        self._grads = _gradient_path(shard, model, optimizer, self._params, bucket_mb, shard_replicas)
        if reduce_each_micro_batch:
            if shard != "gradients":
                raise ValueError("reduce_each_micro_batch applies to shard='gradients' (ZeRO-2), whose gradients "
                                 f"are sharded; with shard={shard!r} every rank keeps the whole gradient anyway")
            self._grads.reduces_micro_batches = True
        # reduce_each_micro_batch: micro-batches this rank runs fewer than another in the step
        # in flight (their rounds are reduced without a backward before the last: _pad_rounds)
        self._pad = 0
        if shard is not None:
            self._grads.restore_chunks = self._restore_chunks  # a restore's chunks from the shard files
        self._shard = shard
        self._redone_steps: int | None = None  # a crash lost shards: steps redone from checkpoints, in all
        self._redo_from: int | None = None  # this generation restores after lost shards: the step it was at
        # A restore takes the newest checkpoint up while its files are hashed (_find_checkpoint);
        # the first step's control tail confirms the hashes before it is taken (_restore_confirmed).
        self._pending_checks: list = []  # checkpoint.PendingCheck of what this rank restored, until confirmed
        self._restored: dict | None = None  # the checkpoint this rank restored last: path, sha256, host
        self._unconfirmed = False  # this rank's state came from a restore whose hashes are not confirmed yet
        self._check_first = False  # the last restore's checkpoint failed its hashes: check before loading
        self._buffers = gradients.BufferSync(model)
        self._after_commit: tuple[bool, set[str] | None] | None = None
        # A leave the last commit asked for and held back while the ranks prepare for it
        # (ready_for_leave).
        self._leave_seen: frozenset[str] = frozenset()
        # A checkpoint due at a boundary where a membership change went: taken at the next
        # one (this rank asks for it in the next step's control tail, CTRL_CHECKPOINT).
        self._ckpt_owed = False
        self._hooks: list = []

        # The membership state machine (generation.py): plan, rank, group; made in _enter.
        self._gen: Generations | None = None
        self._members_before: tuple[str, ...] = ()  # the previous generation's members (reshard)
        self._old_t = 0.0  # the last commit's time before the generation being formed (its event's pause)
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
        # Where a membership change's pause goes: (phase, monotonic time it ended) since the
        # last commit, logged at the new generation's first commit (_log_pause).
        self._marks: list[tuple[str, float]] = []
        self._last_status_t = 0.0
        self._last_ckpt_t = time.monotonic()
        self._ckpt_due = False  # rank 0's clock says a checkpoint is due (checkpoint_every_seconds)
        self._last_ckpt: dict | None = None
        self._last_loss: float | None = None
        self._samples_since = (0, time.monotonic())
        self._audit_fd: int | None = None
        self._ckpt = None
        self._control: ControlThread | None = None
        self._store = None  # the job's PrefixStore over _tcp (signed with the job's secret, if any)
        self._tcp = None
        self._forgeries = Forgeries()  # forged store values read, over all of this worker's connections
        self._health: storeloss.StoreHealth | None = None  # whether the store is away (storeloss.py)
        self._address: storeloss.StoreAddress | None = None  # where the store is (follows a moved keeper)
        self._store_epoch = 0  # the health's reconnects when _store was opened
        self._old_sigterm = None

    # -- the membership state machine's view --------------------------------------
    @property
    def _plan(self) -> Plan | None:
        return self._gen.plan if self._gen is not None else None

    @property
    def _rank(self) -> int:
        return self._gen.rank if self._gen is not None else -1

    @property
    def _pg(self):
        return self._gen.pg if self._gen is not None else None

    @property
    def _abort(self) -> threading.Event:
        return self._gen.abort

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

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step before clipping (max_grad_norm), else None."""
        return self._grad_norm

    def fingerprint(self) -> str:
        """Hash of parameters, buffers, optimizer state and extra state: identical on every rank."""
        return self._grads.fingerprint(self.model, self.optimizer, self._extra)

    # -- lifecycle -----------------------------------------------------------
    def __enter__(self) -> "ElasticJob":
        if self._pipeline is not None:
            # Forked first: before the job's threads, its store connections and CUDA exist.
            self._pipeline.start(pin_memory=self._pin_memory and self.config.device is Device.CUDA)
        try:
            return self._enter()
        except BaseException:
            self._stop_pipeline()
            raise

    def _stop_pipeline(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()

    def _enter(self) -> "ElasticJob":
        cfg = self.config
        if cfg.device is Device.CUDA:
            torch.cuda.set_device(cfg.local_gpu)
            self._device = torch.device("cuda", cfg.local_gpu)
            self.model.to(self._device)  # warm before registering; parameters stay the optimizer's objects
        else:
            self._device = torch.device("cpu")
        self._grads.device = self._device
        self._bind_host = collectives.bind_address(cfg.store_host, cfg.store_port)
        self._address = storeloss.StoreAddress(cfg.store_spec, cfg.run_file)
        self._tcp = self._connect_raw()
        self._store = self._job_store(self._tcp)
        if cfg.audit_path is not None:
            self._audit_fd = os.open(cfg.audit_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if cfg.checkpoint_dir is not None:
            from ..checkpoint.store import CheckpointStore

            self._ckpt = CheckpointStore(cfg.checkpoint_dir, keep=self._keep, on_committed=self._on_checkpoint)
        if cfg.max_micro_batch:
            log.info("worker %s: at most %d samples at once on this host (max_micro_batch); a larger share "
                     "runs as micro-batches", cfg.worker_id, cfg.max_micro_batch)
        self._health = storeloss.StoreHealth(cfg.worker_id, cfg.store_loss_timeout_s)
        self._control = ControlThread(self._connect, cfg.worker_id, cfg.hang_timeout_s, cfg.max_workers,
                                      health=self._health)
        self._control.start()
        hooks = GenerationHooks(before_group=self._before_group, on_group=self._on_group, on_leave=self._on_leave)
        self._gen = Generations(cfg.worker_id, lambda: self._store, self._control, hooks, device=self._device,
                                bind_host=self._bind_host, max_workers=cfg.max_workers,
                                hang_timeout_s=cfg.hang_timeout_s)
        state_mod.check_encodable(self._extra)  # an extra state that cannot travel fails here, not at a resize
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                       for i, p in enumerate(self._params)]
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: self._control.request_local_leave())
        self._admit()
        self._buffers.mark()
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
            self._stop_pipeline()
            for h in self._hooks:
                h.remove()
            self._hooks = []
            if self._control is not None:
                self._control.close()
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
            if self._audit_fd is not None:
                os.close(self._audit_fd)
            if self._gen is not None:
                self._gen.close()  # never block the exit on a group
            if self._fast_exit and exc is None and (self._left or self._finished):
                # Out of the job: the script's code after the loop still runs,
                # but the interpreter's teardown (seconds, GPU memory held) is
                # skipped. See exiting.py.
                exiting.arm()

    def _connect_raw(self):
        return storeclient.connect(self._address.spec, 60)

    def _connect(self):
        if self._health is not None and self._health.lost:
            self._address.follow()  # a reconnect: the direct mode's keeper may serve on a new port now
        return self._job_store(self._connect_raw())

    def _job_store(self, tcp):
        # the run id is read at every connect: a restarted store keeper has a new one (auth.py)
        return job_store(tcp, self.config.job, self.config.secret, self._forgeries, self.config.run_id())

    def _store_back(self) -> None:
        """The store came back after a loss (storeloss.py): a fresh client like the
        first one; rank 0 re-publishes the generation's plan and the held events."""
        self._store_epoch = self._health.reconnects
        self._tcp = self._connect_raw()
        self._store = self._job_store(self._tcp)
        if self._rank == 0 and self._plan is not None:
            storeloss.republish(self._store, self._plan, self.worker_id)
            storeloss.flush_held(self._store, self._health)

    def _await_store(self) -> None:
        """What comes next needs the store: wait while it is away (raises StoreLost
        past the store-loss timeout), with a fresh client once it is back."""
        storeloss.wait_until_back(self._health)
        if self._health.reconnects != self._store_epoch:
            self._store_back()

    def _store_lost(self, e: storeloss.StoreLost) -> None:
        """The store stayed away too long: rank 0 checkpoints (no store needed) and
        every rank ends cleanly; the next start restores the checkpoint."""
        log.error("worker %s: %s; %s at step %d and exits", self.worker_id, e,
                  "checkpointing" if self._rank == 0 else "rank 0 checkpoints", self._step)
        if not self._grads.gathers:  # sharded: the ranks may not all be here (no gather); the last checkpoint stands
            self._checkpoint_now()
        self._finished = True

    # -- the loop ------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                if not self._health.lost and self._health.reconnects != self._store_epoch:
                    try:
                        self._store_back()
                    except Exception as e:  # noqa: BLE001 - away again: tried at the next boundary
                        self._health.failed("reconnecting", e, epoch=self._store_epoch)
                self._at_boundary()
                if self._need_recovery:
                    self._recover()
            except storeloss.StoreLost as e:
                self._store_lost(e)
            if self._left or self._finished or self._done():
                self._finish()
                self._gen.done()
                return
            indices = self._indices_for(self._sampler)
            global_count = self._sampler.step_size()
            chunks = micro_chunks(indices, self._micro_limit())
            if self._grads.reduces_micro_batches and not self._agree_rounds(len(chunks)):
                continue  # the group broke: the roll call, then this step again
            if self._pipeline is not None:
                self._pipeline.want(self._upcoming_shares())
            self._global_count = global_count
            self._local_indices = indices
            self._global_indices = self._sampler.global_indices() if self._audit_fd is not None else []
            self._loss_sum = 0.0
            self._mb_left = len(chunks)
            for chunk in chunks:
                self._mb_count = len(chunk)
                self._in_step = True
                yield self._handed(self._fetch(chunk))
                if self._in_step:
                    raise RuntimeError("call job.step(loss) once per batch the job yields")

    def _agree_rounds(self, n: int) -> bool:
        """reduce_each_micro_batch: every rank runs as many reduction rounds as the rank
        with the most micro-batches in this step (ranks' shares and micro-batch limits
        differ: speed-balanced shares, a host's max_micro_batch, an out-of-memory redo);
        one with fewer reduces empty rounds before its last (_pad). One small all-reduce
        per step. False: the group broke (the step is dropped)."""
        self._pad = 0
        if self.world_size == 1:
            return True
        try:
            most = collectives.allreduce(self._pg, torch.tensor([n], dtype=torch.int64, device=self._device),
                                         self._abort, dist.ReduceOp.MAX)
        except Aborted as e:
            self._drop_step(f"the step's micro-batch count was not agreed: {e}", e.backend_error)
            return False
        self._pad = int(most[0]) - n
        return True

    def _pad_rounds(self) -> None:
        """Before the last micro-batch's backward: the rounds this rank has no micro-batch
        for (_agree_rounds), reduced from zeros. Not counted as this rank's compute time
        (its pace: balance.py)."""
        t0 = time.perf_counter()
        for _ in range(self._pad):
            self._grads.empty_round()
        self._pad = 0
        self._t_handed += time.perf_counter() - t0

    def _indices_for(self, sampler: SamplerState) -> list[int]:
        """This rank's share of the step `sampler` is at, in the current layout:
        proportional to the ranks' speeds with balancing on (balance.py), else
        equal. Every "which indices does this rank take" goes through here."""
        split = self._split_in_force()
        return sampler.local_indices(self._rank, self.world_size, split.weights, split.minimum)

    def _split_in_force(self) -> Split:
        """The split of this generation's steps; a new generation starts from
        equal shares and is re-planned at its first commit."""
        if self._split_gen != self.generation or not self._balance:
            self._split, self._split_gen = Split(minimum=self._min_share), self.generation
            self._proposal = None
        return self._split

    def _micro_limit(self) -> int | None:
        """The micro-batch size: the script's, capped by this host's
        max_micro_batch (ELTCTL_MAX_MICRO_BATCH) and by the size this rank
        last ran out of memory with (halved)."""
        limits = [m for m in (self._micro, self.config.max_micro_batch, self._oom_limit) if m]
        return min(limits) if limits else None

    def _handed(self, batch: Any) -> Any:
        """The batch goes to the script: this rank's compute time starts."""
        self._t_handed = time.perf_counter()
        return batch

    def _done(self) -> bool:
        if self._max_steps is not None and self._step >= self._max_steps:
            return True
        return self._epochs is not None and self._sampler.epoch >= self._epochs

    def _upcoming_shares(self) -> list[ShareKey]:
        """This step's chunks, then those of the next prefetch_steps steps as the
        current layout splits them (after a resize or a restore the pipeline
        drops what no longer matches)."""
        left = None if self._max_steps is None else self._max_steps - self._step
        return plan_shares(self._sampler, self._indices_for, micro=self._micro_limit(), ahead=self._prefetch_steps,
                           steps_left=left, epochs=self._epochs)

    def _fetch(self, indices: list[int]) -> Any:
        if self._pipeline is not None and indices:
            # Only ever the batch of exactly these indices at the sampler's committed place.
            s = self._sampler
            batch = self._pipeline.get(ShareKey(s.epoch, s.position, tuple(indices)))
        else:
            batch = fetch_batch(self.dataset, indices, self._collate)
        if self._device.type == "cuda":
            batch = _to(batch, self._device)
        return batch

    def step(self, loss: "torch.Tensor | Callable[[], torch.Tensor]") -> float | None:
        """Backward, gradient all-reduce, unscale and clip, optimizer step,
        commit. `loss` is the mean loss over the batch this iteration yielded,
        or a function of no arguments that computes it: then an out-of-memory
        error in the forward pass is caught too (one in backward always is), and
        the step is redone by every rank, this one in micro-batches half the
        size. Returns the global mean loss of the step, or None (a micro-batch
        before the last one, or the step was dropped: the generation was
        aborted, or a rank ran out of memory and the step is redone). Step a
        scheduler only when it returns a loss."""
        if not self._in_step:
            raise RuntimeError("job.step() called outside an iteration of the job")
        self._in_step = False
        n = self._mb_count
        rounds = self._grads.reduces_micro_batches
        if self._mb_left == 1:
            if self._pad:
                self._pad_rounds()
            # buckets are reduced as backward fills them
            self._grads.begin(self._ctrl_size() + self._buffers.size)
        elif rounds:
            self._grads.begin_round()
        aborted = None
        try:
            if n > 0 and not self._oom_retry:
                try:
                    if callable(loss):
                        with self._forward_abortable():
                            loss = loss()
                    scaled = loss * (n / self._global_count)
                    if self._scaler is not None:
                        scaled = self._scaler.scale(scaled)
                    scaled.backward()
                    self._loss_sum += float(loss.detach()) * n
                except torch.OutOfMemoryError as e:
                    loss = None
                    self._out_of_memory(n, e)
                except Aborted as e:  # a gradient hook saw the generation aborted (_grad_ready)
                    aborted = e
        finally:
            self._grads.end_backward()
            # From the batch handed over to the end of backward: the buckets'
            # all-reduces launched in backward are asynchronous, no wait is in it.
            self._compute_s += time.perf_counter() - self._t_handed
        self._mb_left -= 1
        if aborted is not None:
            self._compute_s, self._oom_retry = 0.0, 0  # as _reduce_and_commit leaves them
            self._drop_step(str(aborted), aborted.backend_error)
            return None
        if self._mb_left > 0:
            if rounds:
                self._grads.finish_round()
            return None
        return self._reduce_and_commit()

    @contextlib.contextmanager
    def _forward_abortable(self) -> Iterator[None]:
        """While the job runs the script's loss function in the last micro-batch (the form
        `job.step(lambda: ...)`): an aborted generation stops the forward pass at the next
        module call, as _grad_ready stops backward (a step it dooms would otherwise run
        through the rest of forward and the start of backward before a gradient hook saw
        it). A global forward pre-hook, registered for the call only, so that the script's
        modules carry no hook of the job's (a model pickled or deep-copied meanwhile would
        take it along). Not for a compiled model (torch.compile warns of global hooks and
        would run it an extra time)."""
        if self._mb_left != 1 or self._gen is None or self._abort is None or self._compiled:
            yield
            return
        abort = self._abort

        def pre_hook(_module, _args) -> None:
            if abort.is_set():
                raise Aborted(f"the generation was aborted during forward ({self._control.abort_reason()})")

        handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
        try:
            yield
        finally:
            handle.remove()

    def _grad_ready(self, index: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: the gradient path's (it launches the full buckets),
        after a look at the abort. In the last micro-batch's backward an aborted
        generation (a peer crashed or hung) dooms the step, whose reductions would fail
        only at their wait after backward: backward stops here instead (at world 4 on 2
        cores the rest of the step in flight was 0.25-0.45 s of a SIGKILL's pause). So does
        a reduction launched in it that has failed already (a peer's connection closed:
        gloo says so within milliseconds, the abort flag waits for the peer's report)."""
        if self._mb_left != 1:
            self._grads.grad_ready(index, p)
            return
        if self._abort.is_set():
            raise Aborted(f"the generation was aborted during backward ({self._control.abort_reason()})")
        self._grads.grad_ready(index, p)
        failed = self._grads.failed()
        if failed is not None:
            raise Aborted(f"a gradient reduction failed during backward: {failed}", backend_error=True)

    def _ctrl_size(self) -> int:
        """Control scalars at the head of the tail (_tail_len); the buffers' updates follow them."""
        return _tail_len(self.world_size)

    def _reduce_and_commit(self) -> float | None:
        W = self.world_size
        req = self._control.requests
        n_ctrl = self._ctrl_size()
        ctrl = torch.zeros(n_ctrl, dtype=torch.float32)
        lost = self._health.expired()  # the store away too long: every rank ends at this step
        # A join alone goes ahead once every rank has seen it and is ready for it (sharded:
        # has touched its next layout's host memory); a leave, a stop or the store's loss
        # does not wait for that (the joiner is admitted with them where it is queued). While
        # a leave is held back for its own preparation (ready_for_leave) the ranks prepare
        # for that one only, and a queued joiner is admitted with it.
        ctrl[gradients.CTRL_JOIN_READY] = 1.0 if req.join and not self._leave_seen \
            and self._grads.ready_for_join(W + 1) else 0.0
        ctrl[gradients.CTRL_LEAVE_READY] = 1.0 if self._grads.ready_for_leave(self._leave_seen) else 0.0
        ctrl[1] = 1.0 if req.stop or lost else 0.0
        if self._ckpt_owed or (self._rank == 0 and self._ckpt_seconds
                               and time.monotonic() - self._last_ckpt_t >= self._ckpt_seconds):
            ctrl[gradients.CTRL_CHECKPOINT] = 1.0
        ctrl[2] = float(len(self._local_indices))
        ctrl[3] = self._loss_sum
        ctrl[_N_CTRL + self._rank] = 1.0 if req.leave else 0.0
        if not self._oom_retry:
            self._pace = self._pace.observed(self._compute_s, len(self._local_indices))
        self._compute_s = 0.0
        ctrl[_pace_slot(W, self._rank)] = self._pace.slot
        ctrl[_oom_slot(W, self._rank)] = float(self._oom_retry)
        self._oom_retry = 0
        tail = self._grads.tail()
        with torch.no_grad():
            tail[:n_ctrl].copy_(ctrl)
            self._buffers.write(tail[n_ctrl:], len(self._local_indices), self._rank)
        if self._pending_event is not None:  # a generation's first step: its parts in the pause
            self._mark("first_forward_backward")
        try:
            if self._unconfirmed:  # a restore's first step: this rank's verdict on the checkpoint's hashes
                tail[gradients.CTRL_RESTORE_BAD] = self._restore_flag()
                self._mark("restore_check")  # the hashes' wait past forward and backward
            tail = self._grads.finish(self._abort)  # summed over the ranks; a CPU copy
            if self._unconfirmed and not self._restore_confirmed(tail):
                return None
        except Aborted as e:
            self._drop_step(str(e), e.backend_error)
            return None
        if self._pending_event is not None:
            self._mark("first_reduce")
        if any(tail[_oom_slot(W, r)] > 0 for r in range(W)):
            self._redo_step([int(tail[_oom_slot(W, r)]) for r in range(W)])
            return None
        self._buffers.read(tail[n_ctrl:], int(tail[2]))
        self._ckpt_due = bool(tail[gradients.CTRL_CHECKPOINT] > 0)
        self._ckpt_owed = False  # asked for in this tail (a rank admitted since asks with the rest)
        try:
            skipped = self._optimizer_step()
        except Aborted as e:  # a sharded path's collectives (norm, inf check, gather) broke
            self._drop_step(str(e), e.backend_error)
            return None
        if self._pending_event is not None:
            self._mark("first_optimizer_step")
        self._grads.zero()  # replicated: the gradients stay views of the buffers
        global_loss = float(tail[3]) / max(1.0, float(tail[2]))
        self._replan([float(tail[_pace_slot(W, r)]) for r in range(W)])
        self._commit(global_loss, skipped)
        leaving = {self._plan.members[r] for r in range(W) if tail[_N_CTRL + r] > 0}
        # A leave goes once every rank is ready for it (sharded on the CPU: the survivors have
        # touched the memory their hand-over allocates, a commit or more later; elsewhere at once).
        leave = bool(leaving) and tail[gradients.CTRL_LEAVE_READY] >= W
        change = tail[1] > 0 or leave or tail[gradients.CTRL_JOIN_READY] >= W
        leavers = leaving if change else None
        self._leave_seen = frozenset(leaving) if leaving and not change else frozenset()
        if self._leave_seen:
            self._grads.ready_for_leave(self._leave_seen)  # the survivors start preparing now
        self._after_commit = (bool(tail[1] > 0), leavers)
        return global_loss

    def _optimizer_step(self) -> bool:
        """Unscale, clip, the hook, the optimizer step, all through the gradient
        path, so every rank decides alike (the global norm, an inf/NaN in any
        rank's gradients). Returns True if the GradScaler skipped the step."""
        scaler = self._scaler
        if scaler is not None:
            self._grads.unscale_(scaler, self.optimizer)
        if self._max_grad_norm is not None:
            self._grad_norm = self._grads.clip_grad_norm_(self._max_grad_norm, self._abort)
        if self._before_optimizer_step is not None:
            self._before_optimizer_step(self)
        skipped = self._grads.step(self.optimizer, scaler, self._abort)
        if self._max_grad_norm is not None and getattr(self._grads, "grad_norm", None) is not None:
            self._grad_norm = self._grads.grad_norm  # sharded: the norm summed over the shards in its step
        return skipped

    def _at_boundary(self) -> None:
        """What the last commit asks for, done when the loop comes back for the
        next batch, so that the state saved or handed over includes what the
        script did after job.step() (its scheduler step): a checkpoint, a stop,
        a membership change."""
        after, self._after_commit = self._after_commit, None
        if after is None:
            return
        stop, leavers = after
        defer = leavers is not None and not stop and self._checkpoint_due()
        if defer:
            # A membership change goes at this boundary: the checkpoint due here goes at the
            # next one, so the two pauses do not add up (a sharded checkpoint held the boundary
            # 1.3-3.8 s at world 4 here, and a change that fell on it paid both). Nothing is at
            # risk meanwhile: a leaver hands its state over, and a job every member leaves
            # checkpoints in on_leave.
            self._ckpt_due, self._ckpt_owed = False, True
            log.info("worker %s: the checkpoint of step %d moves to the next boundary (a membership change "
                     "goes at this one)", self.worker_id, self._step)
        try:
            if not defer:
                self._maybe_checkpoint(time.monotonic())
        except Aborted as e:  # sharded: a rank died while the shards went to the writer
            log.warning("worker %s: checkpoint of step %d abandoned in generation %d (the newest one stands): %s",
                        self.worker_id, self._step, self.generation, e)
            self._peer_gone = e.backend_error
            self._need_recovery = True
            return  # a stop or a leave still asked for is seen again at the next commit
        if stop:
            self._stop_job()
        elif leavers is not None:
            try:
                self._planned_change(leavers)
            except Aborted as e:
                log.warning("worker %s: generation %d aborted while forming: %s", self.worker_id,
                            self.generation, e)
                self._need_recovery = True

    def _replan(self, paces: list[float]) -> None:
        """At a commit: every rank's pace, identical floats on every rank, and
        the split of the next steps planned from them (the same on every rank)."""
        W = self.world_size
        self._last_counts = self._split_in_force().counts(self._global_count, W)
        self._last_paces = paces
        if self._balance:
            total = self._sampler.global_batch
            cand = self._split.replanned(paces, total)
            now, new = self._split.counts(total, W), cand.counts(total, W)
            if new == now:
                self._split, self._proposal = cand, None
                return
            # A new split is adopted only once the same one has been proposed at
            # CONFIRM_COMMITS commits in a row: measured paces are noisy (on a busy
            # machine two equal ranks swap a few samples back and forth), and every
            # change costs the shares the input pipeline has prefetched.
            seen = self._proposal[1] + 1 if self._proposal and self._proposal[0] == new else 1
            if seen >= CONFIRM_COMMITS:
                self._split, self._proposal = cand, None
            else:
                self._proposal = (new, seen)

    def _out_of_memory(self, n: int, error: Exception) -> None:
        """This rank ran out of memory on `n` samples: the step goes on without
        its gradient (every rank still issues the same collectives) and is
        redone by every rank, this one in micro-batches half the size."""
        if n <= 1:
            raise error  # nothing smaller to try
        self._oom_retry = (n + 1) // 2
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("worker %s: out of memory on %d samples at step %d; the step is redone in micro-batches "
                    "of at most %d", self.worker_id, n, self._step + 1, self._oom_retry)

    def _redo_step(self, limits: list[int]) -> None:
        """A rank ran out of memory (its out-of-memory slot holds its new micro-batch
        size): nothing of this step is applied; the same step comes again."""
        mine = limits[self._rank]
        if mine:
            self._oom_limit = min(mine, self._oom_limit or mine)
        self._grads.zero()
        self._buffers.reset()  # the forward of the step that is redone moved them
        log.info("worker %s: step %d redone (out of memory on rank(s) %s)", self.worker_id, self._step + 1,
                 ", ".join(str(r) for r, m in enumerate(limits) if m))

    def _drop_step(self, why: str, backend_error: bool = False) -> None:
        self._peer_gone = backend_error
        log.warning("worker %s: step %d dropped in generation %d: %s (%s)", self.worker_id, self._step + 1,
                    self.generation, why, self._control.abort_reason())
        self._discard_step()
        self._need_recovery = True
        self._mark("dropped_step")

    def _discard_step(self) -> None:
        """Forget a step not taken: its gradients and what its forward did to the buffers."""
        self._grads.drop()  # a collective that never finished may still write into its buffers
        self.optimizer.zero_grad(set_to_none=True)
        self._buffers.reset()  # the step's forward moved them

    def _commit(self, global_loss: float, skipped: bool = False) -> None:
        now = time.monotonic()
        self._step += 1
        self._last_commit = Commit(self._step, self.generation, self.world_size, time.time(), global_loss, skipped)
        if self._audit_fd is not None:
            line = json.dumps({"step": self._step, "epoch": self._sampler.epoch, "generation": self.generation,
                               "world_size": self.world_size, "rank": self._rank, "worker": self.worker_id,
                               "indices": self._local_indices, "step_indices": self._global_indices,
                               "split": self._last_counts}) + "\n"
            os.write(self._audit_fd, line.encode())
        n_done, since = self._samples_since
        self._samples_since = (n_done + self._global_count, since)
        self._sampler = self._sampler.advanced()
        self._last_loss = global_loss
        if self._pending_event is not None:
            self._log_pause(now)
            self._emit_event(now)
        self._marks = []
        self._last_commit_t = now
        if self._rank == 0 and now - self._last_status_t >= STATUS_EVERY_S:
            self._write_status(now)

    # -- membership changes --------------------------------------------------
    def _planned_change(self, leavers: set[str]) -> None:
        self._await_store()
        kind = EventKind.LEAVE if leavers else EventKind.JOIN
        self._mark("boundary")
        decided = self._gen.change(leavers, kind)  # None: every member leaves (on_leave)
        self._mark("plan")
        if decided is not None:
            self._old_t = self._last_commit_t
            self._gen.enter(decided)

    def _stop_job(self) -> None:
        if self._health.lost:  # a rank's store-loss timeout (_reduce_and_commit), or the store away now
            self._store_lost(storeloss.StoreLost(f"the store is away ({self._health.lost_for():.0f} s)"))
            return
        log.info("worker %s: stop requested; ending at step %d", self.worker_id, self._step)
        self._checkpoint_now()
        if self._rank == 0:
            self._event({"kind": EventKind.STOP.value, "generation": self.generation, "step": self._step})
            self._write_status(time.monotonic())
            self._store.set(Keys.DONE, json.dumps({"step": self._step, "reason": "stop"}))
        self._finished = True

    def _recover(self) -> None:
        """Roll call after an abort, then the next generation (generation.py)."""
        self._need_recovery = False
        self._await_store()
        peer_gone, self._peer_gone = self._peer_gone, False
        while True:
            t_old = self._last_commit_t
            decided = self._gen.recover(peer_gone, str(self._step))
            self._mark("roll_call")
            try:
                self._old_t = t_old
                self._gen.enter(decided)
                return
            except Aborted as e:
                log.warning("worker %s: generation %d aborted while forming: %s", self.worker_id,
                            self.generation, e)

    # -- the membership state machine's hooks (generation.GenerationHooks) ------------
    def _before_group(self, plan: Plan) -> None:
        """The old group is about to go: a planned leaver's shards move to the survivors
        over it first (sharded; the leaver does the same in on_leave), then the gradient
        path lets go of it (collectives.release)."""
        if plan.left and not plan.lost:
            self._grads.hand_over(plan.left)
            self._mark("hand_over")
        self._grads.pg = None

    def _on_group(self, plan: Plan) -> None:
        """The group is formed and checked: bind the gradient path, agree on the
        state, move the shards (replicated: nothing), note the generation's event."""
        self._mark("group")  # the old group released, the new one formed and its pairs checked
        self._leave_seen = frozenset()
        self._grads.bind(self._pg, self._rank, plan.members, self._abort)
        restored = self._sync_state()
        self._mark("state")  # the state agreed (a step dropped halfway settled in _sync_state)
        self._grads.reshard(self._members_before, plan.members)
        self._mark("reshard")
        # After a restore the checkpoint's hashes are confirmed in the first step's control
        # tail (_restore_flag, _restore_confirmed): the hashing overlaps that step's forward
        # and backward instead of holding the pause (0.43-0.45 s of a world-4 SIGKILL's here).
        self._members_before = plan.members
        # Every generation's first commit is an event (rank 0 writes it), the job's first start too.
        kind = EventKind.RESTORE if restored else plan.kind
        redo_from, self._redo_from = self._redo_from, None
        if redo_from is not None:
            self._redone_steps = (self._redone_steps or 0) + max(0, redo_from - self._step)
        self._pending_event = {"kind": kind.value, "generation": plan.generation,
                               "world_size": plan.world_size, "members": list(plan.members),
                               "joined": list(plan.joined), "left": list(plan.left), "lost": list(plan.lost),
                               "from_step": self._step, "old_t": self._old_t if self._has_state_before else None}
        if self._shard is not None:
            self._pending_event.update(self._shard_fields())
            if redo_from is not None:
                self._pending_event["redone_steps"] = max(0, redo_from - self._step)
        log.info("worker %s: rank %d of %d in generation %d (%s) at step %d", self.worker_id, self._rank,
                 plan.world_size, plan.generation, plan.kind.value, self._step)

    def _on_leave(self, plan: Plan | None) -> None:
        if plan is None:
            # Everyone is leaving: keep the newest state on disk and end the job.
            log.info("worker %s: every member leaves at step %d; the job pauses", self.worker_id, self._step)
            self._checkpoint_now()
            if self._rank == 0:  # the controller mirrors it and restores from it; no member holds the state now
                self._write_status(time.monotonic(), paused=True)
        else:
            self._grads.hand_over(plan.left)  # sharded: this leaver's chunks go to their new holders first
            log.info("worker %s: left the job at step %d (generation %d)", self.worker_id, self._step,
                     plan.generation)
        self._left = True

    def _sync_state(self) -> bool:
        """Agree on the training state; returns True if it came from a checkpoint."""
        if self._unconfirmed:
            # The generation of a restore broke before the checkpoint's hashes were confirmed
            # (_restore_confirmed): what this rank took up (read, or received from the
            # restoring rank) is not trusted; the checkpoint is restored again.
            log.warning("worker %s: the restore's generation broke before the checkpoint's hashes were "
                        "confirmed; what it took up is dropped and the checkpoint restored again", self.worker_id)
            self._unconfirmed = False
            self._has_state = False
            self._check_pending()
        self._has_state_before = self._has_state
        # Each rank: whether it holds the state (sharded: its chunks too), its step, and
        # which state its part is of (gradients.GradientPath.state_key).
        key = self._grads.state_key()
        has = self._has_state and key is not None
        report = torch.tensor([int(has), self._step, key or 0], dtype=torch.int64, device=self._device)
        got = [tuple(int(x) for x in t.cpu()) for t in collectives.allgather(self._pg, report, self._abort)]
        reports = [(bool(h), s) for h, s, _k in got]
        why = self._state_incomplete(got, has)
        if why:
            # Part of the optimizer state has no holder (a crash with shard_replicas=1, a
            # rank back without its chunks, a reshard that broke halfway): every rank drops
            # its state, so the newest checkpoint is restored (steps redone).
            log.warning("worker %s: %s; restoring the newest checkpoint", self.worker_id, why)
            self._redo_from = max(s for h, s, _k in got if h)
            self._has_state = False
            reports = [(False, s) for _h, s, _k in got]
        # Sharded: a step this rank dropped after its shard stepped is kept if a rank holding
        # the state committed it, else undone, before this rank's state is sent anywhere.
        self._grads.settle(self._step, max((s for has, s in reports if has), default=self._step))
        transfer = choose_source(reports)
        if not transfer.needed:
            return False
        restored = False
        if transfer.restore:
            restored = self._restore_together(transfer.source)
        else:
            self._send_state(transfer.source, receivers(reports, transfer))
        self._has_state = True
        self._unconfirmed = restored  # until the first step's tail confirms it (_restore_confirmed)
        return restored

    def _restore_together(self, src: int) -> bool:
        """No rank holds the state: rank `src` restores the newest checkpoint; every other
        rank that can read that same checkpoint (on the source's host, or shared storage)
        takes the state from it itself, and only the rest receive it from the source (at
        world 4 on 2 cores, receiving the 50 M-parameter model took 0.8 s of a SIGKILL's
        pause). No checkpoint: the source's own state goes to every rank (a first start).
        Returns whether a checkpoint was restored. The source says which checkpoint before
        it takes it up, so every rank reads it at once (at world 4 on 2 cores the others
        waited 0.1-0.15 s for the source's take-up)."""
        found = self._find_checkpoint() if self._rank == src else None
        # Another optimizer class's checkpoint: every rank stops, with the source's reason.
        refused = found and state_mod.optimizer_mismatch(
            found[1].get("optimizer_class"), state_mod.optimizer_class(self.optimizer), found[0].path)
        if self.world_size > 1:
            told = self._broadcast_json({"refused": refused} if refused else (self._restored if found else None), src)
            refused, desc = (told["refused"], None) if told and "refused" in told else (None, told)
        else:
            desc = None
        if refused:
            raise state_mod.OptimizerMismatch(refused)
        if found is not None:
            self._take_up_found(*found)
        if self.world_size == 1:
            return found is not None
        local = self._rank != src and desc is not None and self._restore_here(desc)
        flags = torch.zeros(self.world_size, dtype=torch.int64, device=self._device)
        flags[self._rank] = int(local)
        flags = collectives.allreduce(self._pg, flags, self._abort).cpu()
        self._send_state(src, [r for r in range(self.world_size) if r != src and not flags[r]])
        return desc is not None

    def _broadcast_json(self, obj: Any, src: int) -> Any:
        """A small JSON value from rank `src` to every rank."""
        data = json.dumps(obj).encode() if self._rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        size = collectives.broadcast(self._pg, size.to(self._device), src, self._abort).cpu()
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self._rank == src
               else torch.zeros(int(size[0]), dtype=torch.uint8))
        buf = collectives.broadcast(self._pg, buf.to(self._device), src, self._abort).cpu()
        return json.loads(bytes(state_mod.tensor_bytes(buf)))

    def _send_state(self, src: int, need: list[int]) -> None:
        """The source's state to the ranks of `need` (the others hold it already, or took it
        from the checkpoint themselves)."""
        if not need:
            return
        if self._rank == src:
            header, flat = state_mod.pack(self._capture_state())
            sizes = torch.tensor([len(header), flat.numel()], dtype=torch.int64)
            hbuf = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        # Only some ranks lack the state (a join, a rank that missed a commit, a restore's
        # ranks that cannot read the checkpoint): on gloo the source sends it to them alone.
        # A broadcast would have every member receive it, the members that hold it already
        # included (at world 4 on 2 cores, a join's 600 MB to three ranks: 4-7 s against
        # 1.6-2.7 s at world 2). NCCL keeps the broadcast (its pair streams would be formed
        # here, in the pause); the members skip the unpack either way.
        p2p = self._device.type == "cpu" and len(need) < self.world_size - 1
        if p2p and self._rank != src and self._rank not in need:
            return

        def move(t: torch.Tensor, tag: int) -> torch.Tensor:
            """`t` from the source to the receivers (the source's own comes back)."""
            if not p2p:
                return collectives.broadcast(self._pg, t.to(self._device), src, self._abort).cpu()
            works = ([collectives.send(self._pg, t, r, tag) for r in need] if self._rank == src
                     else [collectives.recv(self._pg, t, src, tag)])
            collectives.wait_p2p(works, self._abort, "the state's transfer")
            return t

        sizes = move(sizes if self._rank == src else torch.zeros(2, dtype=torch.int64), 0)
        if self._rank != src:
            hbuf = torch.empty(int(sizes[0]), dtype=torch.uint8)
            flat = torch.empty(int(sizes[1]), dtype=torch.uint8)
        hbuf, flat = move(hbuf, 1), move(flat, 2)
        if self._rank in need:  # a member at the source's step holds its state already
            self._apply_state(state_mod.unpack(state_mod.tensor_bytes(hbuf), flat))

    def _check_pending(self) -> bool:
        """Wait for the hashes of the checkpoint this rank restored from, if any are being
        checked; False (and the next restore checks before it loads) if a file differs."""
        checks, self._pending_checks = self._pending_checks, []
        if not checks:
            return True
        from ..checkpoint.store import InvalidCheckpoint

        ok = True
        for check in checks:  # every one waited for: none is left hashing
            try:
                check.confirm()
            except InvalidCheckpoint as exc:
                log.warning("worker %s: the checkpoint restored is damaged (%s); its state is dropped for the "
                            "newest checkpoint that verifies", self.worker_id, exc)
                ok = False
        if not ok:
            self._check_first = True
        return ok

    def _restore_flag(self) -> float:
        """A restore's first step, its backward done: 1.0 if a file of the checkpoint this
        rank took up, hashed in the background since (checkpoint.restore_chunks), differs
        from its manifest; it goes in the step's control tail (CTRL_RESTORE_BAD)."""
        return 0.0 if self._check_pending() else 1.0

    def _restore_confirmed(self, tail: "torch.Tensor") -> bool:
        """A restore's first step, its control tail summed over the ranks: True if no rank
        found a file of the checkpoint damaged. Else the step is not taken: every rank drops
        what it took up and the source restores the newest checkpoint that verifies, checked
        before it is loaded (every rank sees the flag alike, so none steps alone)."""
        self._unconfirmed = False
        if tail[gradients.CTRL_RESTORE_BAD] <= 0:
            return True
        self._check_first = True  # after a damaged one, every rank checks before it loads
        log.warning("worker %s: the checkpoint restored is damaged on a rank; step %d is not taken and the "
                    "newest checkpoint that verifies is restored", self.worker_id, self._step + 1)
        self._discard_step()
        had_state = self._has_state_before
        self._has_state = False
        self._sync_state()  # Aborted: the step is dropped; the recovery restores (this rank holds no state)
        self._grads.reshard(self._members_before, self._members_before)
        self._has_state_before = had_state
        if self._pending_event is not None:
            self._pending_event["from_step"] = self._step
        return False

    def _capture_state(self) -> dict:
        """The training state as data (state.capture, through the gradient path):
        what a joiner receives and a checkpoint holds."""
        return self._grads.capture(self.model, self.optimizer, self._progress(), self._extra)

    def _apply_state(self, saved: dict) -> None:
        """Adopt a captured state (from a peer or a checkpoint), progress included."""
        self._set_progress(self._grads.apply(saved, self.model, self.optimizer, self._extra))
        self._buffers.mark()

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
        cfg = self.config
        self._mark("join_request")  # a joiner's logged phases start here: its wait to be admitted is one
        with self._preparing_join():
            plan = self._gen.admit(min_workers=cfg.min_workers, restarted_wait_s=cfg.store_loss_timeout_s)
        self._mark("admitted")
        if plan is None:
            self._finished = True
            return
        # A joiner of a running job has no committed step; members of the first
        # generation agree on one (restoring the newest checkpoint) in on_group.
        try:
            self._old_t = 0.0
            self._gen.enter(plan)
        except Aborted as e:
            log.warning("worker %s: generation %d aborted while forming: %s", self.worker_id,
                        plan.generation, e)
            self._recover()

    @contextlib.contextmanager
    def _preparing_join(self) -> Iterator[None]:
        """Before a joiner of a running job (its status names the members) asks to be
        admitted, its gradient path prepares the layout it will most likely join, of one
        member more (sharded: touches its host memory), on a helper thread that holds it
        until the wait is over. The request goes in once it is prepared: the members are
        admitted to nothing the joiner could have done before asking (touched after the
        request, a joiner's first 500 MB on a VM were still faulting in when the members
        reached the reshard, and they waited for it there: 1 s of the pause). Not where the
        job has no room for it (it may wait long)."""
        status = self._read(get_status)
        world = status.get("world_size") if isinstance(status, dict) and not status.get("paused") else None
        full = self.config.max_workers is not None and isinstance(world, int) and world >= self.config.max_workers
        if not isinstance(world, int) or world < 1 or full:
            yield  # no running job, or no room in it: this joiner may wait long
            return
        stop, prepared = threading.Event(), threading.Event()

        def prepare() -> None:
            try:
                self._grads.prepare_join(world + 1, stop, prepared)
            except Exception as e:  # noqa: BLE001 - an optimization: the join goes on without it
                log.warning("worker %s: preparing to join failed (the join goes on without it): %s",
                            self.worker_id, e)
            finally:
                prepared.set()

        helper = threading.Thread(target=prepare, name="eltctl-prepare-join", daemon=True)
        helper.start()
        try:
            prepared.wait()
            yield
        finally:
            stop.set()
            helper.join()

    # -- checkpoints, status, events ----------------------------------------
    def _maybe_checkpoint(self, now: float) -> None:
        """Every rank calls it at a boundary (sharded: the state is gathered); rank 0 writes.
        Due by steps, or by rank 0's clock (it rode the last commit's tail: _ckpt_due)."""
        if self._ckpt is None:
            return
        due = self._checkpoint_due()
        self._ckpt_due = False
        if due:
            self._last_ckpt_t = now
            self._save_checkpoint()

    def _checkpoint_due(self) -> bool:
        """A checkpoint is due at the coming boundary (the same on every rank: the step, or
        rank 0's clock through the last commit's tail)."""
        return self._ckpt is not None and bool((self._ckpt_steps and self._step % self._ckpt_steps == 0)
                                               or self._ckpt_due)

    def _checkpoint_now(self) -> None:
        """Every rank calls it (sharded: a collective); rank 0 writes and waits."""
        if self._ckpt is not None and self._has_state:
            try:
                self._save_checkpoint()
            except Aborted as e:  # sharded: a rank died during the transfer; nothing partial was written
                log.error("worker %s: the checkpoint of step %d was not written (the newest one stands): %s",
                          self.worker_id, self._step, e)
                return
            if self._rank == 0:
                self._ckpt.wait()

    def _save_checkpoint(self) -> None:
        """Every rank calls it at the same step. Sharded: each rank's chunk of the
        optimizer state becomes its own file under rank 0's one manifest
        (checkpoint.save_sharded; the full state is never gathered); replicated: rank 0
        writes the whole state. Both go on on rank 0's writer thread."""
        if self._grads.gathers:
            state = self._grads.shard_checkpoint_state(self.model, self._progress(), self._extra)
            if state is not None:
                from ..checkpoint.store import save_sharded

                g = self._grads
                save_sharded(self._step, state, g.sg, g.pg, hosts=[m.host for m in g.layout.members],
                             directory=self._ckpt.directory, store=self._ckpt if self._rank == 0 else None,
                             writer=0, abort=self._abort)
                return
        state = self._checkpoint_state()
        if state is not None:
            self._ckpt.save_async(self._step, state)

    def _checkpoint_state(self) -> dict | None:
        """What a checkpoint holds, on rank 0 (None elsewhere): one plain full state
        dict; a sharded path gathers it (ShardedGradients.full_state_dict: every rank
        takes part), so restore at any world size and export work alike."""
        if self._grads.gathers:
            full = self._grads.capture_full(self.model, self.optimizer, self._progress(), self._extra)
            return full if self._rank == 0 else None
        return self._capture_state() if self._rank == 0 else None

    def _state_incomplete(self, got: list[tuple[int, ...]], has: bool) -> str | None:
        """Why the ranks holding the state do not hold all of it, or None; the same answer
        on every rank. `got`: every rank's (holds the state, step, state_key). Replicated
        (every key 0), the first layout and a restore still pending lose nothing. Ranks
        whose chunks are of different layouts cannot move them consistently. Else, where
        ranks crashed or came back without their chunks, only the holders can tell whether
        a chunk lost every holder: one small all-reduce."""
        keys = {k for h, _s, k in got if h and k != 0}
        if len(keys) > 1:
            return "the ranks holding optimizer-state shards hold them of different layouts"
        if not keys or min(keys) < 0:
            return None
        back = [m for m, (h, _s, _k) in zip(self._plan.members, got) if not h]
        gone = [*self._plan.lost, *back]
        if not gone:
            return None
        flag = torch.tensor([1.0 if has and self._grads.state_lost(gone) else 0.0], dtype=torch.float64,
                            device=self._device)
        if float(collectives.allreduce(self._pg, flag, self._abort, dist.ReduceOp.MAX)[0]) == 0.0:
            return None
        said = [f"the crash of {', '.join(self._plan.lost)}"] if self._plan.lost else []
        said += [f"{', '.join(back)} without their state"] if back else []
        return f"{' and '.join(said)} left optimizer-state shards with no holder"

    def _find_checkpoint(self) -> tuple[Any, dict] | None:
        """The newest checkpoint to restore (its info, and its state mapped or loaded, not
        yet taken up: _take_up_found), or None; `self._restored` says which, for the others."""
        if self._ckpt is None:
            return None
        self._await_newest_checkpoint()
        # Sharded: state.pt is mapped (its tensors go straight into the model) and the optimizer
        # state is not assembled: each rank takes its own chunks from the shard files at reshard
        # (ShardedPath._restore_chunks), so the full state is neither built nor sent.
        sharded = self._shard is not None
        # The newest checkpoint is taken up while its files are hashed (confirmed in the first
        # step's control tail: _restore_confirmed); after one failed, checked before it is loaded.
        if self._check_first:
            found = self._ckpt.latest_valid(assemble=not sharded, mmap=sharded)
            if found is None:
                from ..checkpoint.store import CheckpointError

                raise CheckpointError(
                    f"the newest checkpoint in {self._ckpt.directory} was damaged (see the warning above) and "
                    f"no older one there verifies: the model now holds the damaged one's values, so the job "
                    f"cannot go on from them. Move the step-* directories there away to start from step 0, "
                    f"or put a good checkpoint there (eltctl checkpoints)")
            info, saved = found
        else:
            found = self._ckpt.latest_for_restore(assemble=not sharded, mmap=sharded)
            if found is None:
                return None
            info, saved, check = found
            if check is not None:
                self._pending_checks.append(check)
        # What the other ranks are told (_restore_together); for a sharded checkpoint also what
        # each rank's chunks come from at reshard (checkpoint.restore_chunks).
        from ..checkpoint.store import restore_identity

        self._restored = {"path": str(info.path), "sha256": info.sha256, "host": self._host,
                          **restore_identity(info.path)}
        self._mark("restore_read")
        return info, saved

    def _take_up_found(self, info: Any, saved: dict) -> None:
        """Adopt the checkpoint _find_checkpoint found."""
        self._take_up(saved, self._restored)
        self._on_checkpoint(info)  # the job's last checkpoint until it writes a newer one (status shows it)
        log.info("worker %s: restored step %d from %s", self.worker_id, info.step, info.path)

    def _restore_chunks(self, ckpt: dict, sg: Any, pg: Any, host: str, abort: threading.Event) -> dict:
        """The sharded path's loader (checkpoint.restore_chunks): each rank's chunks from the
        restored checkpoint's shard files; on another host than the restoring rank's, the
        files it reads are hashed meanwhile and confirmed with the rest of the restore."""
        from ..checkpoint.store import restore_chunks

        return restore_chunks(ckpt, sg, pg, host, abort, checks=None if self._check_first else self._pending_checks)

    @property
    def _host(self) -> str:
        return self.worker_id.split("/", 1)[0]

    def _take_up(self, saved: dict, desc: dict) -> None:
        """Adopt a checkpoint's state (`desc`: which checkpoint, where it was read)."""
        if self._shard is not None:
            from ..checkpoint.store import is_sharded

            if is_sharded(desc["path"]):
                saved["optimizer"] = {**saved["optimizer"], "checkpoint": dict(desc)}
        self._apply_state(saved)

    def _restore_here(self, desc: dict) -> bool:
        """A rank other than the restoring one takes the restored checkpoint (`desc`) up
        itself if it can read it: the same state.pt at the same path (the restoring rank's
        host, or shared storage). On another host it hashes what it reads meanwhile, or
        first after a damaged checkpoint (_check_first); on that host, or reading the very
        same directory on the same machine (checkpoint.covered_by_restorer), the restoring
        rank's hashes cover it (at world 4 on 2 cores, three ranks each hashing what they
        read took CPU from every rank's restore). False: it receives the state from the
        restoring rank."""
        from ..checkpoint.store import InvalidCheckpoint, covered_by_restorer, load_restored

        sharded = self._shard is not None
        try:
            found = load_restored(desc["path"], desc["sha256"], assemble=not sharded, mmap=sharded,
                                  verify=not covered_by_restorer(desc, self._host), defer=not self._check_first)
        except InvalidCheckpoint as exc:
            log.warning("worker %s: cannot take the restored checkpoint up here (%s); it comes from the "
                        "restoring rank", self.worker_id, exc)
            return False
        if found is None:
            return False  # not on this host: it comes from the restoring rank
        saved, check = found
        if check is not None:
            self._pending_checks.append(check)
        self._take_up(saved, desc)
        log.info("worker %s: took step %s up from %s itself", self.worker_id, saved.get("progress", {}).get("step"),
                 desc["path"])
        return True

    def _read(self, get):
        """`get(store)` (protocol.get_status, get_restored), or None when it fails (unreadable,
        forged, the store away): advisory here."""
        try:
            return get(self._store)
        except Exception:  # noqa: BLE001 - advisory: None
            return None

    def _await_newest_checkpoint(self) -> None:
        """A start with no member holding the state restores this host's newest checkpoint.
        When the job's last members paused it (every one left) and their status names a
        newer checkpoint, that one lies on another host: the last member left from there
        (its owner came) while this worker was starting. Wait, up to
        RESTORE_WAIT_S, for eltctl's controller to deliver it here (it restores before
        a start with no survivor, then writes Keys.RESTORED); restoring the older one
        would redo every step in between."""
        status = self._read(get_status)
        if not isinstance(status, dict) or not status.get("paused"):
            return  # not a job its last members paused (a first start, the loss of every host, lost shards)
        want = (status.get("checkpoint") or {}).get("step")
        if not isinstance(want, int):
            return
        host = self._host

        def newest() -> int:
            return max((i.step for i in self._ckpt.list()), default=-1)

        def delivered(rec) -> bool:  # the controller restored for this host and delivered `have`
            return isinstance(rec, dict) and host in (rec.get("targets") or ()) and rec.get("step") == have

        have, rec0 = newest(), self._read(get_restored)
        if have >= want or delivered(rec0):
            return
        log.warning("worker %s: the job's newest checkpoint is step %d, this host's is %s: waiting up to %.0f s "
                    "for eltctl to deliver it", self.worker_id, want, have if have >= 0 else "none", RESTORE_WAIT_S)
        end = time.monotonic() + RESTORE_WAIT_S
        while time.monotonic() < end and not self._abort.is_set():
            time.sleep(0.5)
            have, rec = newest(), self._read(get_restored)
            if have >= want or (rec != rec0 and delivered(rec)):
                log.info("worker %s: step %d is here now", self.worker_id, have)
                return
        log.error("worker %s: step %d did not arrive in %.0f s; restoring this host's newest (%s): the steps "
                  "in between are redone", self.worker_id, want, RESTORE_WAIT_S, have if have >= 0 else "none")

    def _on_checkpoint(self, info) -> None:  # writer thread
        self._last_ckpt = {"step": info.step, "time": info.created, "path": str(info.path)}

    def _finish(self) -> None:
        if self._finished or self._left:
            return
        self._finished = True
        self._checkpoint_now()
        if self._rank == 0:
            try:
                self._await_store()
            except storeloss.StoreLost as e:
                log.error("worker %s: %s; the job's end is not recorded in the store", self.worker_id, e)
                return
            self._write_status(time.monotonic())
            self._store.set(Keys.DONE, json.dumps({"step": self._step, "reason": "finished"}))

    def _write_status(self, now: float, paused: bool = False) -> None:
        n, since = self._samples_since
        rate = n / (now - since) if now > since else 0.0
        self._samples_since = (0, now)
        self._last_status_t = now
        status = status_document(generation=self.generation, world_size=self.world_size,
                                 members=self._plan.members, step=self._step, epoch=self._sampler.epoch,
                                 position=self._sampler.position, samples_per_s=round(rate, 2),
                                 loss=self._last_loss, checkpoint=self._last_ckpt, workers=self._workers_report(),
                                 forged=self._forgeries.counts(),
                                 extra={**self._progress_fields(),
                                        **(self._shard_fields() if self._shard is not None else {})})
        if paused:
            status["paused"] = True  # every member left: the members named hold nothing any more
        try:
            self._store.set(Keys.STATUS, json.dumps(status))
        except Exception as e:  # noqa: BLE001 - status is advisory (counted and logged once: storeloss.py)
            self._health.failed("status", e, epoch=self._store_epoch)

    def _progress_fields(self) -> dict:
        """`eltctl status`'s progress: `total_steps`, the step the training ends at (max_steps
        or the epochs' steps, the fewer; null when neither bounds it), and `samples`, the
        samples committed since the training began (its samples/s: the controller's rate
        over recent commits, observe.py)."""
        s = self._sampler
        ends = [self._max_steps] if self._max_steps is not None else []
        if self._epochs is not None:
            ends.append(self._epochs * -(-s.n_samples // s.global_batch))
        return {"total_steps": min(ends) if ends else None, "samples": s.epoch * s.n_samples + s.position}

    def _shard_fields(self) -> dict:
        """Sharded training in the status document and the events: the mode, the
        replicas, each rank's optimizer-state bytes (from the layout) and the steps
        redone after crashes that lost shards."""
        return {"shard": self._shard, "shard_replicas": self._grads.replicas,
                "optimizer_state_bytes": self._grads.state_bytes_per_rank(),
                "redone_steps": self._redone_steps or 0}

    def _workers_report(self) -> dict | None:
        """Each member's share and speed as of the last commit (balance.worker_report)."""
        members = self._plan.members
        if len(self._last_paces) != len(members):
            return None  # no step committed in this generation yet
        return worker_report(members, self._last_counts, self._last_paces, self._sampler.global_batch)

    def _mark(self, phase: str) -> None:
        """A phase of a membership change's pause ended now (logged by _log_pause)."""
        self._marks.append((phase, time.monotonic()))

    def _log_pause(self, now: float) -> None:
        """At a generation's first commit, every rank: where the pause since its last
        commit went, phase by phase (seconds; benchmarks/_eltctl_side.py reads the line)."""
        marks, start = self._marks + [("commit", now)], self._old_t if self._has_state_before else 0.0
        phases, t = [], start or marks[0][1]
        for name, at in marks:
            phases.append((name, round(at - t, 4)))
            t = at
        log.debug("worker %s: generation %d pause phases %s", self.worker_id, self.generation,
                 json.dumps({"total": round(now - (start or marks[0][1]), 4), "phases": phases}))

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
        try:
            add_event(self._store, ev)
        except Exception as e:  # noqa: BLE001 - the store is away: appended when it is back (storeloss.py)
            self._health.failed("event", e, epoch=self._store_epoch)
            self._health.hold(ev)
        log.info("worker %s: event %s", self.worker_id, json.dumps(ev))


SHARD_SETTINGS = ("optimizer", "gradients")  # ZeRO-1, ZeRO-2 (issue 22): runtime/zero.py


def _gradient_path(shard: str | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   params: list[torch.Tensor], bucket_mb: float, replicas: int = 1) -> GradientPath:
    """The gradient path of `shard` (gradients.py: the seam). None: every rank holds
    every gradient and the whole optimizer state (ReplicatedPath); a sharded one
    comes from zero.py's `sharded_path(shard, model, optimizer, params, bucket_mb)`."""
    if shard is None:
        if replicas != 1:
            raise ValueError("shard_replicas applies to sharded training (shard='optimizer' or 'gradients')")
        return ReplicatedPath(params, bucket_mb)
    if shard not in SHARD_SETTINGS:
        raise ValueError(f"shard must be None or one of {', '.join(map(repr, SHARD_SETTINGS))}, got {shard!r}")
    from .zero import sharded as zero  # only a sharded job pays for importing it

    return zero.sharded_path(shard, model, optimizer, params, bucket_mb, replicas)


def _check_extra_state(extra_state: dict[str, Any] | None, grad_scaler: Any) -> dict[str, Any]:
    """The stateful objects that travel with model and optimizer, by name (the
    GradScaler among them, as "grad_scaler")."""
    extra = dict(extra_state or {})
    for name, obj in extra.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"extra_state names must be non-empty strings, got {name!r}")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"extra_state[{name!r}] is a {type(obj).__name__}, which has no state_dict() and "
                            "load_state_dict(); pass objects that have both (a scheduler, a GradScaler, an EMA "
                            "wrapper), or wrap it in a class that has them")
    if grad_scaler is not None:
        if GRAD_SCALER_KEY in extra:
            raise ValueError(f"extra_state[{GRAD_SCALER_KEY!r}] is reserved for grad_scaler=; rename that entry")
        extra[GRAD_SCALER_KEY] = grad_scaler
    return extra


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch

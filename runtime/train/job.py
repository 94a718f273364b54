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

What happens once per job lives beside the class: entering, admission and the
job's end in life.py; the status's training fields, the generation's event and the
audit log in records.py.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import default_collate

from . import gradients, life, local, records
from ..store import loss as storeloss
from .boundary import Boundary
from .agreement import StateAgreement
from .checkpoints import JobCheckpoints
from ..member.collectives import Aborted
from ..member.config import Device, RuntimeConfig
from ..member.generation import CRASH_CONFIRM_S, ExcludedFromJob, GenerationHooks, Generations  # noqa: F401 - re-exported
from .gradients import GradientPath, ReplicatedPath
from .inner import check_inner_batch
from ..member.plan import Plan
from ..member.session import MemberSession, MemberViews
from .pause import Pause
from .pipeline import Feeder, micro_chunks
from .records import STATUS_EVERY_S, AuditLog, JobStatus
from ..protocol import EventKind
from .sampler import SamplerState, TrainingEnd
from .shares import Shares
from .step import NOTHING_IN_FLIGHT, InFlight, OptimizerStep, forward_abortable
from .tail import Control, layout as tail_layout

log = logging.getLogger("eltctl_runtime")


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


class ElasticJob(MemberViews):
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
        sync: str = "steps",
        sync_every: int | None = None,
        outer_optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
        sync_overlap: bool = False,
        inner_batch: int | None = None,
        grad_dtype: str | None = None,
        compress: str | None = None,
        compress_rank: int | None = None,
    ) -> None:
        self._end = TrainingEnd(max_steps, epochs)  # max_steps or epochs, whichever comes first (sampler.py)
        # Where the batches come from (pipeline.py): the dataset, or data worker processes.
        self._feeder = Feeder(dataset, collate_fn or default_collate, num_workers=num_workers,
                              prefetch_steps=prefetch_steps, pin_memory=pin_memory, seed=seed)
        self._extra = _check_extra_state(extra_state, grad_scaler)
        # Unscale, clip, the script's hook, the optimizer step (step.py).
        self._update = OptimizerStep(optimizer, scaler=grad_scaler, max_grad_norm=max_grad_norm,
                                     before=before_optimizer_step)
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        self._config = config
        self._sampler = SamplerState(n_samples=len(dataset), global_batch=global_batch_size, seed=seed)
        self._fast_exit = fast_exit
        # This rank's share of each step: the speed-proportional split, its pace, its
        # micro-batch limit (shares.py). BatchNorm needs two samples or more per rank.
        self._shares = Shares(balance=balance, micro=micro_batch_size, min_share=2 if any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()) else 1)
        # When checkpoints are due, writing them, restoring and confirming one (checkpoints.py).
        self._ckpts = JobCheckpoints(self, every_steps=checkpoint_every_steps,
                                     every_seconds=checkpoint_every_seconds, keep=keep_checkpoints)
        self._params = [p for p in model.parameters() if p.requires_grad]
        # torch.compile's module: no global forward hook while it runs (_forward_abortable)
        self._compiled = type(model).__name__ == "OptimizedModule"
        # How the step's gradients are reduced and applied (gradients.py: the seam).
        self._grads = _gradient_path(shard, model, optimizer, self._params, bucket_mb, shard_replicas, grad_dtype,
                                     compress, compress_rank, reduce_each_micro_batch,
                                     restore_chunks=self._ckpts.restore_chunks)  # sharded: a restore's chunks
        if reduce_each_micro_batch:
            if shard != "gradients":
                raise ValueError("reduce_each_micro_batch applies to shard='gradients' (ZeRO-2), whose gradients "
                                 f"are sharded; with shard={shard!r} every rank keeps the whole gradient anyway")
            self._grads.reduces_micro_batches = True
        # Local steps (local.py, DiLoCo): the rank's own inner steps, a round's averaging and outer
        # step every sync_every steps or at a planned change; a roll-back to the round's start on an abort.
        self._rounds: local.LocalPath | None = None
        on = local.check(sync, sync_every, outer_optimizer, shard=shard, grad_dtype=grad_dtype,
                         reduce_each_micro_batch=reduce_each_micro_batch, compress=compress, sync_overlap=sync_overlap)
        inner_batch = check_inner_batch(inner_batch, on)  # inner steps of a fixed size (inner.py)
        if on:
            self._grads = self._rounds = local.LocalPath(self, sync_every, outer_optimizer, sync_overlap, inner_batch,
                                                              grad_dtype)
        self._shard = shard
        self._buffers = gradients.BufferSync(model)
        # What the next step boundary owes (boundary.py): the last commit's asks, a roll
        # call after a dropped step, a held-back leave, a due or owed checkpoint; the end.
        self._boundary = Boundary()
        self._hooks: list = []
        self._device = torch.device("cpu")  # set on entering (life.py): the host's GPU, where it has one

        # This member's store, control thread, membership state machine (plan, rank, group)
        # and reports: the session ElasticJob and restart mode share (member/session.py).
        self._session = MemberSession()
        self._step = 0
        # Who holds the training state and where the others get it (agreement.py).
        self._agreement = StateAgreement(self)
        self._flight = NOTHING_IN_FLIGHT  # the step in flight (step.py), a new one each step
        self._mb_left = 0
        self._last_commit: Commit | None = None
        # Where a membership change's pause goes, and the new generation's event (pause.py).
        self._pause = Pause()
        # The status document's training fields; the audit log, if asked for (records.py).
        self._status = JobStatus(time.monotonic())
        self._audit: AuditLog | None = None

    # -- the membership state machine's view (and MemberViews': _plan, _rank, _pg) -----
    @property
    def _abort(self) -> threading.Event:
        return self._session.gen.abort

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
        return self._boundary.left

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
        return self._update.grad_norm

    def fingerprint(self) -> str:
        """Hash of parameters, buffers, optimizer state and extra state: identical on every rank
        (local steps: the global parameters and buffers of the round's start and the outer
        optimizer's state, local.py)."""
        return self._grads.fingerprint(self.model, self.optimizer, self._extra)

    # -- lifecycle -----------------------------------------------------------
    def __enter__(self) -> "ElasticJob":
        # Data workers forked first: before the job's threads, its store connections and CUDA exist.
        self._feeder.start(cuda=self.config.device is Device.CUDA)
        try:
            return life.enter(self)  # the device, the session, admission (life.py)
        except BaseException:
            self._feeder.close()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        life.close(self, exc)

    # -- the loop ------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                self._session.reconnect_if_back()  # the store came back after a loss (store/loss.py)
                self._at_boundary()
                if self._boundary.needs_recovery:
                    self._recover()
            except storeloss.StoreLost as e:
                life.store_lost(self, e)
            if self._boundary.over or self._done():
                if not self._boundary.over and not self._agreement.caught_up_at_end():
                    continue  # joiners catching up take their state first (agreement.py); it broke: the roll call
                life.finish(self)
                self._session.gen.done()
                return
            s = self._sampler
            indices = self._indices_for(s)
            micro = self._shares.micro_limit(self.config.max_micro_batch)
            if self._rounds is not None:  # local steps' inner steps of a fixed size cut the share too (inner.py)
                micro = self._rounds.inner.micro_limit(micro)
            chunks = micro_chunks(indices, micro)
            flight = InFlight(indices, s.step_size(), s.global_indices() if self._audit is not None else [])
            if self._grads.reduces_micro_batches and self.world_size > 1:  # ZeRO-2: rounds agreed
                try:
                    flight.agree_rounds(self._pg, len(chunks), self._abort, self._device)
                except Aborted as e:
                    self._drop_step(f"the step's micro-batch count was not agreed: {e}", e.backend_error)
                    continue  # the group broke: the roll call, then this step again
            # This step's chunks, then those of the next prefetch_steps steps (pipeline.py).
            self._feeder.want(s, self._indices_for, micro=micro, epochs=self._end.epochs,
                              steps_left=self._end.steps_left(self._step))
            self._flight = flight
            self._mb_left = len(chunks)
            if self._rounds is not None:
                self._rounds.inner.begin_step(len(chunks), micro)
            for chunk in chunks:
                flight.mb_count = len(chunk)
                flight.in_step = True
                batch = self._fetch(chunk)
                self._shares.handed()  # the batch goes to the script: this rank's compute time starts
                yield batch
                if flight.in_step:
                    raise RuntimeError("call job.step(loss) once per batch the job yields")

    def _indices_for(self, sampler: SamplerState) -> list[int]:
        """This rank's share of the step `sampler` is at, in the current layout:
        proportional to the ranks' speeds with balancing on (balance.py), else
        equal. Every "which indices does this rank take" goes through here."""
        return self._shares.indices(sampler, self._rank, self.world_size, self.generation)

    def _done(self) -> bool:
        return self._end.reached(self._step, self._sampler)

    def _fetch(self, indices: list[int]) -> Any:
        batch = self._feeder.fetch(self._sampler, indices)
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
        f = self._flight
        if not f.in_step:
            raise RuntimeError("job.step() called outside an iteration of the job")
        f.in_step = False
        n = f.mb_count
        rounds = self._grads.reduces_micro_batches
        if self._mb_left == 1:
            if f.pad:
                self._shares.not_computed(f.pad_rounds(self._grads))
            # buckets are reduced as backward fills them; the control tail (tail.py) and the buffers' updates follow
            self._grads.begin(tail_layout(self.world_size).size + self._buffers.size)
        elif rounds:
            self._grads.begin_round()
        aborted = None
        try:
            if n > 0 and not self._shares.oom_retry:
                try:
                    if callable(loss):
                        with self._forward_abortable():
                            loss = loss()
                    scaled = loss * (n / f.global_count)
                    if self._update.scaler is not None:
                        scaled = self._update.scaler.scale(scaled)
                    scaled.backward()
                    f.loss_sum += float(loss.detach()) * n
                except torch.OutOfMemoryError as e:
                    loss = None
                    self._out_of_memory(n, e)
                except Aborted as e:  # a gradient hook saw the generation aborted (_grad_ready)
                    aborted = e
        finally:
            self._grads.end_backward()
            self._shares.backward_done()
        self._mb_left -= 1
        if aborted is not None:
            self._shares.dropped()  # as _reduce_and_commit leaves them
            self._drop_step(str(aborted), aborted.backend_error)
            return None
        if self._mb_left > 0:
            if rounds:
                self._grads.finish_round()
            elif self._rounds is not None:  # local steps: an inner step where inner_batch ends one (inner.py)
                self._rounds.inner.micro_batch_done(self._rounds, self, n, f.global_count)
            return None
        return self._reduce_and_commit()

    @contextlib.contextmanager
    def _forward_abortable(self) -> Iterator[None]:
        """While the job runs the script's loss function in the last micro-batch (the form
        `job.step(lambda: ...)`): an aborted generation stops the forward pass at the next
        module call, as _grad_ready stops backward (step.forward_abortable). Not for a
        compiled model (torch.compile warns of global hooks and would run it an extra time)."""
        if self._mb_left != 1 or self._session.gen is None or self._abort is None or self._compiled:
            yield
            return
        with forward_abortable(self._abort, self._session.control.abort_reason):
            yield

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
            raise Aborted(f"the generation was aborted during backward ({self._session.control.abort_reason()})")
        self._grads.grad_ready(index, p)
        failed = self._grads.failed()
        if failed is not None:
            raise Aborted(f"a gradient reduction failed during backward: {failed}", backend_error=True)

    def _reduce_and_commit(self) -> float | None:
        W, b = self.world_size, self._boundary
        req = self._session.control.requests
        lay = tail_layout(W)
        f = self._flight
        n = len(f.indices)
        lost = self._session.health.expired()  # the store away too long: every rank ends at this step
        # A join alone goes ahead once every rank has seen it and is ready for it (sharded:
        # has touched its next layout's host memory); a leave, a stop or the store's loss
        # does not wait for that (the joiner is admitted with them where it is queued). While
        # a leave is held back for its own preparation (ready_for_leave) the ranks prepare
        # for that one only, and a queued joiner is admitted with it.
        join_ready = bool(req.join and not b.leave_seen and self._grads.ready_for_join(W + 1))
        leave_ready = bool(self._grads.ready_for_leave(b.leave_seen))
        checkpoint = b.checkpoint_owed or (self._rank == 0 and self._ckpts.clock_due())
        compute_s = self._shares.compute_s  # this step's compute (step_slots resets it): the status's network
        pace, oom = self._shares.step_slots(n)
        if self._pause.event is not None:  # a generation's first step: its parts in the pause
            self._mark("first_forward_backward")
        try:
            restore_bad = 0.0
            if self._ckpts.unconfirmed:  # a restore's first step: this rank's verdict on the checkpoint's hashes
                restore_bad = self._restore_flag()
                self._mark("restore_check")  # the hashes' wait past forward and backward
            tail = self._grads.tail()
            with torch.no_grad():
                tail[:lay.size].copy_(lay.encode(self._rank, Control(
                    join_ready=join_ready, stop=req.stop or lost, samples=n, loss_sum=f.loss_sum,
                    checkpoint=checkpoint, leave_ready=leave_ready, restore_bad=restore_bad,
                    leave=req.leave, pace=pace, oom=oom)))
                self._buffers.write(tail[lay.size:], n, self._rank)
            tail = self._grads.finish(self._abort)  # summed over the ranks; a CPU copy
            got = lay.decode(tail)
            if self._ckpts.unconfirmed and not self._agreement.confirmed(got.restore_bad):
                return None
        except Aborted as e:
            self._drop_step(str(e), e.backend_error)
            return None
        if self._pause.event is not None:
            self._mark("first_reduce")
        if any(m > 0 for m in got.oom):
            self._redo_step([int(m) for m in got.oom])
            return None
        self._buffers.read(tail[lay.size:], int(got.samples))
        b.tail_read(checkpoint=got.checkpoint > 0)
        try:
            skipped = self._update.run(self, self._grads, self._abort)
        except Aborted as e:  # a sharded path's collectives (norm, inf check, gather) broke
            self._drop_step(str(e), e.backend_error)
            return None
        if self._pause.event is not None:
            self._mark("first_optimizer_step")
        self._grads.zero()  # replicated: the gradients stay views of the buffers
        global_loss = got.loss_sum / max(1.0, got.samples)
        # Every rank's pace, identical floats on every rank: the split of the next steps.
        self._shares.replan(got.pace, f.global_count, self._sampler.global_batch, W, self.generation)
        self._status.network.observed(compute_s, self._grads.last_step_timing)  # before _commit's status
        self._commit(global_loss, skipped)
        leaving = {self._plan.members[r] for r in range(W) if got.leave[r] > 0}
        # A leave goes once every rank is ready for it (sharded on the CPU: the survivors have
        # touched the memory their hand-over allocates, a commit or more later; elsewhere at once).
        b.committed(got.stop > 0, leaving, leave_ready=got.leave_ready >= W, join_ready=got.join_ready >= W)
        if b.leave_seen:
            self._grads.ready_for_leave(b.leave_seen)  # the survivors start preparing now
        return global_loss

    def _at_boundary(self) -> None:
        """What the last commit asks for, done when the loop comes back for the
        next batch, so that the state saved or handed over includes what the
        script did after job.step() (its scheduler step): a checkpoint, a stop,
        a membership change."""
        b = self._boundary
        ask = b.take()
        if ask is None:
            return
        stop, leavers = ask
        if self._rounds is not None and not self._rounds.at_boundary(stop, leavers):
            return  # local steps: the round's averaging broke; the roll call follows (local.py)
        try:  # a checkpoint due here (deferred to the next boundary where a membership change goes)
            self._ckpts.at_boundary(b, change=leavers is not None and not stop)
        except Aborted as e:  # sharded: a rank died while the shards went to the writer
            log.warning("worker %s: checkpoint of step %d abandoned in generation %d (the newest one stands): %s",
                        self.worker_id, self._step, self.generation, e)
            b.dropped(e.backend_error)
            return  # a stop or a leave still asked for is seen again at the next commit
        if stop:
            if self._agreement.caught_up_at_end():  # joiners catching up take their state first (agreement.py)
                life.stop(self)
        elif leavers is not None:
            try:
                self._planned_change(leavers)
            except Aborted as e:
                log.warning("worker %s: generation %d aborted while forming: %s", self.worker_id,
                            self.generation, e)
                b.dropped()

    def _out_of_memory(self, n: int, error: Exception) -> None:
        """This rank ran out of memory on `n` samples: the step goes on without
        its gradient (every rank still issues the same collectives) and is
        redone by every rank, this one in micro-batches half the size."""
        retry = self._shares.out_of_memory(n, error)  # raises `error` if nothing smaller is left to try
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("worker %s: out of memory on %d samples at step %d; the step is redone in micro-batches "
                    "of at most %d", self.worker_id, n, self._step + 1, retry)

    def _redo_step(self, limits: list[int]) -> None:
        """A rank ran out of memory (its out-of-memory slot holds its new micro-batch
        size): nothing of this step is applied; the same step comes again."""
        self._shares.redone(limits, self._rank)
        self._grads.zero()
        self._buffers.reset()  # the forward of the step that is redone moved them
        log.info("worker %s: step %d redone (out of memory on rank(s) %s)", self.worker_id, self._step + 1,
                 ", ".join(str(r) for r, m in enumerate(limits) if m))

    def _drop_step(self, why: str, backend_error: bool = False) -> None:
        log.warning("worker %s: step %d dropped in generation %d: %s (%s)", self.worker_id, self._step + 1,
                    self.generation, why, self._session.control.abort_reason())
        self._discard_step()
        self._boundary.dropped(backend_error)
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
        if self._audit is not None:
            self._audit.committed(self)
        st = self._status
        n_done, since = st.samples_since
        st.samples_since = (n_done + self._flight.global_count, since)
        self._sampler = self._sampler.advanced()
        st.last_loss = global_loss
        ev = self._pause.committed(now, had_state=self._agreement.has_state_before, worker_id=self.worker_id,
                                   generation=self.generation)  # a generation's first commit: its event
        if ev is not None and self._rank == 0:
            ev["step"] = self._step
            self._session.report.event(ev)
        if self._rank == 0 and now - self._session.report.last_status_t >= STATUS_EVERY_S:
            st.write(self, now)

    # -- membership changes --------------------------------------------------
    def _planned_change(self, leavers: set[str]) -> None:
        self._session.await_store()
        kind = EventKind.LEAVE if leavers else EventKind.JOIN
        self._mark("boundary")
        decided = self._session.gen.change(leavers, kind)  # None: every member leaves (on_leave)
        self._mark("plan")
        if decided is not None:
            self._pause.old_t = self._pause.last_commit_t
            self._session.gen.enter(decided)

    def _recover(self) -> None:
        """Roll call after an abort, then the next generation (generation.py)."""
        if self._rounds is not None:
            self._rounds.roll_back()  # local steps: back to the round's start (local.py)
        peer_gone = self._boundary.recovering()
        self._session.await_store()
        while True:
            t_old = self._pause.last_commit_t
            decided = self._session.gen.recover(peer_gone, str(self._step))
            self._mark("roll_call")
            try:
                self._pause.old_t = t_old
                self._session.gen.enter(decided)
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
        self._boundary.new_generation()
        self._grads.bind(self._pg, self._rank, plan.members, self._abort)
        restored = self._sync_state()
        self._mark("state")  # the state agreed (a step dropped halfway settled in _sync_state)
        a = self._agreement
        self._grads.reshard(a.members_before, plan.members)
        self._mark("reshard")
        # After a restore the checkpoint's hashes are confirmed in the first step's control
        # tail (_restore_flag, StateAgreement.confirmed): the hashing overlaps that step's forward
        # and backward instead of holding the pause (0.43-0.45 s of a world-4 SIGKILL's here).
        a.members_before = plan.members
        records.note_generation_event(self, plan, restored)  # rank 0 writes it at the first commit
        log.info("worker %s: rank %d of %d in generation %d (%s) at step %d", self.worker_id, self._rank,
                 plan.world_size, plan.generation, plan.kind.value, self._step)

    def _sync_state(self) -> bool:
        """Agree on the training state (agreement.py); True if it came from a checkpoint."""
        return self._agreement.sync()

    def _restore_flag(self) -> float:
        """A restore's first step, its backward done: 1.0 if a file of the checkpoint this
        rank took up, hashed in the background since (checkpoint.restore_chunks), differs
        from its manifest; it goes in the step's control tail (tail.py: restore_bad)."""
        return 0.0 if self._ckpts.check_pending() else 1.0

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

    # -- checkpoints, status, events ----------------------------------------
    @property
    def _host(self) -> str:
        return self._session.host

    def _read(self, get):
        """`get(store)` (protocol.get_status, get_restored), or None: advisory (MemberSession.read)."""
        return self._session.read(get)

    def _on_checkpoint(self, info) -> None:  # writer thread; a restore too (checkpoints.py)
        self._session.report.checkpointed(info)

    def _mark(self, phase: str) -> None:
        """A phase of a membership change's pause ended now (pause.py)."""
        self._pause.mark(phase)


SHARD_SETTINGS = ("optimizer", "gradients")  # ZeRO-1, ZeRO-2 (issue 22): runtime/zero.py


def _gradient_path(shard: str | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   params: list[torch.Tensor], bucket_mb: float, replicas: int = 1,
                   grad_dtype: str | None = None, compress: str | None = None, compress_rank: int | None = None,
                   each_micro_batch: bool = False, restore_chunks: Callable | None = None) -> GradientPath:
    """The gradient path of `shard` (gradients.py: the seam). None: every rank holds
    every gradient and the whole optimizer state (ReplicatedPath); a sharded one
    comes from zero.py's `sharded_path(shard, model, optimizer, params, bucket_mb)`."""
    if compress is not None or compress_rank is not None:  # low-rank gradients (lowrank.py): replicated only
        from . import lowrank

        rank = lowrank.check_settings(compress, compress_rank, shard=shard, grad_dtype=grad_dtype,
                                      reduce_each_micro_batch=each_micro_batch)
        if rank is not None and replicas == 1:
            return lowrank.lowrank_path(params, bucket_mb, rank)
    if shard is None:
        if replicas != 1:
            raise ValueError("shard_replicas applies to sharded training (shard='optimizer' or 'gradients')")
        return ReplicatedPath(params, bucket_mb, grad_dtype=grad_dtype)
    if shard not in SHARD_SETTINGS:
        raise ValueError(f"shard must be None or one of {', '.join(map(repr, SHARD_SETTINGS))}, got {shard!r}")
    if gradients.wire_dtype(grad_dtype) is not None:  # a bad value says its choices first
        raise ValueError(f"grad_dtype={grad_dtype!r} applies to replicated training (shard=None) for now; "
                         f"a sharded job (shard={shard!r}) reduces float32 gradients")
    from . import zero  # only a sharded job pays for importing it (zero/__init__.py: on first use)

    return zero.sharded_path(shard, model, optimizer, params, bucket_mb, replicas, restore_chunks=restore_chunks)


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

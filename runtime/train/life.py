"""An ElasticJob's life as a member of the job, from `with job:` to its end: once per
job, not per step.

Entering: the device, the member's session (its store, control thread and state
machine: member/session.py), the audit log and checkpoint directory, the gradient
hooks, SIGTERM, then admission, where a joiner of a running job first prepares the
layout it will most likely join (`preparing_join`). Ending: the job finished or was
stopped (rank 0 records the end in the store), the store stayed away too long (every
rank ends cleanly, rank 0 checkpoints), this member left (`on_leave`, the state
machine's hook), and the way out (`close`: an abrupt leave is told to the others at
once; then everything the job opened is closed).

The functions take the ElasticJob (`job`, not imported here: job.py imports this
module), which keeps thin methods of the same names.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Any, Iterator

import torch

from ..member import exiting
from ..member.collectives import Aborted
from ..member.config import Device
from ..member.generation import ExcludedFromJob, GenerationHooks
from ..member.plan import Plan
from ..protocol import get_status
from ..store import loss as storeloss
from . import state as state_mod
from .records import AuditLog

log = logging.getLogger("eltctl_runtime")


def enter(job: Any) -> Any:
    """`with job:` after its data workers started: ready to train, or over (admission)."""
    cfg = job.config
    if cfg.device is Device.CUDA:
        torch.cuda.set_device(cfg.local_gpu)
        job._device = torch.device("cuda", cfg.local_gpu)
        job.model.to(job._device)  # warm before registering; parameters stay the optimizer's objects
    else:
        job._device = torch.device("cpu")
    job._grads.device = job._device
    job._session.connect(cfg)
    if cfg.audit_path is not None:
        job._audit = AuditLog(cfg.audit_path)
    if cfg.checkpoint_dir is not None:
        job._ckpts.open(cfg.checkpoint_dir, on_committed=job._on_checkpoint)
    if cfg.max_micro_batch:
        log.info("worker %s: at most %d samples at once on this host (max_micro_batch); a larger share "
                 "runs as micro-batches", cfg.worker_id, cfg.max_micro_batch)
    hooks = GenerationHooks(before_group=job._before_group, on_group=job._on_group,
                            on_leave=functools.partial(on_leave, job))
    job._session.start(hooks, job._device)
    state_mod.check_encodable(job._extra)  # an extra state that cannot travel fails here, not at a resize
    job._hooks = [p.register_post_accumulate_grad_hook(functools.partial(job._grad_ready, i))
                  for i, p in enumerate(job._params)]
    job._session.trap_sigterm()
    admit(job)
    job._buffers.mark()
    return job


def close(job: Any, exc: BaseException | None) -> None:
    """The way out of `with job:` (`exc`: what ended it, if anything)."""
    try:
        abrupt = not job._boundary.over and job._plan is not None
        if abrupt and not isinstance(exc, ExcludedFromJob):
            # Leaving mid-job (an error in the script, or it left the loop):
            # tell the others at once rather than let them wait for the
            # hang timeout. A planned leave is SIGTERM or request_leave.
            job._session.leave_abruptly(
                str(exc) if exc is not None else "the script left the loop before the job ended")
        job._ckpts.close()
    finally:
        job._feeder.close()
        for h in job._hooks:
            h.remove()
        job._hooks = []
        job._session.close()  # the control thread, SIGTERM's handler, the group (never blocks)
        if job._audit is not None:
            job._audit.close()
        if job._fast_exit and exc is None and job._boundary.over:
            # Out of the job: the script's code after the loop still runs,
            # but the interpreter's teardown (seconds, GPU memory held) is
            # skipped. See exiting.py.
            exiting.arm()


def admit(job: Any) -> None:
    """Register as a (warm) joiner and wait to be a member of a generation."""
    cfg = job.config
    job._mark("join_request")  # a joiner's logged phases start here: its wait to be admitted is one
    with preparing_join(job):
        plan = job._session.admit(restarted_wait_s=cfg.store_loss_timeout_s)
    job._mark("admitted")
    if plan is None:
        job._boundary.finish()
        return
    # A joiner of a running job has no committed step; members of the first
    # generation agree on one (restoring the newest checkpoint) in on_group.
    try:
        job._pause.old_t = 0.0
        job._session.gen.enter(plan)
    except Aborted as e:
        log.warning("worker %s: generation %d aborted while forming: %s", job.worker_id,
                    plan.generation, e)
        job._recover()


@contextlib.contextmanager
def preparing_join(job: Any) -> Iterator[None]:
    """Before a joiner of a running job (its status names the members) asks to be
    admitted, its gradient path prepares the layout it will most likely join, of one
    member more (sharded: touches its host memory), on a helper thread that holds it
    until the wait is over. The request goes in once it is prepared: the members are
    admitted to nothing the joiner could have done before asking (touched after the
    request, a joiner's first 500 MB on a VM were still faulting in when the members
    reached the reshard, and they waited for it there: 1 s of the pause). Not where the
    job has no room for it (it may wait long)."""
    status = job._session.read(get_status)
    world = status.get("world_size") if isinstance(status, dict) and not status.get("paused") else None
    full = job.config.max_workers is not None and isinstance(world, int) and world >= job.config.max_workers
    if not isinstance(world, int) or world < 1 or full:
        yield  # no running job, or no room in it: this joiner may wait long
        return
    stop, prepared = threading.Event(), threading.Event()

    def prepare() -> None:
        try:
            job._grads.prepare_join(world + 1, stop, prepared)
        except Exception as e:  # noqa: BLE001 - an optimization: the join goes on without it
            log.warning("worker %s: preparing to join failed (the join goes on without it): %s",
                        job.worker_id, e)
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


def on_leave(job: Any, plan: Plan | None) -> None:
    if plan is None:
        # Everyone is leaving: keep the newest state on disk and end the job.
        log.info("worker %s: every member leaves at step %d; the job pauses", job.worker_id, job._step)
        job._ckpts.now()
        if job._rank == 0:  # the controller mirrors it and restores from it; no member holds the state now
            job._status.write(job, time.monotonic(), paused=True)
    else:
        job._grads.hand_over(plan.left)  # sharded: this leaver's chunks go to their new holders first
        log.info("worker %s: left the job at step %d (generation %d)", job.worker_id, job._step,
                 plan.generation)
    job._boundary.leave()


def store_lost(job: Any, e: storeloss.StoreLost) -> None:
    """The store stayed away too long: rank 0 checkpoints (no store needed) and
    every rank ends cleanly; the next start restores the checkpoint."""
    log.error("worker %s: %s; %s at step %d and exits", job.worker_id, e,
              "checkpointing" if job._rank == 0 else "rank 0 checkpoints", job._step)
    if not job._grads.gathers:  # sharded: the ranks may not all be here (no gather); the last checkpoint stands
        job._ckpts.now()
    job._boundary.finish()


def finish(job: Any) -> None:
    if job._boundary.over:
        return
    job._boundary.finish()
    job._ckpts.now()
    if job._rank == 0:
        try:
            job._session.await_store()
        except storeloss.StoreLost as e:
            log.error("worker %s: %s; the job's end is not recorded in the store", job.worker_id, e)
            return
        job._status.write(job, time.monotonic())
        job._session.report.done(job._step, "finished")


def stop(job: Any) -> None:
    """A stop was asked for (by eltctl, or a rank's store-loss timeout): checkpoint and end."""
    if job._session.health.lost:  # a rank's store-loss timeout (_reduce_and_commit), or the store away now
        store_lost(job, storeloss.StoreLost(f"the store is away ({job._session.health.lost_for():.0f} s)"))
        return
    log.info("worker %s: stop requested; ending at step %d", job.worker_id, job._step)
    job._ckpts.now()
    if job._rank == 0:
        job._session.report.stopped(job._step)
        job._status.write(job, time.monotonic())
        job._session.report.done(job._step, "stop")
    job._boundary.finish()

"""Local steps (DiLoCo): `ElasticJob(..., sync="local", sync_every=H, outer_optimizer=None,
sync_overlap=False)`.

Each worker steps the script's optimizer (the INNER optimizer) on its OWN gradient;
every H committed steps (a round) the workers average how far they moved and an OUTER
optimizer takes one step from the round's start with that average as its gradient
(Douillard et al., 2023). The gradient all-reduce of a synchronous step goes away: a
step all-reduces only its small control tail (tail.py: the membership asks, the
sample counts, the pace, the module buffers' updates), so joins, leaves, yields,
stops, checkpoints, pace and exactly-once keep working at every step; the parameters
cross the network once per round.

One round, on every rank::

    round start    anchor := the global parameters (identical on every rank), with the
                   step count, the sampler's position, the module buffers and the extra
                   state (a scheduler, a GradScaler) at that step
    each step      backward (the job scales the loss by n / global_count) -> finish:
                   the tail all-reduced, then this rank's gradient multiplied by
                   global_count / n (the gradient of its LOCAL mean loss; a rank with
                   no samples in the step takes no inner step) -> the inner step
    round end      delta_i = anchor - local params; all-reduce sum_i s_i * delta_i and
                   sum_i s_i (s_i: the samples rank i trained on in the round, so a
                   rank with a bigger share weighs more); params := anchor; the outer
                   optimizer steps with grad = the weighted mean delta; new anchor

The outer optimizer is `outer_optimizer(params)` (a callable), by default
`torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`, the paper's. The
parameters, the buffers and the outer optimizer's state are identical on every rank
after each round; the inner optimizer's state is each worker's own (a joiner and a
restore start from the sending rank's, rank 0's in a checkpoint). The delta is
averaged in float32 (float64 where a parameter is float64).

Membership (the rule, also in docs/network.md, "Local steps"):

- A join alone waits for the round's natural end (`ready_for_join`: the members
  admit the joiner at the boundary of the round's H-th step, whose averaging happens
  anyway), so it costs the members nothing beyond a usual round's end; the joiner
  waits at most H steps more (2H where a member saw it a step late), and not at all
  where that end is more than JOIN_HOLD_MAX_S (60 s) away (`join_now`): then the round
  ends early for it, as for the changes below.
- Every other planned change ends the round early at that step boundary: a planned
  leave, an owner's yield (a leave), a stop, a due checkpoint and the job's end (a
  joiner queued then is admitted with it). Every member, the leaver included,
  averages what it has (weighted by its samples), then the change happens; a planned
  leave's averaging goes on the wire while the survivors train on (below), in
  bfloat16 unless grad_dtype="fp32" (roundwire.leave_dtype: the leaver frees its
  device sooner). A yield
  never waits for a round's natural end, every committed sample is contributed, and
  what a joiner receives and a checkpoint holds is the global state at a round's end
  (global params, outer state, inner state of the sender). A joiner receives it in
  the background while the members train on, and trains from the step after it took
  it up (catchup.py).
- An abort (a peer's SIGKILL, a crash, a hang, an averaging that broke): the survivors
  roll back to the round's start (the anchor, the step count and the sampler's
  position, the buffers and the extra state snapshotted at the round's start), so the
  round's samples are served again in the next generation, as after a restore; the
  state agreement then picks the newest round start any survivor holds (a rank whose
  averaging completed before the abort holds the next one). A SIGKILL costs at most
  the current round. The inner optimizer's state is not rolled back.

The averaging overlapped with the next round's compute (`sync_overlap=True`; off by
default: it changes the paper's arithmetic, see below, and pays only where the
averaging's wait is a visible share of a round, a slow link or a big model):

    round end e    delta_i = anchor - local params, s_i as above: the all-reduce is
                   LAUNCHED (gloo async_op on the job's group), this rank's params at
                   e are kept (`_ends`, the parameters' size) with the progress, the
                   buffers and the extra state at e; the inner steps go on from the
                   rank's own params, counted in the next round (its s_i too)
    each step      the control tail's `averaging` field (tail.py): 1 while this rank's
                   all-reduce is not done (a non-blocking look at its work)
    merge          at the boundary of the first step whose summed tail says every
                   rank's is done, or at the next round's end (waiting there: never two
                   averagings in flight): params := anchor, the outer step on the mean
                   delta (the same operations on the same values as without overlap:
                   the same global params and outer state, bit for bit, on every
                   rank), the result is the new anchor with the progress, buffers and
                   extra state kept at e, then params += (params now - params at e):
                   the rank's progress during the overlap is kept, and the next
                   round's delta (from the new anchor) counts it

So the last MERGED round's start is what the rest of this docstring calls "the round's
start": it is what an abort rolls back to, what a checkpoint and a joiner's state hold
and what `fingerprint` hashes. The overlap's cost: the outer step reaches the local
params 1 to H steps late (Streaming DiLoCo's overlap without its mixing; the loss it
costs, measured: docs/network.md), one more copy of the parameters, and on an NCCL
group (GPU hosts) nothing gained yet: its collectives run in order, so the next step's
tail waits behind the averaging (a group of its own would fix that; not done). On gloo
the averaging and the tails share the group: gloo runs a group's collectives on 2
threads, each tagged by its sequence number, and every rank launches them in the same
order (the averaging at the agreed boundary, then one tail per step), so at most one
averaging and one tail are on the wire at once (the replicated path's buckets rely on
the same); a separate group would cost every generation change its formation. The
status's wait (StepTiming) counts only the wait the overlap did not hide (at the merge).

- A planned change (a join, a leave, an owner's yield, a stop, a due checkpoint, the
  job's end) first merges the averaging in flight (waiting for it), then ends the
  round as without overlap (a synchronous averaging of the steps since e): a join,
  held for the round's natural end, then costs a synchronous averaging where that
  end would have launched an overlapped one.
- An abort with an averaging in flight (a SIGKILL, a crash, a hang, an all-reduce that
  failed) rolls back to the last merged round's start: the anchor, step count, sampler
  position, buffers and extra state of the round BEFORE the one in flight, so the
  unmerged round and the overlap's steps are served again (exactly once: none of them
  is in any merged state; a SIGKILL then costs up to two rounds). The survivors' state
  agreement picks the newest merged start any survivor holds (a rank that merged at a
  boundary another did not reach).
- While a joiner catches up (catchup.py) rounds end with the synchronous averaging (its
  replay of missed outer steps reads the averaging's slots); the overlap resumes at the
  first round's end after it caught up.

Mixed hardware: every step is split by the ranks' measured speeds (balance.py), so a
round is H steps of one balanced duration and nobody waits for the slowest worker; with
`inner_batch=b` a rank takes its share in inner steps of at most b samples, so a faster
rank takes more inner steps (inner.py); the averaging weighs each rank by its samples.

`grad_dtype="bf16"`: the round's weighted deltas travel as bfloat16, half the bytes
(roundwire.py); the sample counts and the outer step stay float32.

Not done (future work): the averaging streamed in fragments (Streaming DiLoCo), a
group of its own for the overlap on NCCL, and composing with shard=,
reduce_each_micro_batch= or compress=, which are refused.

`LocalPath` is the GradientPath (gradients.py) of this mode and, beside the seam, the
job's side of its rounds: `at_boundary` (ElasticJob._at_boundary) ends a round where
`round_ends` says so, `roll_back` (ElasticJob._recover) goes back to the round's start;
`reshard`, called once the state is agreed in each generation, starts a round.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable

import torch

from ..member import collectives
from ..member.collectives import Aborted
from . import state as state_mod
from .catchup import CatchUp
from .gradients import TAIL_DTYPE, GradientPath, StepTiming, all_finite, clip_global_norm_, wire_dtype
from .inner import InnerSteps
from .roundwire import LeaveMemory, RoundWire, leave_dtype
from .tail import layout as tail_layout, set_averaging

log = logging.getLogger("eltctl_runtime")

SYNC_MODES = ("steps", "local")  # ElasticJob(sync=): every step's gradients, or local steps (this module)
OUTER_KEY = "outer_optimizer"  # the outer optimizer's state in a captured state (a checkpoint)


def default_outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD with Nesterov momentum (lr 0.7, momentum 0.9)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def check(sync: str, sync_every: int | None, outer_optimizer: Any, *, shard: str | None,
          grad_dtype: str | None, reduce_each_micro_batch: bool, compress: str | None = None,
          sync_overlap: bool = False) -> bool:
    """Validate ElasticJob's sync arguments; True for local steps. Pure."""
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {', '.join(map(repr, SYNC_MODES))}, got {sync!r}")
    if not isinstance(sync_overlap, bool):
        raise ValueError(f"sync_overlap must be True or False, got {sync_overlap!r}")
    if sync == "steps":
        if sync_every is not None or outer_optimizer is not None:
            raise ValueError("sync_every and outer_optimizer apply to local steps: pass sync='local' with them")
        if sync_overlap:
            raise ValueError("sync_overlap applies to local steps: pass sync='local', sync_every=H with it")
        return False
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync='local' needs sync_every=H, the inner steps per round (an integer >= 1; the "
                         f"DiLoCo paper uses 500), got {sync_every!r}")
    if outer_optimizer is not None and not callable(outer_optimizer):
        raise ValueError("outer_optimizer must be a callable params -> optimizer, e.g. "
                         "lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True); "
                         f"got a {type(outer_optimizer).__name__}")
    for name, value, default in (("shard", shard, None), ("grad_dtype", grad_dtype, None),
                                 ("reduce_each_micro_batch", reduce_each_micro_batch, False),
                                 ("compress", compress, None)):
        if value != default and not (name == "grad_dtype" and value in ("fp32", "bf16")):  # roundwire.py
            raise ValueError(f"sync='local' does not compose with {name}={value!r} yet: local steps send the "
                             f"parameters once per round, not the gradients; drop {name}= or use sync='steps'")
    return True


def round_ends(steps_in_round: int, sync_every: int, *, stop: bool, change: bool, checkpoint: bool,
               done: bool) -> bool:
    """Whether the round ends at this step boundary (the same on every rank: the step
    count and the asks come from the agreed tail). Pure."""
    return steps_in_round > 0 and (steps_in_round >= sync_every or stop or change or checkpoint or done)


# A queued joiner waits for the round's natural end (`join_now`) only where that end is at
# most this far away (this rank's steps at its measured pace); farther, the round ends early
# for it (one averaging more for the members) rather than leave a free worker idle longer.
JOIN_HOLD_MAX_S = 60.0


def join_now(committing: int, sync_every: int, step_s: float | None) -> bool:
    """Whether a queued joiner is admitted at the boundary of the step now committed, the
    round's `committing`-th: where the round ends anyway, or where its end is more than
    JOIN_HOLD_MAX_S away at `step_s` seconds a step (None: not measured yet, it waits).
    Pure; the join goes where every rank says so (job.py: the tail's join_ready)."""
    if committing >= sync_every:
        return True
    return step_s is not None and (sync_every - committing) * step_s > JOIN_HOLD_MAX_S


LAUNCH, AVERAGE = "launch", "average"  # how a round ends: overlapped (sync_overlap), or synchronously


def boundary_plan(steps_in_round: int, sync_every: int, *, in_flight: bool, all_done: bool, overlap: bool,
                  catching_up: bool, stop: bool, change: bool, checkpoint: bool, done: bool,
                  leave: bool = False) -> tuple[bool, str | None]:
    """What a step boundary does (the same on every rank: the step count, the asks and
    `all_done`, the summed tail's `averaging` field, are agreed): whether the averaging in
    flight is merged first (every rank's is done, or a round ends here: waiting for it),
    and how the round ends here: None (it goes on), LAUNCH (a natural end with the
    overlap on, or a planned leave: `leave`, the change is a leave some member survives,
    on a gloo group; no joiner catching up either way) or AVERAGE (the synchronous
    averaging). Pure."""
    ends = round_ends(steps_in_round, sync_every, stop=stop, change=change, checkpoint=checkpoint, done=done)
    merge = in_flight and (all_done or ends)
    if not ends:
        return merge, None
    if catching_up:
        return merge, AVERAGE
    natural = not (stop or change or checkpoint or done)
    leaving = leave and change and not (stop or checkpoint or done)
    return merge, LAUNCH if (overlap and natural) or leaving else AVERAGE


class _Averaging:
    """An overlapped averaging in flight (sync_overlap, or a planned leave's): its
    all-reduce's works (roundwire.py), the parameters' element count in its buffer, and what the merged
    round start takes from the round's end: the progress, the extra state and the state
    dict's entries that are not averaged parameters (buffers). `group`: after a planned
    leave, the old generation's group and its store, kept until the merge (the work runs
    on it; generation.py lets go of its own references)."""

    __slots__ = ("works", "numel", "progress", "extra", "kept", "wire", "group")

    def __init__(self, works: list, numel: int, progress: dict, extra: dict, kept: dict[str, torch.Tensor],
                 wire: RoundWire) -> None:
        self.works, self.numel, self.progress, self.extra, self.kept = works, numel, progress, extra, kept
        self.wire = wire  # how it went on the wire (its body's copy lands from there)
        self.group: tuple[Any, Any] | None = None

    def done(self) -> bool:
        """Whether the all-reduce(s) completed, without waiting; Aborted where one failed."""
        i, err = collectives.first_failure(self.works)
        if err is not None:
            raise Aborted(f"the overlapped averaging failed: {err}", backend_error=True)
        return i == len(self.works)

    def wait(self, abort: threading.Event | None) -> None:
        """Wait for the all-reduce(s) (collectives.wait_work: Aborted)."""
        for work in self.works:
            collectives.wait_work(work, abort)


def outer_step(params: list[torch.Tensor], outer: Any, flat: torch.Tensor, numel: int) -> None:
    """The params hold the anchor: `outer` steps with the weighted mean delta
    (flat[:numel] / flat[numel]) as their gradient; none where the round had no samples.
    flat[:numel] is divided in place (a joiner catching up keeps that mean: catchup.py)."""
    total = float(flat[numel])
    with torch.no_grad():
        if total > 0:
            flat[:numel].div_(total)
            pos = 0
            for p in params:
                k = p.numel()
                p.grad = flat[pos:pos + k].view_as(p).to(p.dtype)
                pos += k
            outer.step()
    for p in params:
        p.grad = None  # the next step's backward starts afresh


def merge_arithmetic(params: list[torch.Tensor], anchor: list[torch.Tensor], ends: list[torch.Tensor],
                     outer: Any, flat: torch.Tensor, numel: int) -> None:
    """The merge of an overlapped averaging (module docstring), in place: `params` hold
    this rank's params now, `ends` its params at the round's end, `anchor` the round's
    start, `flat` the summed sum_i s_i delta_i and sum_i s_i. Afterwards `anchor` holds the
    outer step's result (the same bits as a synchronous round's end), `params` that plus
    (params now - params at the round's end); `ends` is scratch. Arithmetic only."""
    with torch.no_grad():
        for p, e, a in zip(params, ends, anchor):
            torch.sub(p.detach(), e, out=e)  # the progress during the overlap
            p.copy_(a)
    outer_step(params, outer, flat, numel)
    with torch.no_grad():
        for p, e, a in zip(params, ends, anchor):
            a.copy_(p)
            p.add_(e)


class LocalPath(GradientPath):
    """Local steps' gradient path and rounds (module docstring). `job`: the ElasticJob
    (its model, parameters, progress, boundary and extra state; not imported here)."""

    def __init__(self, job: Any, sync_every: int, outer_optimizer: Callable[[list], Any] | None,
                 overlap: bool = False, inner_batch: int | None = None, grad_dtype: str | None = None) -> None:
        self._job = job
        self._rwire = RoundWire(wire_dtype(grad_dtype))  # the round's averaging: whole, or a bf16 body
        leaving = leave_dtype(grad_dtype)  # a planned leave's averaging: bf16 unless fp32 was asked for
        self._leave_rwire = self._rwire if leaving == self._rwire.dtype else RoundWire(leaving)
        self.inner = InnerSteps(inner_batch)  # inner steps of at most inner_batch samples (inner.py)
        self.overlap = overlap  # sync_overlap: the averaging overlapped with the next round (docstring)
        self._params: list[torch.Tensor] = job._params
        self.sync_every = sync_every
        self._outer = (outer_optimizer or default_outer)(self._params)
        if not all(callable(getattr(self._outer, m, None)) for m in ("step", "state_dict", "load_state_dict")):
            raise ValueError(f"outer_optimizer(params) returned a {type(self._outer).__name__}, not an optimizer "
                             "(step, state_dict, load_state_dict); return e.g. torch.optim.SGD(params, lr=0.7, "
                             "momentum=0.9, nesterov=True)")
        self.device = torch.device("cpu")  # the job sets it once the model is placed
        self.pg = None
        self._tail_buf: torch.Tensor | None = None
        self._step_samples = 0  # this rank's samples in the step in flight (its tail, before the sum)
        self.round_samples = 0  # this rank's samples in the round's inner steps
        # The round's start (None before the first): the model's state dict (parameters,
        # the anchor of the delta, and buffers), progress and extra state.
        self._snap: dict[str, torch.Tensor] | None = None
        self._anchor: list[torch.Tensor] = []
        self._start: dict | None = None
        self._extra_start: dict | None = None
        self._flat: torch.Tensor | None = None  # the round's all-reduce buffer, kept
        self._round_from = 0  # the step the current round started at (with an averaging in flight: its end)
        self._param_keys: frozenset[str] = frozenset()  # the averaged parameters' names in the state dict
        self._wire: _Averaging | None = None  # the overlapped averaging in flight (sync_overlap)
        self._ends: list[torch.Tensor] = []  # this rank's params at its round's end (kept buffers)
        self._leave_mem = LeaveMemory()  # what a leave's launch writes, touched ahead (ready_for_leave)
        self._merge_now = False  # this step's summed tail: every rank's averaging is done
        self._merged_in_gen = False  # a generation's first merge is logged
        self._round_wait_s = 0.0  # the last averaging's wait, spread over a round's steps (StepTiming)
        self._step_s: float | None = None  # this rank's seconds per step, smoothed (join_now)
        self._finished_t: float | None = None  # when its last step's tail came back
        self._round_bytes = 0
        # Joiners that take the state in the background while the job trains on (catchup.py).
        self.catchup = CatchUp(job, self)

    # -- per generation ------------------------------------------------------------------
    def bind(self, pg, rank, members, abort) -> None:
        joined = set(members) - set(getattr(self, "members", None) or ())
        super().bind(pg, rank, members, abort)
        mode = {"mode": "local", "sync_every": self.sync_every, **({"sync_overlap": True} if self.overlap else {}),
                **({"inner_batch": self.inner.inner_batch} if self.inner.inner_batch else {}),
                **({"grad_dtype": "bf16"} if self._rwire.dtype is not None else {})}
        self._job._status.network.mode = mode  # the status shows it
        self._finished_t = None  # the generation change is no step
        if self._wire is not None and (joined or self._wire.group is None):
            # A leave's averaging still on the old group, and a joiner admitted with the
            # leave (it gets a merged round start: the state agreement, next), or a member
            # lost with it (the old group is buried, not kept: hand_over did not run): the
            # members merge now, waiting for the wire (Aborted: the generation breaks).
            self.merge(abort)

    def hand_over(self, left) -> None:
        """A planned leave, before the old group goes (every old member calls it): the
        round's averaging was launched at this boundary (at_boundary). A leaver waits for
        its part of the all-reduce, so that what it trained reaches the survivors' merge,
        then leaves; a survivor keeps the old group (and its store: generation.py's
        `pg_store`, still the old one here) referenced until its merge, which a later
        boundary's tail agrees on (`averaging`)."""
        w = self._wire
        if w is None:
            return
        j = self._job
        if j.worker_id in left:
            try:
                w.wait(j._abort)
            except Aborted as e:  # the survivors' merge fails too: they roll back to the round's start
                log.warning("worker %s: its part of the averaging broke as it left (%s)", j.worker_id, e)
            return
        w.group = (self.pg, j._session.gen.pg_store)

    def reshard(self, old_members, new_members) -> None:
        """The state is agreed in a new generation (a change, a recovery, a restore): a round
        starts; after a planned leave whose averaging is still on the old group, the round
        that started at its launch goes on (merged at a later boundary)."""
        self._merged_in_gen = False
        if self._wire is not None and self._wire.group is not None:
            return
        self._wire = None  # merged before a planned change, dropped by an abort's roll-back
        self.start_round()

    @property
    def in_flight(self) -> bool:
        """An overlapped averaging is on the wire (sync_overlap)."""
        return self._wire is not None

    @property
    def merge_due(self) -> bool:
        """The last step's summed tail says every rank's averaging is done (its boundary merges)."""
        return self._merge_now

    # -- per step -------------------------------------------------------------------------
    def begin(self, tail_size: int) -> None:
        if self._tail_buf is None or self._tail_buf.numel() != tail_size:
            self._tail_buf = torch.zeros(tail_size, dtype=TAIL_DTYPE, device=self.device)
        if self.catchup.idle:
            self.catchup.poll()  # a joiner whose state arrived takes it up and says so in this step's tail

    def grad_ready(self, index: int, p: torch.Tensor) -> None:
        """Nothing to launch: the gradients stay on this rank."""

    def end_backward(self) -> None:
        pass

    def tail(self) -> torch.Tensor:
        return self._tail_buf

    def finish(self, abort: threading.Event) -> torch.Tensor:
        """The control tail alone is all-reduced; then this rank's gradient becomes the
        gradient of its local mean loss (x global_count / n)."""
        world = len(self.members)  # n: this rank's samples not yet taken by an inner step (inner.py)
        self._step_samples = n = int(tail_layout(world).decode(self._tail_buf.to("cpu")).samples) - self.inner.stepped
        wire = self._wire
        if wire is not None:
            set_averaging(self._tail_buf, not wire.done())  # Aborted where it failed: the step is dropped
        t0 = time.perf_counter()
        collectives.allreduce_small(self.pg, self._tail_buf, abort)  # a direct exchange: no ring of trips
        summed = self._tail_buf.to("cpu", copy=True)
        now = time.perf_counter()
        wait = now - t0
        if self._finished_t is not None:
            dt = now - self._finished_t
            self._step_s = dt if self._step_s is None else 0.8 * self._step_s + 0.2 * dt
        self._finished_t = now
        got = tail_layout(world).decode(summed)
        self._merge_now = wire is not None and got.averaging == 0  # merged at this step's boundary
        total = int(got.samples)
        if self.catchup.idle:
            self.catchup.tail_seen(got.pace)  # joiners that took up the state train from the next step
        if 0 < n != total:
            with torch.no_grad():
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(total / n)
        H = self.sync_every
        self.last_step_timing = StepTiming(wait + self._round_wait_s / H,
                                           self._tail_buf.numel() * TAIL_DTYPE.itemsize + self._round_bytes // H)
        return summed

    def inner_step(self, job: Any, m: int, global_count: int) -> None:
        """An inner step before the step's last (inner.py), on the gradient of the `m`
        samples since the last one: their local mean (x global_count / m), then the
        OptimizerStep through this path, as the step's own."""
        with torch.no_grad():
            for p in self._params:
                if p.grad is not None:
                    p.grad.mul_(global_count / m)
        self._step_samples = m
        job._update.run(job, self, job._abort)
        self.zero()

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params if p.grad is not None]

    def unscale_(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        if self._step_samples > 0:  # a rank without samples takes no inner step (step)
            scaler.unscale_(optimizer)

    def clip_grad_norm_(self, max_norm: float, abort: threading.Event) -> float:
        """This rank's own gradient's norm (local steps: no global gradient exists)."""
        return clip_global_norm_(self._grads(), max_norm)

    def step(self, optimizer: torch.optim.Optimizer, scaler: Any, abort: threading.Event) -> bool:
        """The inner step on this rank's gradient; none where it had no samples."""
        if self.catchup.packing is not None:
            self.catchup.hold_inner()  # a joiner's source: its copy of the inner state is taken first (catchup.py)
        n = self._step_samples
        if n <= 0:
            return False
        self.round_samples += n
        if scaler is None:
            optimizer.step()
            return False
        finite = all_finite(self._grads())
        scaler.step(optimizer)
        scaler.update()
        return not finite

    def zero(self) -> None:
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()

    def ready_for_join(self, world: int) -> bool:
        """A joiner is queued: it is admitted at the boundary where the round ends anyway
        (the step now committed is the round's H-th), so a join costs the members nothing
        beyond a usual round's end, where ending the round early for it cost them one more
        averaging (2.7 s for a 50 M-parameter model at 1 Gbit/s); unless that end is more
        than JOIN_HOLD_MAX_S away (`join_now`). A rank that saw the joiner a step late
        holds it one more round. A leave, a stop or the job's end takes it with them."""
        return join_now(self._job._step + 1 - self._round_from, self.sync_every, self._step_s)

    def ready_for_leave(self, leaving) -> bool:
        """CPU: a leave waits until what its launch writes is touched (roundwire.LeaveMemory)."""
        ready, ends = self._leave_mem.ready(self._params, self._leave_rwire, self.device)
        if ends is not None and not self._ends:
            self._ends = ends
        return ready

    def drop(self) -> None:
        self._tail_buf = None  # a collective that never finished may still write into it

    # -- the rounds -----------------------------------------------------------------------
    def at_boundary(self, stop: bool, leavers: set[str] | None) -> bool:
        """At a step boundary after a commit (ElasticJob._at_boundary), before its
        checkpoint, stop or change: merge an overlapped averaging where boundary_plan says
        so, then average and take the outer step where the round ends (round_ends), or
        launch its averaging (sync_overlap, or a planned leave that some member survives:
        the leaver contributes its partial round without anyone waiting for the wire).
        `leavers`: the change asked for (an empty set: a join; None: none). False: an
        averaging broke (the roll call follows: boundary dropped)."""
        j = self._job
        b = j._boundary
        change = leavers is not None and not stop
        leave = bool(change and leavers and set(self.members) - set(leavers) and self.pg is not None
                     and self.pg.name() != "NCCL")  # NCCL: two communicators at once could deadlock
        every = j._ckpts.every_steps
        checkpoint = bool(every and j._step % every == 0) or b.checkpoint_due
        done = j._done()
        merge, end = boundary_plan(j._step - self._round_from, self.sync_every, in_flight=self._wire is not None,
                                   all_done=self._merge_now, overlap=self.overlap,
                                   catching_up=bool(self.catchup.idle), stop=stop, change=change,
                                   checkpoint=checkpoint, done=done, leave=leave)
        self._merge_now = False
        if not (merge or end):
            return True
        try:
            if merge:
                self.merge(j._abort)  # before a round's end too: never two averagings in flight
            if end is None:
                return True
            if end == LAUNCH:
                # the next round starts now, this one's averaging on the wire (a leave's: roundwire.leave_dtype)
                self.launch(self._leave_rwire if leave else None)
                if leave:
                    log.info("worker %s: the round ending at step %d is averaged on the wire%s while the job goes "
                             "on (a planned leave of %s)", j.worker_id, j._step,
                             " in bfloat16" if self._leave_rwire.dtype is not None else "",
                             ", ".join(sorted(leavers)))
                return True
            self.average(j._abort, final=stop or done)
        except Aborted as e:
            log.warning("worker %s: the averaging of the round ending at step %d broke in generation %d (%s); "
                        "the round is redone from step %d", j.worker_id, j._step, j.generation, e,
                        self._start["step"] if self._start else 0)
            b.dropped(e.backend_error)
            return False
        self.start_round()
        return True

    def average(self, abort: threading.Event | None, final: bool = False) -> None:
        """The round's end, every rank alike: the samples-weighted mean of the deltas
        (one all-reduce of the parameters' size), then the outer step from the anchor.
        Raises Aborted (a broken group) with the parameters untouched. While joiners catch
        up (catchup.py) they add zeros with weight 0 and one slot per rank says who still
        does (`final`: the job's end or a stop, where a joiner waits for its transfer)."""
        params, anchor = self._params, self._anchor
        catching = self.catchup.idle
        if catching:
            self.catchup.before_average(final)  # a joiner whose transfer is complete adopts the round's start
        extra = len(self.members) if catching else 0
        numel = sum(p.numel() for p in params)
        flat, s = self._flat_for(numel, extra), float(self.round_samples)
        self._fill(flat, numel, s)
        with torch.no_grad():
            if catching:
                if s == 0:
                    flat[:numel].zero_()  # a joiner's own parameters are no part of the round
                self.catchup.flags(flat[numel + 1:])
        t0 = time.perf_counter()
        self._rwire.allreduce(self.pg, flat, numel, abort)
        self._round_wait_s, self._round_bytes = time.perf_counter() - t0, self._rwire.bytes(flat, numel)
        total = float(flat[numel])
        with torch.no_grad():
            for p, a in zip(params, anchor):
                p.copy_(a)
        outer_step(params, self._outer, flat, numel)
        if catching:  # who still catches up; such a joiner keeps the mean delta (flat) to replay
            self.catchup.after_average(flat[numel + 1:].tolist(), flat[:numel] if total > 0 else None)

    def _flat_for(self, numel: int, extra: int) -> torch.Tensor:
        """The averaging's buffer: sum_i s_i delta_i, then sum_i s_i, then `extra` slots."""
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self._params) else torch.float32
        if self._flat is None or self._flat.numel() != numel + 1 + extra or self._flat.dtype != dtype:
            self._flat = torch.empty(numel + 1 + extra, dtype=dtype, device=self.device)
        return self._flat

    def _fill(self, flat: torch.Tensor, numel: int, s: float, ends: list[torch.Tensor] | None = None) -> None:
        """This rank's part of the averaging: s * (anchor - params), then s; `ends`: a copy
        of the params too (launch)."""
        with torch.no_grad():
            pos = 0
            for i, (p, a) in enumerate(zip(self._params, self._anchor)):
                k = p.numel()
                piece = flat[pos:pos + k]
                piece.copy_(a.reshape(-1))
                piece.sub_(p.detach().reshape(-1).to(flat.dtype)).mul_(s)
                if ends is not None:
                    ends[i].copy_(p)
                pos += k
            flat[numel] = s

    def launch(self, wire: RoundWire | None = None) -> None:
        """A round's natural end with sync_overlap, or a planned leave's (module docstring):
        its averaging goes on the wire (`wire`: a leave's; None: the job's) and the next round
        starts now from this rank's own params; `merge` takes the outer step later. Every
        rank calls it at the same boundary."""
        j, params = self._job, self._params
        numel = sum(p.numel() for p in params)
        flat = self._flat_for(numel, 0)
        if len(self._ends) != len(params) or any(e.shape != p.shape for e, p in zip(self._ends, params)):
            self._ends = [torch.empty_like(p, requires_grad=False) for p in params]
        self._fill(flat, numel, float(self.round_samples), self._ends)
        with torch.no_grad():
            sd = j.model.state_dict(keep_vars=True)
            kept = {k: v.detach().clone() for k, v in sd.items() if k not in self._param_keys}
        wire = wire or self._rwire
        works = wire.launch(self.pg, flat, numel)
        self._wire = _Averaging(works, numel, j._progress(), copy.deepcopy(state_mod.extra_state_dicts(j._extra)),
                                kept, wire)
        self.round_samples = 0
        self._round_from = j._step

    def merge(self, abort: threading.Event | None) -> None:
        """The averaging in flight is done on every rank (or this rank waits for it: a
        round's end, a planned change): the outer step from the anchor, the result the new
        anchor (with the progress, buffers and extra state of the round's end), and this
        rank's progress since the round's end added back (module docstring). Raises
        Aborted (the all-reduce failed, the generation was aborted) with nothing changed."""
        w = self._wire
        self.catchup.hold()
        t0 = time.perf_counter()
        w.wait(abort)
        self._round_wait_s = time.perf_counter() - t0  # the wait the overlap did not hide (StepTiming)
        self._wire = None
        if w.group is not None:
            collectives.release(*w.group)  # the old generation's group: its work is done
        flat = self._flat
        w.wire.land(flat, w.numel)
        self._round_bytes = w.wire.bytes(flat, w.numel)
        merge_arithmetic(self._params, self._anchor, self._ends, self._outer, flat, w.numel)
        with torch.no_grad():
            for k, v in w.kept.items():
                self._snap[k].copy_(v)
        self._start, self._extra_start = w.progress, w.extra
        j = self._job
        if w.group is not None:
            log.info("worker %s: the averaging of the round ending at step %d (a planned leave's) merged at step %d "
                     "(overlapped with %d step(s), %.3f s waited for it)", j.worker_id, w.progress["step"], j._step,
                     j._step - w.progress["step"], self._round_wait_s)
        elif not self._merged_in_gen:
            self._merged_in_gen = True
            log.info("worker %s: the averaging of the round ending at step %d merged at step %d (overlapped with "
                     "%d step(s), %.3f s waited for it)", j.worker_id, w.progress["step"], j._step,
                     j._step - w.progress["step"], self._round_wait_s)

    def start_round(self) -> None:
        """The current state is the round's start: snapshot it (module docstring)."""
        j = self._job
        sd = j.model.state_dict(keep_vars=True)
        with torch.no_grad():
            if self._snap is None or self._snap.keys() != sd.keys():
                self._snap = {k: v.detach().clone() for k, v in sd.items()}
                names = {id(v): k for k, v in sd.items()}
                self._anchor = [self._snap[names[id(p)]] for p in self._params]
                self._param_keys = frozenset(names[id(p)] for p in self._params)
            else:
                for k, v in sd.items():
                    self._snap[k].copy_(v.detach())
        self._start = j._progress()
        self._round_from = self._start["step"]
        self._extra_start = copy.deepcopy(state_mod.extra_state_dicts(j._extra))
        self.round_samples = 0
        if self.catchup.idle:
            self.catchup.round_started()  # the source: a joiner still catching up gets this round's start

    def roll_back(self) -> None:
        """An abort (ElasticJob._recover, before the roll call): back to the round's start,
        so its samples are served again (module docstring)."""
        j = self._job
        self._merge_now = False
        if self._wire is not None:  # the unmerged round and the overlap's steps are served again
            if self._wire.group is not None:
                collectives.bury(*self._wire.group)  # a leave's old group, its work perhaps stuck
            self._wire.wire.forget()
            self._wire = None
            self._flat = None  # the old group's all-reduce may still write into it
        if self._start is None:
            return
        with torch.no_grad():
            own = j.model.state_dict()
            for k, v in self._snap.items():
                own[k].copy_(v)
        for p in self._params:
            p.grad = None
        redone = j._step - int(self._start["step"])
        j._set_progress(self._start)
        for name, obj in j._extra.items():
            if name in self._extra_start:
                obj.load_state_dict(copy.deepcopy(self._extra_start[name]))
        j._buffers.mark()
        self.round_samples = 0
        self._round_from = j._step
        if redone:
            log.info("worker %s: back to the round's start at step %d (%d step(s) of the round are redone)",
                     j.worker_id, j._step, redone)

    # -- the state ------------------------------------------------------------------------
    def capture(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: dict,
                extra: dict[str, Any]) -> dict:
        """The state at the round's start (the current one at a round's end, where joins,
        leaves and checkpoints happen): global params, buffers, the round start's progress
        and extra state, this rank's inner optimizer state and the outer one's."""
        state = state_mod.capture(model, optimizer, progress, extra)
        if self._start is not None:
            state["model"] = dict(self._snap)
            state["progress"] = {**progress, **{k: self._start[k] for k in ("step", "epoch", "position")}}
            state["extra_state"] = copy.deepcopy(self._extra_start)
        state[OUTER_KEY] = self._outer.state_dict()
        return state

    def apply(self, saved: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              extra: dict[str, Any]) -> dict:
        progress = state_mod.apply(saved, model, optimizer, extra)
        # What the round's start held is not this state's: capture and the fingerprint read the live
        # state until the generation's reshard starts a round from it.
        self._snap = self._start = None
        if OUTER_KEY in saved:
            self._outer.load_state_dict(saved[OUTER_KEY])
        else:
            log.warning("the state taken up has no outer optimizer state (saved with sync='steps'); the outer "
                        "optimizer starts afresh")
            self._outer.state.clear()
        return progress

    def fingerprint(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> str:
        """Hash of the global state: the round start's parameters and buffers and the outer
        optimizer's state (identical on every rank after each round; the inner state is
        each rank's own)."""
        return state_mod.fingerprint_of(self._snap if self._snap is not None else model.state_dict(),
                                        self._outer.state_dict()["state"])

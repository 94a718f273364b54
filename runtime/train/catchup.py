"""Catching up: a joiner takes the state in the background while the job trains on,
instead of stopping every member for its transfer. Local steps (sync="local") and
synchronous steps (sync="steps", the default: the replicated path, fp32 or
grad_dtype="bf16") alike.

Today's join (agreement.py) moves the whole state (parameters and optimizer state:
600 MB for a 50 M-parameter AdamW model, 4.8 s on 1 GbE) to the joiner while every
member waits. Nobody needs the joiner before it holds the state, so:

- admission (`CatchUp.admit`, from the state agreement): the joiner is a member of the
  new group and of every step's control tail, but a CATCHING-UP one: its share is 0
  (Shares.idle: it trains on nothing; its empty step is the path of any rank without
  samples) and it receives only the progress, the extra state (bytes) and the
  optimizer's param_groups' hyperparameters (its scheduler steps from them) in the
  generation change. The members keep the state they hold: nothing big moves there.
- in the background: the source (the member the agreement chose) copies its state into
  host memory on a thread while its first step computes (what would change the state
  waits for the copy: `hold`), and a thread sends it over a 2-rank gloo group of their
  own (formed on the job's store under `gen/<g>/catchup/<joiner's rank>/pg`, bound to
  the data plane's address and its pair checked with the signed handshake like the
  generation's group); a thread of the joiner receives it. The members step on. The
  state goes in chunks that give way to the job's own reduction (catchup_pair.py: the
  sender waits while `link` is busy; the replicated path marks it from a step's first
  all-reduce launch until finish waited for every one, local steps the round's
  averaging but the last); a chunk in flight delays an all-reduce by at most its time
  on the link (CHUNK_BYTES / rate).
- what the joiner keeps meanwhile, so that the state it receives (of an earlier step)
  can be brought to the members' present by the members' own operations on the same
  values (the same bits):
  - local steps: the state is the round's start (the anchor, unchanged during the
    round: the global parameters, the outer optimizer's state, the source's inner
    state). At a round's end (LocalPath.average) the joiner contributes zeros with
    weight 0, so the round's result is the members' alone, takes part in the
    all-reduce and keeps the weighted mean delta (host memory, the parameters' size)
    to replay the outer step (`replay_outer_step`); at most MAX_MISSED_ROUNDS of them.
  - synchronous steps: the state is that of the join's boundary (parameters and
    optimizer state). The joiner contributes zero gradients with 0 samples to every
    step's all-reduce and, per committed step, keeps exactly what the members'
    optimizer step consumed (ReplicatedPath.step calls `replaces_step` in place of
    the optimizer step: a `StepRecord`): the whole global gradient after the
    all-reduce (bf16's cast back to float32 included), the GradScaler's unscale and
    the clipping (the post-clip buffers optimizer.step reads), the param_groups'
    hyperparameters at that step (the script's scheduler runs in the joiner's loop
    too, and loading the optimizer's state_dict would overwrite them), and whether
    the step was skipped. Host memory: one gradient per step, at most MAX_KEPT_BYTES
    (at least MIN_KEPT_STEPS steps: `kept_cap`).
- taking it up (`poll`, at the start of any step): once the state it waits for arrived
  (and, synchronous, it kept every step since) the joiner adopts it and replays what
  it kept (`replay_outer_step`; `take_up_steps`: the parameters and optimizer state,
  then one optimizer step per kept step with its gradient and hyperparameters, then
  its own live hyperparameters back), so it holds what every member holds.
  Synchronous, that work leaves the step (the members' all-reduce waited for it): from
  the admission (and each ask for a newer copy) a `_Shadow`'s thread waits for the
  state on the transfer and, the moment it arrives, unpacks it into tensors of its own
  (the model's whole state dict) and an optimizer over them (`shadow_optimizer`) and
  replays the kept steps as they are kept; the first poll after the arrival that finds
  at most SWAP_LAG of them left replays those and swaps (the shadow's parameters and
  the state dict's other entries copied into the model's, its optimizer state tensors
  moved into the optimizer's: the same bits as `take_up_steps`). So the joiner takes
  the state up at the same step as a replay in the step would, unless the unpacking
  and the replay are still under way then: a catching-up rank commits steps without
  the members' state (its `fingerprint()` is not theirs), and each step more is one
  more. Optimizer step hooks, or a shadow that failed, replay in poll as
  `take_up_steps`. Its pace
  slot in that step's tail says so (shares.READY_SLOT), it takes that step's
  optimizer step (synchronous) and from the next step on it trains like the others.
- too far behind (MAX_MISSED_ROUNDS kept means, or `kept_cap` kept steps): the joiner
  drops what it kept and asks for a newer copy (AGAIN: in local mode a slot of the
  round's averaging; in synchronous mode its pace slot, shares.AGAIN_SLOT); the source
  copies its state again (local: the newest round's start; synchronous: right after
  that step's optimizer step, so the copy overlaps the next step's compute).
- at the job's end or a stop, a joiner still catching up waits for its transfer there
  (local: in the last averaging; synchronous: `at_end`, then one small all-reduce in
  which a joiner whose transfer broke says so, and receives the state from the source
  over the job's group as before): every rank ends with the same state.
- failures: any generation change drops a transfer under way (and a shadow); a joiner
  not caught up holds no state, so the next agreement gives it the state again
  (catching up again where this module allows it, else today's transfer). A joiner
  that dies costs the members the usual roll call (it held no samples); a source that
  dies, the same, and the joiner starts over.

The per-step hooks run only while some rank catches up (local: LocalPath checks
`idle`; synchronous: ReplicatedPath.catchup is this object then, else None): members
then pay a look at the summed tail and, the source, the wait for its copy.

Where this does not apply, the agreement moves the state as before: a restore, a rank
that holds an older state (it must not lose it), a joiner that would be rank 0 (it
writes the checkpoints), a model with buffers (they ride the step's tail as updates,
which a joiner without the buffers cannot apply), a dataset whose empty batch (what a
rank without samples is handed) cannot be made (pipeline.fetch_batch; a warning says
so); and in synchronous mode (`steps_refusal`) a gradient path other than the plain
replicated one (shard=: each rank steps its own shard; compress="powersgd": each
rank's error feedback), a GradScaler (its skipped steps and scale would have to be
replayed too: not done), and a before_optimizer_step hook (it may read the
parameters, which a catching-up joiner does not hold yet).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..member import collectives, transfer
from ..protocol import Keys
from . import state as state_mod
from .catchup_pair import Link, Transfer
from .gradients import ReplicatedPath, Slot
from .shares import AGAIN_SLOT, READY_SLOT
from .tail import layout as tail_layout

log = logging.getLogger("eltctl_runtime")

OUTER_KEY = "outer_optimizer"  # as local.OUTER_KEY (not imported: local.py imports this module)
# A joiner keeps the mean deltas of at most this many rounds that ended before its state
# arrived (each the size of the parameters, in host memory) to replay their outer steps;
# past that it asks the source for the newest round's start instead.
MAX_MISSED_ROUNDS = 4
STILL, AGAIN = 1.0, 2.0  # a joiner's slot in the averaging: still catching up; and it wants a new copy
# Synchronous steps: a joiner keeps one gradient per committed step (host memory) until its
# state arrives, at most MAX_KEPT_BYTES of them but at least MIN_KEPT_STEPS steps (kept_cap);
# past that it asks for a newer copy (AGAIN_SLOT). A 50 M-parameter model's 200 MB: 21 steps,
# where its 600 MB state needs about 3 of its 1 GbE steps on the wire (issue 51's figures:
# at least 4.8 s, 1.95 s per step; the transfer shares the link with the all-reduces).
MAX_KEPT_BYTES = 4 << 30
MIN_KEPT_STEPS = 4
# A joiner of synchronous steps takes up its shadow (_Shadow) once at most this many kept
# steps are left to replay: those few in poll (an optimizer step each), which overlaps the
# members' forward and backward.
SWAP_LAG = 1


def pair_prefix(generation: int, joiner: int) -> str:
    """Where the catch-up group of generation `generation`'s joiner at rank `joiner` forms."""
    return Keys.catchup_prefix(generation, joiner)


def eligible(reports: Sequence[tuple[bool, int]], src: int, need: Sequence[int], *, has_buffers: bool) -> bool:
    """Whether the ranks of `need` catch up in the background rather than receive the
    state in the generation change (module docstring). `reports`: every rank's (holds
    the state, its step). The same answer on every rank. Pure."""
    if not need or has_buffers or 0 in need or not reports[src][0]:
        return False
    if any(reports[r][0] for r in need):
        return False  # a rank holding an older state: it gets the newest one now
    return len({s for has, s in reports if has}) == 1


def steps_refusal(*, replicated: bool, scaler: bool, hook: bool) -> str | None:
    """Why a joiner of synchronous steps cannot catch up by replaying the optimizer steps
    it missed (module docstring), or None. The same answer on every rank. Pure."""
    if not replicated:
        return ("the gradients are not the plain replicated path's (shard= steps each rank's own shard; "
                "compress= keeps each rank's own error feedback)")
    if scaler:
        return "a GradScaler is in use (its skipped steps and scale are not replayed)"
    if hook:
        return "a before_optimizer_step hook is set (it may read parameters the joiner does not hold yet)"
    return None


def kept_cap(step_bytes: int) -> int:
    """How many steps' gradients (`step_bytes` each) a joiner of synchronous steps keeps
    before it asks for a newer copy. Pure."""
    return max(MIN_KEPT_STEPS, MAX_KEPT_BYTES // max(1, step_bytes))


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The param_groups' hyperparameters (every entry but "params"), copied: what a
    scheduler sets and optimizer.step reads."""
    return [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def set_hyperparameters(optimizer: torch.optim.Optimizer, groups: Sequence[dict]) -> None:
    """Put `groups` (hyperparameters()) into the optimizer's param_groups."""
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{len(groups)} param groups kept for an optimizer of {len(optimizer.param_groups)}")
    for g, h in zip(optimizer.param_groups, groups):
        for k, v in h.items():
            g[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v


@dataclass(frozen=True)
class StepRecord:
    """What the members' optimizer step of committed step `step` consumed (synchronous
    steps): the whole gradient (one flat host copy per dtype buffer of the replicated
    path: gradients.GradLayout), the param_groups' hyperparameters, and whether the step
    was skipped (inf/NaN under a GradScaler: no optimizer step)."""

    step: int
    grads: tuple[torch.Tensor, ...]
    groups: tuple[dict, ...]
    skipped: bool = False


def record_step(step: int, grads: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                skipped: bool = False) -> StepRecord:
    """A StepRecord of `grads` (host copies already) and the optimizer's hyperparameters now."""
    return StepRecord(step, tuple(grads), tuple(hyperparameters(optimizer)), skipped)


def replay_steps(params: Sequence[torch.Tensor], slots: Sequence[Slot], optimizer: torch.optim.Optimizer,
                 records: Sequence[StepRecord], device: torch.device) -> None:
    """The optimizer steps of `records`, in order, as the members took them: each with its
    hyperparameters and its gradient (each parameter's .grad a view of its dtype's flat
    buffer at its slot, as ReplicatedPath binds them). The parameters' .grad are put back
    afterwards; the hyperparameters are the last record's (take_up_steps puts the live
    ones back)."""
    held = [p.grad for p in params]
    try:
        for rec in records:
            if rec.skipped:
                continue
            set_hyperparameters(optimizer, rec.groups)
            flats = [g.to(device) for g in rec.grads]
            for p, s in zip(params, slots):
                p.grad = flats[s.group][s.offset:s.offset + s.numel].view_as(p)
            optimizer.step()
    finally:
        for p, g in zip(params, held):
            p.grad = g


def take_up_steps(model: torch.nn.Module, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                  saved: dict, records: Sequence[StepRecord], slots: Sequence[Slot], device: torch.device) -> None:
    """A joiner of synchronous steps adopts the state it received (`saved`: parameters and
    optimizer state of an earlier step) and replays the steps committed since
    (`records`), so it holds the members' state, bit for bit; its param_groups'
    hyperparameters stay its own live ones (its scheduler set them as the members' did)."""
    live = hyperparameters(optimizer)
    with torch.no_grad():
        own = model.state_dict()
        for k, v in saved["model"].items():
            own[k].copy_(v)
    optimizer.load_state_dict(saved["optimizer"])
    replay_steps(params, slots, optimizer, records, device)
    set_hyperparameters(optimizer, live)


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None)
                or getattr(optimizer, "_optimizer_step_post_hooks", None))


def shadow_optimizer(optimizer: torch.optim.Optimizer, shadow_of: dict[int, torch.Tensor]) -> Any:
    """An optimizer of `optimizer`'s class and param_groups over the shadow tensors
    (`shadow_of`: a parameter's id -> its shadow) that shares nothing the replay changes:
    a shallow copy (torch's Optimizer.__getstate__ carries only defaults, state and
    param_groups: not an LR scheduler's step wrapper, bound to `optimizer`, nor hooks)
    with param_groups and state of its own. None where the optimizer has step hooks
    (the members' steps ran them; the shadow's would not): the replay stays in poll."""
    if _has_step_hooks(optimizer):
        return None
    shadow = copy.copy(optimizer)
    shadow.state = defaultdict(dict)
    shadow.param_groups = [{**g, "params": [shadow_of[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return shadow


class _Shadow:
    """A joiner's replay off the members' critical path (synchronous steps). From the
    moment the joiner starts waiting for the state of step `version` (its admission, or
    its ask for a newer copy), a thread waits for it on `transfer` and, as soon as it
    arrives (not at the next step's start: the poll after the arrival finds it built),
    unpacks it into tensors of its own (the model's parameters' values, the rest of the
    model's state dict, and an optimizer over them: shadow_optimizer, loaded with the
    received state) and replays the kept steps on them in order as they are kept (`add`,
    the main thread); `take` stops it between two steps; `swap_into` hands the result to
    the job. Started by `start` (no thread in the constructor)."""

    def __init__(self, transfer: Transfer, version: int, model: torch.nn.Module, params: Sequence[torch.Tensor],
                 optimizer: torch.optim.Optimizer, slots: Sequence[Slot], device: torch.device) -> None:
        self._transfer, self.version = transfer, version
        self._model, self._live, self._order = model, optimizer, [id(p) for p in params]
        self._slots, self._device = slots, device
        self.of: dict[int, torch.Tensor] = {}  # a parameter's id -> its shadow (the thread fills it)
        self._rest: dict[str, torch.Tensor] = {}  # the received state dict's entries that are not parameters
        self.optimizer: Any = None
        self._todo: list[StepRecord] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.built = False  # the received state is unpacked into the shadow (the thread)
        self._busy = False  # unpacking, or replaying a step
        self.error: str | None = "the optimizer has step hooks" if _has_step_hooks(optimizer) else None

    def start(self) -> "_Shadow":
        if self.error is None:
            threading.Thread(target=self._run, name="eltctl-catch-up-replay", daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            if not self._transfer.wait_for(self.version, self._stop):
                return  # dropped, broke, or a newer copy came: the joiner never takes this one up
            with self._cond:
                if self._stop.is_set():
                    return
                self._busy = True
            self._build(self._transfer.got)
            while True:
                with self._cond:
                    self.built, self._busy = True, False
                    self._cond.notify_all()
                    while not self._todo and not self._stop.is_set():
                        self._cond.wait()
                    if self._stop.is_set():
                        return
                    rec, self._busy = self._todo.pop(0), True
                replay_steps([self.of[i] for i in self._order], self._slots, self.optimizer, [rec], self._device)
        except Exception as e:  # noqa: BLE001 - the joiner then replays in poll, as without a shadow
            self.error = f"{type(e).__name__}: {e}"
            log.warning("catch-up: the replay beside the job failed (%s); it replays in the step instead", self.error)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _build(self, got: tuple[int, bytes, torch.Tensor] | None) -> None:
        """The received state (of `version`) into the shadow: what take_up_steps puts into
        the model (its whole state dict) and the optimizer (loaded into a shadow one)."""
        if got is None or got[0] != self.version:
            raise RuntimeError(f"the state of step {self.version} was expected, not {got and got[0]}")
        saved = state_mod.unpack(got[1], got[2])
        named = dict(self._model.named_parameters())
        with torch.no_grad():
            for name, p in named.items():
                self.of[id(p)] = torch.empty_like(p).copy_(saved["model"][name])
        self._rest = {k: v for k, v in saved["model"].items() if k not in named}
        self.optimizer = shadow_optimizer(self._live, self.of)
        self.optimizer.load_state_dict(saved["optimizer"])

    def add(self, rec: StepRecord) -> None:
        with self._cond:
            self._todo.append(rec)
            self._cond.notify_all()

    def behind(self) -> int:
        """How many kept steps are not replayed yet (a large number until it is built)."""
        with self._cond:
            return len(self._todo) + self._busy if self.built else 1 << 30

    def take(self) -> list[StepRecord]:
        """Stop the thread once what it does is done (the unpacking, a step's replay): the
        records it left. Only a `built` shadow can be swapped in then."""
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
            while self._busy:
                self._cond.wait()
            return list(self._todo)

    def swap_into(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, left: Sequence[StepRecord]) -> None:
        """After `take`, a built shadow: replay the steps `left`, then the model takes the
        shadow's parameters and the rest of the received state dict (copies: no autograd
        graph is alive at a step's start) and the optimizer the shadow's state tensors
        (moved, not copied); its param_groups' hyperparameters stay its own live ones.
        The same bits as take_up_steps."""
        replay_steps([self.of[i] for i in self._order], self._slots, self.optimizer, left, self._device)
        with torch.no_grad():
            own = model.state_dict()
            for k, v in self._rest.items():  # first: a tied parameter's second name is among them
                own[k].copy_(v)
            for p in model.parameters():
                p.copy_(self.of[id(p)])
        optimizer.state.clear()
        for g, h in zip(optimizer.param_groups, self.optimizer.param_groups):
            for p, q in zip(g["params"], h["params"]):
                if q in self.optimizer.state:
                    optimizer.state[p] = self.optimizer.state[q]

    def close(self) -> None:
        with self._cond:
            self._stop.set()
            self._cond.notify_all()


def still_catching_up(flags: Sequence[float]) -> frozenset[int]:
    """The ranks whose slot in a round's averaging says they are still catching up. Pure."""
    return frozenset(r for r, f in enumerate(flags) if f > 0)


def wants_new_copy(flags: Sequence[float]) -> frozenset[int]:
    """The ranks whose slot says they dropped what they kept and want the newest round's
    start (MAX_MISSED_ROUNDS). Pure."""
    return frozenset(r for r, f in enumerate(flags) if f >= AGAIN)


def replay_outer_step(params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor], outer: Any,
                      mean: torch.Tensor | None) -> None:
    """One round's end as the members took it (LocalPath.average), from the round's start
    in `anchor` and the weighted mean delta they all-reduced (`mean`, flat; None: the
    round had no samples, no outer step): the parameters and `anchor` become the next
    round's start, the outer optimizer's state steps with them. The same operations on the
    same values as the members': the same result, bit for bit."""
    with torch.no_grad():
        for p, a in zip(params, anchor):
            p.copy_(a)
        if mean is not None:
            pos = 0
            for p in params:
                k = p.numel()
                p.grad = mean[pos:pos + k].to(p.device).view_as(p).to(p.dtype)
                pos += k
            outer.step()
        for p, a in zip(params, anchor):
            p.grad = None
            a.copy_(p)


class CatchUp:
    """The catch-up of this generation's joiners (module docstring), on every rank: which
    ranks are catching up (`idle`, agreed), and this rank's transfers. `job`: the
    ElasticJob, `rounds`: its LocalPath (neither imported here), None for synchronous
    steps (the job's replicated path calls in then: ReplicatedPath.catchup)."""

    def __init__(self, job: Any, rounds: Any) -> None:
        self._job = job
        self._rounds = rounds
        self.idle: frozenset[int] = frozenset()  # the ranks catching up (the same on every rank)
        self.source = -1  # the rank their state comes from (the same on every rank)
        self._sending: dict[int, Transfer] = {}  # the source: one per joiner
        self._receiving: Transfer | None = None  # a joiner: its own
        self._ready = False  # this joiner took up the state (before the averaging; synchronous: this step)
        self._awaiting = -1  # a joiner: the step (a round's start) whose state it waits for
        # A joiner: the mean delta of each round that ended since that round start (None:
        # a round without samples, no outer step), replayed once the state arrives.
        self._missed: list[torch.Tensor | None] = []
        # A joiner of synchronous steps: what each step since _awaiting consumed, and how many it keeps.
        self._kept: list[StepRecord] = []
        self._cap = MIN_KEPT_STEPS
        self._again = False  # a joiner: it dropped _missed and asks for the newest round's start
        self._recopy = False  # the source: a joiner asked for a newer copy
        self.packing: threading.Event | None = None  # the source: set once its copy of the state is taken
        self.packing_inner: threading.Event | None = None  # local steps: set once its inner state is copied
        self.link = Link()  # the source: its job's reduction on the wire (the transfers wait for it)
        self._shadow: _Shadow | None = None  # a joiner of synchronous steps: its replay beside the job

    def _set_idle(self, idle: frozenset[int]) -> None:
        self.idle = idle
        j = self._job
        j._shares.idle = idle
        if self._rounds is None and isinstance(j._grads, ReplicatedPath):
            j._grads.catchup = self if idle else None  # its per-step hooks, only while someone catches up

    def reset(self) -> None:
        """A generation forms: whatever was under way is dropped (module docstring)."""
        self.hold()
        for t in self._sending.values():
            t.close()
        if self._receiving is not None:
            self._receiving.close()
        self._drop_shadow()
        self.link.free()
        self._sending, self._receiving, self._ready = {}, None, False
        self._missed, self._kept, self._again, self._recopy = [], [], False, False
        self._job._shares.ready = self._job._shares.again = False
        self._set_idle(frozenset())

    def admit(self, reports: Sequence[tuple[bool, int]], src: int, need: Sequence[int]) -> bool:
        """In the state agreement (every rank alike): True if the ranks of `need` catch up
        in the background; then they have the progress, the extra state and the
        optimizer's hyperparameters, and the source's transfers are under way. False: the
        agreement moves the state as before."""
        j = self._job
        if not eligible(reports, src, need, has_buffers=any(True for _ in j.model.buffers())):
            return False
        if self._rounds is None:
            why = steps_refusal(replicated=type(j._grads) is ReplicatedPath, scaler=j._update.scaler is not None,
                                hook=j._update.hooked)
            if why:
                if j._rank == src:
                    log.info("worker %s: the joiner(s) take the state in the generation change, not in the "
                             "background: %s", j.worker_id, why)
                return False
        try:  # a catching-up rank's script gets an empty batch (the same answer on every rank)
            j._feeder.fetch(j._sampler, [])
        except Exception as e:  # noqa: BLE001 - the dataset's collate cannot make one: the usual transfer
            log.warning("worker %s: the joiner(s) take the state in the generation change, not in the background: "
                        "the job cannot make the empty batch a catching-up rank is handed (%s: %s); a collate_fn "
                        "that accepts [] makes the catch-up possible", j.worker_id, type(e).__name__, e)
            return False
        light = state_mod.pack({"progress": j._progress(), "extra_state": state_mod.extra_state_dicts(j._extra),
                                "param_groups": hyperparameters(j.optimizer)}) if j._rank == src else None
        got = transfer.send_packed(j._pg, light, src, j._rank, need, j._abort, j._device)
        store, bind, g = j._session.store, j._session.bind_host, j.generation
        self.source = src
        if got is not None:
            small = state_mod.unpack(*got)
            j._set_progress(small["progress"])
            saved = small.get("extra_state") or {}
            for name, obj in j._extra.items():
                if name in saved:
                    obj.load_state_dict(saved[name])
            # The script's scheduler steps from the members' values (a chainable one reads them).
            set_hyperparameters(j.optimizer, small["param_groups"])
            j._buffers.mark()
            self._await(Transfer(store, bind, pair_prefix(g, j._rank), False, f"rank {j._rank}", g,
                                 j._plan.to_json()), j._step)
            log.info("worker %s: catching up at step %d: the state comes from rank %d in the background",
                     j.worker_id, j._step, src)
        elif j._rank == src:
            for r in need:
                self._sending[r] = Transfer(store, bind, pair_prefix(g, r), True, f"rank {r}", g, j._plan.to_json(),
                                             self.link)
            self._copy()
            log.info("worker %s: rank(s) %s catch up at step %d; their state goes in the background", j.worker_id,
                     ", ".join(map(str, need)), j._step)
        self._set_idle(frozenset(need))
        return True

    def _await(self, t: Transfer, step: int) -> None:
        """A joiner: its state, of step `step`, comes over `t`; synchronous, a shadow waits for
        it there (`_shadow_for`)."""
        j = self._job
        self._receiving, self._awaiting = t, step
        self._cap = kept_cap(sum(p.numel() * p.element_size() for p in j._params))
        self._shadow_for(step)

    def _drop_shadow(self) -> None:
        if self._shadow is not None:
            self._shadow.close()
            self._shadow = None

    def _shadow_for(self, step: int) -> None:
        """Synchronous: a shadow (_Shadow) that takes up the state of `step` as soon as it
        arrives, in place of one for an older copy."""
        self._drop_shadow()
        if self._rounds is None:
            j = self._job
            self._shadow = _Shadow(self._receiving, step, j.model, j._params, j.optimizer, j._grads.layout.slots,
                                   j._device).start()

    # -- each step, only while some rank catches up -----------------------------------------
    def poll(self) -> None:
        """A joiner, before its step's tail: if its transfer brought the state it waits for
        (synchronous: and it kept every step since), take it up (`_take_up`) and say so in
        the tail (Shares.ready: READY_SLOT). Synchronous, one that kept `kept_cap` steps
        drops them and asks for a newer copy (Shares.again: AGAIN_SLOT)."""
        t = self._receiving
        j = self._job
        if t is None or self._ready or j._rank not in self.idle:
            return
        got = t.got
        if got is not None and got[0] == self._awaiting and self._kept_all():
            s = self._shadow  # synchronous: unpacked and replayed beside the job since the arrival
            if s is None or s.error is not None or s.behind() <= SWAP_LAG or len(self._kept) >= self._cap:
                self._take_up(got)
                j._shares.ready = True
        elif self._rounds is None and len(self._kept) >= self._cap:
            log.info("worker %s: the state of step %d has not arrived after %d steps; it asks for a newer copy",
                     j.worker_id, self._awaiting, len(self._kept))
            # The copy of the state after this step: the source takes it after its optimizer step (stepped).
            self._kept, self._awaiting = [], j._step + 1
            j._shares.again = True
            self._shadow_for(self._awaiting)

    def _kept_all(self) -> bool:
        """Synchronous: the steps kept are every step committed since the state awaited."""
        return self._rounds is not None or [r.step for r in self._kept] == list(
            range(self._awaiting + 1, self._job._step + 1))

    def tail_summed(self, tail: torch.Tensor) -> None:
        """Synchronous: a step's tail, summed (ReplicatedPath.finish, every all-reduce
        waited for: the link is free for the transfers again): `tail_seen`."""
        self.link.free()
        self.tail_seen(tail_layout(self._job.world_size).decode(tail).pace)

    def tail_seen(self, paces: Sequence[float]) -> None:
        """A step's tail, summed (every rank alike): the catching-up ranks whose pace slot
        says they took up the state (READY_SLOT) are members like the others from the next
        step on: shares, and their transfers end. The source notes a joiner that asks for a
        newer copy (AGAIN_SLOT, synchronous)."""
        if any(paces[r] == AGAIN_SLOT for r in self._sending):
            self._recopy = True
        self._job._shares.again = False
        done = frozenset(r for r in self.idle if paces[r] == READY_SLOT)
        if done:
            self._caught_up(self.idle - done, self._job._step + 1)

    def replaces_step(self, path: Any, optimizer: torch.optim.Optimizer) -> bool:
        """Synchronous, in place of the optimizer step (ReplicatedPath.step, after the
        unscale and the clipping): the source first waits for its copy of the state
        (`hold`); a joiner still catching up keeps what the step consumes (a StepRecord:
        the gradient, the hyperparameters) instead of stepping: True."""
        if self.packing is not None:
            self.hold()
        j = self._job
        if j._rank not in self.idle or self._ready:
            return False
        step = j._step + 1
        if step > self._awaiting:  # a step after the state it asked for (AGAIN) is kept
            rec = record_step(step, path.gradient_copy(), optimizer)
            self._kept.append(rec)
            if self._shadow is not None:
                self._shadow.add(rec)
        return True

    def stepped(self) -> None:
        """Synchronous, after the optimizer step: the source copies the state for a joiner
        that asked for a newer one, now, so the copy overlaps the next step's compute."""
        if self._recopy and self._sending:
            self._recopy = False
            self._copy(self._job._step + 1)

    def at_end(self) -> list[int]:
        """Synchronous, the job's end or a stop while ranks catch up (every rank alike): a
        joiner waits for its transfer and takes up the state; then one small all-reduce says
        which ranks could not (their transfer broke): returned, they receive the state from
        the source over the job's group (StateAgreement.caught_up_at_end), then `ended`.
        Raises Aborted (the group broke)."""
        j = self._job
        lacking = torch.zeros(j.world_size, dtype=torch.float32, device=j._device)
        t = self._receiving
        if j._rank in self.idle and not self._ready:
            if t is not None and t.wait_for(self._awaiting, j._abort) and self._kept_all():
                self._take_up(t.got)
            else:
                lacking[j._rank] = 1.0
        lacking = collectives.allreduce(j._pg, lacking, j._abort).cpu()
        return [r for r in sorted(self.idle) if lacking[r] > 0]

    def ended(self) -> None:
        """Every catching-up rank holds the state (at_end): they are members like the others."""
        self._caught_up(frozenset(), self._job._step)

    def _caught_up(self, idle: frozenset[int], step: int) -> None:
        """The ranks no longer in `idle` caught up at `step`: they train from the next one,
        and their transfers end."""
        j = self._job
        if j._rank in self.idle and j._rank not in idle:
            j._agreement.has_state = True
            j._shares.ready = self._ready = False
            self._drop_shadow()  # the state came over the job's group instead (at_end)
            log.info("worker %s: caught up at step %d; it trains from the next step", j.worker_id, step)
        for r in [r for r in self._sending if r not in idle]:
            self._sending.pop(r).close()
        if self._receiving is not None and j._rank not in idle:
            self._receiving.close()
            self._receiving = None
        self._set_idle(idle)

    # -- a round's end (LocalPath.average), only while some rank catches up ----------------
    def before_average(self, final: bool) -> None:
        """A joiner: if its transfer brought the round start it waits for (at the job's end
        or a stop, it waits for it: module docstring), take it up: it then holds this
        round's start. One that has kept MAX_MISSED_ROUNDS means asks for the newest instead."""
        j, t = self._job, self._receiving
        self.hold()
        if self._sending and not final:  # the averaging gets the link first (at the end the state goes first)
            self.link.busy()
        self._again = False
        if t is None or j._rank not in self.idle or self._ready:
            return
        if final:
            t.wait_for(self._awaiting, j._abort)
        got = t.got
        if got is None or got[0] != self._awaiting:
            if len(self._missed) >= MAX_MISSED_ROUNDS:  # too far behind: the newest round's start instead
                self._missed, self._again, self._awaiting = [], True, j._step
            return
        self._take_up(got)

    def _take_up(self, got: tuple[int, bytes, torch.Tensor]) -> None:
        """Adopt the state received and replay what happened since: synchronous, the
        optimizer steps kept (`take_up_steps`); local, the outer steps of the rounds that
        ended since (`_missed`): this joiner then holds the current round's start, the outer
        optimizer's state and the source's inner state. Its hyperparameters stay its own
        (its scheduler stepped them as the members' did)."""
        j = self._job
        r = self._rounds
        if r is None:
            s, self._shadow, left = self._shadow, None, self._kept
            if s is not None:
                left = s.take()
            if s is not None and s.error is None and s.built:
                s.swap_into(j.model, j.optimizer, left)
                where = f"{len(self._kept) - len(left)} of them beside the job"
            else:
                take_up_steps(j.model, j._params, j.optimizer, state_mod.unpack(got[1], got[2]), self._kept,
                              j._grads.layout.slots, j._device)
                where = "in the step"
            log.info("worker %s: the state of step %d arrived; the %d optimizer step(s) since replayed (%s)",
                     j.worker_id, self._awaiting, len(self._kept), where)
            self._kept = []
            self._ready = True
            return
        saved = state_mod.unpack(got[1], got[2])
        with torch.no_grad():
            own = j.model.state_dict()
            for k, v in saved["model"].items():
                own[k].copy_(v)
                r._snap[k].copy_(v)  # the anchor: views of the snapshot
        live = hyperparameters(j.optimizer)
        j.optimizer.load_state_dict(saved["optimizer"])
        set_hyperparameters(j.optimizer, live)
        r._outer.load_state_dict(saved[OUTER_KEY])
        for mean in self._missed:
            replay_outer_step(r._params, r._anchor, r._outer, mean)
        if self._missed:
            log.info("worker %s: the state of step %d arrived; the outer steps of %d round(s) since replayed",
                     j.worker_id, self._awaiting, len(self._missed))
        self._missed = []
        self._ready = True

    def flags(self, out: torch.Tensor) -> None:
        """This rank's slot in the averaging (STILL, AGAIN; 0 once caught up)."""
        out.zero_()
        if self._job._rank in self.idle and not self._ready:
            out[self._job._rank] = AGAIN if self._again else STILL

    def after_average(self, flags: Sequence[float], mean: torch.Tensor | None) -> None:
        """The averaging is done (`mean`: the weighted mean delta the outer step took, None
        where the round had no samples): who still catches up (the same on every rank); a
        joiner still catching up keeps `mean` to replay (`_take_up`)."""
        j = self._job
        self.link.free()
        idle = still_catching_up(flags)
        if j._rank in idle and not self._again:
            self._missed.append(None if mean is None else mean.to("cpu", copy=True))
        self._recopy = bool(wants_new_copy(flags) & set(self._sending))
        self._again = False
        self._caught_up(idle, j._step)

    def round_started(self) -> None:
        """The source: a joiner that asked for it gets the new round's start."""
        if self._sending and self._recopy:
            self._recopy = False
            self._copy()

    def _copy(self, version: int | None = None) -> None:
        """The source: its state (of step `version`, by default the last committed one: at
        a join's boundary, or this round's start) copied into host memory for the
        transfers, on a thread, while the next step's forward and backward run; what would
        change it waits for the copy (`hold`: the next inner or optimizer step, the round's
        end, a new generation)."""
        j = self._job
        self.hold()
        version = j._step if version is None else version
        captured = j._capture_state()  # references: the round's start, the inner and outer state
        done = self.packing = threading.Event()
        # Local steps: an inner step changes only the inner optimizer's state, copied first (hold_inner).
        inner = self.packing_inner = threading.Event() if self._rounds is not None else None
        senders = list(self._sending.values())

        def copy() -> None:
            try:
                packed = state_mod.pack(captured, first=captured.get("optimizer") if inner else None,
                                        then=inner.set if inner else None)
                for t in senders:
                    t.offer(version, packed)
            except Exception as e:  # noqa: BLE001 - the joiners then get the state in the next generation
                log.warning("worker %s: the copy of the state for the joiners failed: %s", j.worker_id, e)
            finally:
                if inner is not None:
                    inner.set()
                done.set()

        threading.Thread(target=copy, name="eltctl-catch-up-copy", daemon=True).start()

    def hold(self) -> None:
        """The source, before its state changes: wait for the copy under way (`_copy`)."""
        if self.packing is not None:
            self.packing.wait()
            self.packing = self.packing_inner = None

    def hold_inner(self) -> None:
        """Local steps' source, before an inner step: wait until the copy under way holds the
        inner optimizer's state (copied first); the round's start and the outer state it
        copies next change only at the round's end, which waits for the whole (`hold`)."""
        if self.packing_inner is not None:
            self.packing_inner.wait()
        elif self.packing is not None:
            self.hold()

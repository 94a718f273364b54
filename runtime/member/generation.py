"""One member's life across generations: the membership state machine that
ElasticJob (train/job.py) and the restart supervisor (restart/supervisor.py) both run.

member/plan.py holds the plans and the pure decisions (who is in the next
generation); this module is the executor that carries them out for one member:
wait to be admitted, form the generation's process group and check its pairs,
hand the group to the user to agree on the state, run, and at a change either
plan the next generation (a join or a planned leave, at a boundary) or, after an
abort, hold the roll call that forms it. Everything a user does differently is a
hook (`GenerationHooks`); the states and their transitions are written once::

    ADMITTING --admitted--------------------------------> FORMING
    ADMITTING --job done, or gave up--------------------> DONE
    FORMING   --group formed, pairs checked, on_group---> RUNNING
    FORMING   --named a leaver of the new plan, on_leave-> LEFT
    FORMING   --not named at all------------------------> EXCLUDED  (ExcludedFromJob)
    FORMING   --Aborted---------------------------------> RECOVERING
    RUNNING   --planned change (join / leave)-----------> CHANGING
    RUNNING   --Aborted (collective, abort key, dead)----> RECOVERING
    RUNNING   --finished or stopped---------------------> DONE
    CHANGING  --next plan decided-----------------------> FORMING
    CHANGING  --every member leaves, on_leave-----------> LEFT
    CHANGING  --Aborted---------------------------------> RECOVERING
    RECOVERING --roll call decided the next plan--------> FORMING
    any live phase --the store lost for good------------> DONE

The restart supervisor owns its thread and runs the whole machine (`run`);
ElasticJob's loop is the training script's, so it steps the same machine at its
step boundaries (`admit`, `change`, `recover`, `enter`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable

import torch

from . import collectives
from .collectives import Aborted
from .plan import Plan, Verdict, await_admission, decide, propose, roll_call, scan_joiners
from ..store.pgstore import pg_store
from ..protocol import EventKind, Keys, peek_many, set_and_peek

log = logging.getLogger("eltctl_runtime")

# After this member's own collective failed (a connection reset: some peer is
# gone), a member silent this long is taken as dead without waiting for the
# full hang timeout. A host that vanishes has no daemon left to report it.
CRASH_CONFIRM_S = 2.0
# How long the roll call sleeps between two looks (each look is one request: the next
# plan, the members' answers and death reports; was 10 ms with 2 requests per member).
ROLL_CALL_POLL_S = 0.005


class ExcludedFromJob(RuntimeError):
    """This worker is no longer a member (it was hung or partitioned and the
    others went on without it). It must exit without touching anything."""


class Phase(str, Enum):
    """Where a member is in its generations (the graph: module docstring)."""

    ADMITTING = "admitting"
    FORMING = "forming"
    RUNNING = "running"
    CHANGING = "changing"
    RECOVERING = "recovering"
    LEFT = "left"
    DONE = "done"
    EXCLUDED = "excluded"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.ADMITTING: frozenset({Phase.FORMING, Phase.DONE}),
    Phase.FORMING: frozenset({Phase.RUNNING, Phase.LEFT, Phase.EXCLUDED, Phase.RECOVERING, Phase.DONE}),
    Phase.RUNNING: frozenset({Phase.CHANGING, Phase.RECOVERING, Phase.DONE}),
    Phase.CHANGING: frozenset({Phase.FORMING, Phase.LEFT, Phase.RECOVERING, Phase.DONE}),
    Phase.RECOVERING: frozenset({Phase.FORMING, Phase.DONE}),
    Phase.LEFT: frozenset(),
    Phase.DONE: frozenset(),
    Phase.EXCLUDED: frozenset(),
}


def _nothing(_arg) -> None:
    pass


@dataclass(frozen=True)
class GenerationHooks:
    """What a user of `Generations` does at its transitions (callables; the
    defaults do nothing). Each runs on the thread that drives the machine; any may
    raise Aborted (the generation broke).

    before_group(plan): this member is in `plan` (its rank is known); the previous
        group is gone and the new one is about to form: drop what belonged to the
        old generation.
    on_group(plan): the generation's group is formed and every pair checked: agree
        on the state and start running (RUNNING once it returns).
    on_leave(plan | None): this member leaves the job: it is a planned leaver of
        `plan`, or (None) every member leaves and the job pauses.
    on_abort(error): the generation broke (`run` only); before the roll call.
    """

    before_group: Callable[[Plan], None] = _nothing
    on_group: Callable[[Plan], None] = _nothing
    on_leave: Callable[[Plan | None], None] = _nothing
    on_abort: Callable[[Aborted], None] = _nothing


class Generations:
    """One member's state machine (module docstring). `store` is a function that
    returns the job's store as it is now (a user may reconnect it); `control` is the
    member's ControlThread. The constructor does no I/O."""

    def __init__(self, me: str, store: Callable[[], object], control, hooks: GenerationHooks, *,
                 device: torch.device, bind_host: str, max_workers: int | None, hang_timeout_s: float,
                 label: str = "worker", group_name: str = "process group") -> None:
        self.me = me
        self._store = store
        self._control = control
        self._hooks = hooks
        self._device = device
        self._bind_host = bind_host
        self._max_workers = max_workers
        self._hang_timeout_s = hang_timeout_s
        self._label = label  # "worker" or "supervisor": the log lines and the exclusion name it
        self._group_name = group_name
        self.phase = Phase.ADMITTING
        self.plan: Plan | None = None
        self.rank = -1
        self.pg = None
        self.pg_store = None  # the store pg formed on (pgstore.py): referenced while pg lives
        self.abort = None  # the current generation's abort event (control.watch)

    def _to(self, phase: Phase) -> None:
        if phase is not self.phase and phase not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"{self._label} {self.me}: no transition from {self.phase.value} to {phase.value}")
        self.phase = phase

    # -- the steps ------------------------------------------------------------------
    def admit(self, *, min_workers: int, give_up: Callable[[], bool] = lambda: False,
              restarted_wait_s: float = 120.0) -> Plan | None:
        """Register as a (warm) joiner and wait to be named by a plan
        (membership.await_admission); None (DONE): the job is over, or `give_up`."""
        plan = await_admission(self._store(), self.me, self._control, min_workers=min_workers,
                               max_workers=self._max_workers, hang_timeout_s=self._hang_timeout_s,
                               give_up=give_up, restarted_wait_s=restarted_wait_s)
        self._to(Phase.FORMING if plan is not None else Phase.DONE)
        return plan

    def enter(self, plan: Plan) -> bool:
        """Enter generation `plan`: False (LEFT) if this member is one of its planned
        leavers (`on_leave`), ExcludedFromJob if it is not named at all, else True
        once the group is formed, its pairs checked and `on_group` returned (RUNNING).
        Raises Aborted (RECOVERING) if the generation breaks meanwhile."""
        self._to(Phase.FORMING)
        previous = self.plan
        if self.me not in plan.members:
            if previous is not None and self.me in plan.left:
                log.info("%s %s: left the job (generation %d)", self._label, self.me, plan.generation)
                self.plan = plan
                self._to(Phase.LEFT)
                self._hooks.on_leave(plan)
                return False
            self._to(Phase.EXCLUDED)
            raise ExcludedFromJob(
                f"{self._label} {self.me} is not a member of generation {plan.generation} "
                f"(members: {', '.join(plan.members)}); it was presumed hung or dead and must exit")
        self.plan = plan
        self.rank = plan.members.index(self.me)
        self.abort = abort = self._control.watch(plan)
        try:
            old, old_store, self.pg = self.pg, self.pg_store, None
            self._hooks.before_group(plan)  # the user lets go of the old group first
            if old is not None:
                if plan.lost == ():
                    # No work in flight: gloo's destructor (10-60 ms) runs off the pause.
                    collectives.release(old, old_store)
                else:
                    collectives.bury(old, old_store)
            del old, old_store
            # Signed (pgstore.py): a forged peer address fails the group's construction
            # (Aborted: the roll call forms the next generation), never connects to it.
            # Kept referenced as long as the group: its C++ side calls back into it.
            self.pg_store = prefix = pg_store(self._store(), plan.generation)
            rank, size, device, bind = self.rank, plan.world_size, self._device, self._bind_host
            self.pg = collectives.run_abortable(lambda: collectives.make_group(prefix, rank, size, device, bind),
                                                abort, f"{self._group_name} of generation {plan.generation}")
            # Every pair signed before any collective (gloo's listener gives a pair to whoever
            # connects first): a wrong or missing peer message aborts the generation (counted).
            collectives.verify_pairs(self.pg, self._store(), plan.generation, collectives.group_id(plan.to_json()),
                                     rank, size, device, abort, peers=list(plan.members), listen=bind)
            self._hooks.on_group(plan)
        except Aborted:
            self._to(Phase.RECOVERING)
            raise
        self._to(Phase.RUNNING)
        return True

    def change(self, leavers: Iterable[str], kind: EventKind) -> Plan | None:
        """A planned change at a boundary (every member calls it alike): the next
        plan, decided (compare_set: the first proposal wins), or None (LEFT, after
        `on_leave(None)`) when every member leaves. Enter the plan with `enter`."""
        self._to(Phase.CHANGING)
        plan = self.plan
        leavers = set(leavers)
        survivors = [w for w in plan.members if w not in leavers]
        queue, upto = scan_joiners(self._store(), plan.join_upto)
        proposal = propose(plan, survivors, queue, upto, self._max_workers, kind, time.time())
        if not proposal.members:
            self._to(Phase.LEFT)
            self._hooks.on_leave(None)
            return None
        return decide(self._store(), proposal)

    def recover(self, peer_gone: bool, alive: str) -> Plan:
        """After an abort: mark the generation aborted, answer its roll call with
        `alive` (this member's progress), drop the group, and wait for the next plan,
        deciding it from the roll call when nobody has yet. `peer_gone`: this
        member's own collective failed, so a silent member is gone after
        CRASH_CONFIRM_S rather than the hang timeout."""
        self._to(Phase.RECOVERING)
        plan, st = self.plan, self._store()
        g = plan.generation
        limit = min(self._hang_timeout_s, CRASH_CONFIRM_S) if peer_gone else self._hang_timeout_s
        st.compare_set(Keys.abort(g), "", json.dumps({"reason": "error", "worker": self.me}))
        collectives.bury(self.pg, self.pg_store)
        self.pg = self.pg_store = None
        others = [w for w in plan.members if w != self.me]
        # The roll call in one request per look: the next plan, every other member's answer
        # and death report (verified values: a forged one reads as missing, counted); the
        # first look also writes this member's answer (protocol.set_and_peek).
        keys = [Keys.plan(g + 1)] + [Keys.alive(g, w) for w in others] + [Keys.dead(w) for w in others]
        values = set_and_peek(st, [(Keys.alive(g, self.me), alive)], keys)
        while True:
            if values[0] is not None:
                return Plan.from_json(values[0])
            answered = dict(zip(others, values[1:1 + len(others)]))
            dead = dict(zip(others, values[1 + len(others):]))
            verdicts = {w: Verdict.SURVIVOR if w == self.me else roll_call(
                alive=answered[w] is not None, dead=dead[w] is not None,
                silent_for_s=self._control.silence(w), hang_timeout_s=limit) for w in plan.members}
            if Verdict.UNKNOWN not in verdicts.values():
                survivors = [w for w in plan.members if verdicts[w] is Verdict.SURVIVOR]
                lost = [w for w in plan.members if verdicts[w] is Verdict.GONE]
                crashed = peer_gone or any(dead[w] is not None for w in lost)
                queue, upto = scan_joiners(st, plan.join_upto)
                kind = EventKind.CRASH if crashed else EventKind.HANG
                return decide(st, propose(plan, survivors, queue, upto, self._max_workers, kind, time.time()))
            time.sleep(ROLL_CALL_POLL_S)
            values = peek_many(st, keys)

    def done(self) -> None:
        """The job ended for this member (finished, stopped, or the store lost)."""
        if self.phase not in (Phase.LEFT, Phase.DONE, Phase.EXCLUDED):
            self._to(Phase.DONE)

    def close(self) -> None:
        """Drop the group without blocking (collectives.bury)."""
        collectives.bury(self.pg, self.pg_store)
        self.pg = self.pg_store = None

    # -- the whole machine, for a user that owns its thread ------------------------------
    def run(self, plan: Plan | None, running: Callable[[], Plan | None], alive: Callable[[], str]) -> None:
        """From an admitted `plan` to the end: enter each generation, run it
        (`running()` returns the next plan, or None when this member is done), and
        after an abort (`on_abort`, then the roll call) enter the one that follows."""
        while plan is not None:
            try:
                if not self.enter(plan):
                    return
                plan = running()
            except Aborted as e:
                log.warning("%s %s: generation %d aborted: %s (%s)", self._label, self.me, self.plan.generation,
                            e, self._control.abort_reason())
                self._to(Phase.RECOVERING)
                self._hooks.on_abort(e)
                plan = self.recover(e.backend_error, alive())

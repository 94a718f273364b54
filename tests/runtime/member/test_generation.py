"""The membership state machine (runtime/generation.py) on an in-memory store: its
transitions as written down, a planned change, the roll call after an abort, and
who leaves or is excluded. The group-forming part runs in the real-process tests
(test_elastic_scenarios.py, test_restart_mode.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from eltctl_runtime.member.generation import TRANSITIONS, ExcludedFromJob, GenerationHooks, Generations, Phase
from eltctl_runtime.member.plan import Plan
from eltctl_runtime.protocol import EventKind, Keys

from dictstore import DictStore


class QuietControl:
    """A control thread with nothing to report: every member was just heard from."""

    def watch(self, plan, others=()):
        return threading.Event()

    def silence(self, worker):
        return 0.0

    def abort_reason(self):
        return ""


class Recorder:
    def __init__(self):
        self.calls = []

    def before_group(self, plan):
        self.calls.append(("before_group", plan.generation))

    def on_group(self, plan):
        self.calls.append(("on_group", plan.generation))

    def on_leave(self, plan):
        self.calls.append(("on_leave", plan.generation if plan else None))

    def on_abort(self, error):
        self.calls.append(("on_abort", str(error)))


def machine(me, store, plan, phase=Phase.RUNNING):
    hooks = Recorder()
    gen = Generations(me, lambda: store, QuietControl(),
                      GenerationHooks(hooks.before_group, hooks.on_group, hooks.on_leave, hooks.on_abort), device=torch.device("cpu"),
                      bind_host="127.0.0.1", max_workers=None, hang_timeout_s=60.0)
    gen.plan, gen.rank, gen.phase = plan, plan.members.index(me) if me in plan.members else -1, phase
    return gen, hooks


def test_every_phase_has_its_transitions_and_the_ends_have_none():
    assert set(TRANSITIONS) == set(Phase)
    for end in (Phase.LEFT, Phase.DONE, Phase.EXCLUDED):
        assert TRANSITIONS[end] == frozenset()
    assert Phase.FORMING in TRANSITIONS[Phase.RECOVERING] and Phase.FORMING in TRANSITIONS[Phase.CHANGING]


def test_a_transition_not_written_down_is_refused():
    gen, _ = machine("a", DictStore(), Plan(0, ("a",)), phase=Phase.DONE)
    with pytest.raises(RuntimeError, match="no transition from done to forming"):
        gen._to(Phase.FORMING)


def test_planned_leave_decides_the_survivors_plan_and_admits_the_queued_joiner():
    store = DictStore()
    store.set(Keys.join(1), "c")
    gen, _ = machine("a", store, Plan(0, ("a", "b")))
    decided = gen.change({"b"}, EventKind.LEAVE)
    assert decided.members == ("a", "c") and decided.left == ("b",) and decided.joined == ("c",)
    assert Plan.from_json(store.get(Keys.plan(1))) == decided and gen.phase is Phase.CHANGING


def test_when_every_member_leaves_the_machine_is_left_and_no_plan_is_written():
    store = DictStore()
    gen, hooks = machine("a", store, Plan(0, ("a", "b")))
    assert gen.change({"a", "b"}, EventKind.LEAVE) is None
    assert gen.phase is Phase.LEFT and hooks.calls == [("on_leave", None)]
    assert not store.check([Keys.plan(1)])


def test_roll_call_after_a_crash_drops_the_dead_member():
    store = DictStore()
    store.set(Keys.dead("b"), "1")
    gen, _ = machine("a", store, Plan(3, ("a", "b", "c")))
    store.set(Keys.alive(3, "c"), "7")
    decided = gen.recover(peer_gone=False, alive="7")
    assert decided.members == ("a", "c") and decided.lost == ("b",) and decided.kind is EventKind.CRASH
    assert store.get(Keys.alive(3, "a")) == b"7" and store.check([Keys.abort(3)])
    assert gen.phase is Phase.RECOVERING


def test_roll_call_adopts_a_plan_another_member_already_decided():
    store = DictStore()
    theirs = Plan(1, ("b",), lost=("a",), kind=EventKind.HANG)
    store.set(Keys.plan(1), theirs.to_json())
    gen, _ = machine("a", store, Plan(0, ("a", "b")))
    assert gen.recover(peer_gone=True, alive="0") == theirs


def test_the_roll_call_reads_only_verified_answers_plans_and_death_reports():
    """The roll call reads the next plan and every member's answer and death report at
    once (one request per look on the keeper's store); each value is still verified: a
    forged plan, answer or death report reads as missing (counted), never acted on."""
    from eltctl_runtime.store import auth

    raw = DictStore()
    store = auth.signed(raw, "eltctl/j", auth.new_secret(), run="ab")
    raw.set(Keys.plan(4), Plan(4, ("a",), kind=EventKind.HANG).to_json())  # unsigned: forged
    raw.set(Keys.alive(3, "c"), "9")
    raw.set(Keys.dead("c"), "1")
    store.set(Keys.dead("b"), "1")
    gen, _ = machine("a", store, Plan(3, ("a", "b", "c")))
    threading.Timer(0.05, lambda: store.set(Keys.alive(3, "c"), "7")).start()  # c's real answer, later
    decided = gen.recover(peer_gone=False, alive="7")
    assert decided.generation == 4 and decided.members == ("a", "c") and decided.lost == ("b",)
    counts = store.forgeries.counts()
    assert counts["gen/plan"] >= 1 and counts["gen/alive"] >= 1 and counts["dead"] >= 1, counts


def test_a_planned_leaver_leaves_on_entering_the_next_plan():
    gen, hooks = machine("b", DictStore(), Plan(0, ("a", "b")), phase=Phase.CHANGING)
    nxt = Plan(1, ("a",), left=("b",), kind=EventKind.LEAVE)
    assert gen.enter(nxt) is False
    assert gen.phase is Phase.LEFT and gen.plan == nxt and hooks.calls == [("on_leave", 1)]


def test_a_member_the_others_went_on_without_is_excluded():
    gen, hooks = machine("b", DictStore(), Plan(0, ("a", "b")), phase=Phase.RECOVERING)
    with pytest.raises(ExcludedFromJob, match="worker b is not a member of generation 1"):
        gen.enter(Plan(1, ("a",), lost=("b",), kind=EventKind.HANG))
    assert gen.phase is Phase.EXCLUDED and hooks.calls == []

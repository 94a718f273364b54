"""The step-boundary state (boundary.py): what a commit or a dropped step leaves for the
next boundary, and the transitions the job may take."""

from __future__ import annotations

import pytest

from eltctl_runtime.train.boundary import TRANSITIONS, Ask, Boundary, StepPhase


def committed(b: Boundary, *, stop=False, leaving=(), leave_ready=False, join_ready=False) -> None:
    b.committed(stop, set(leaving), leave_ready=leave_ready, join_ready=join_ready)


@pytest.mark.parametrize("stop, leaving, leave_ready, join_ready, ask, held", [
    (False, (), False, False, Ask(False, None), frozenset()),  # a plain commit: a checkpoint at most
    (True, (), False, False, Ask(True, set()), frozenset()),  # a stop goes at once
    (False, ("h1/0",), True, False, Ask(False, {"h1/0"}), frozenset()),  # every rank ready: the leave goes
    (False, ("h1/0",), False, False, Ask(False, None), frozenset({"h1/0"})),  # held back while they prepare
    (False, (), False, True, Ask(False, set()), frozenset()),  # a join alone, every rank ready
    (True, ("h1/0",), False, False, Ask(True, {"h1/0"}), frozenset()),  # a stop takes the leaver along
])
def test_a_commit_asks_its_boundary_for_a_stop_or_a_change_or_holds_a_leave(stop, leaving, leave_ready,
                                                                            join_ready, ask, held):
    b = Boundary()
    committed(b, stop=stop, leaving=leaving, leave_ready=leave_ready, join_ready=join_ready)
    assert b.phase is StepPhase.COMMITTED and b.leave_seen == held
    assert b.take() == ask
    assert b.phase is StepPhase.STEPPING
    assert b.take() is None  # taken once: the next boundary without a commit owes nothing


def test_a_dropped_step_owes_the_roll_call_which_says_whether_a_peer_is_gone():
    b = Boundary()
    committed(b, stop=True)
    b.dropped(peer_gone=True)
    assert b.needs_recovery and b.take() is None  # a stop not carried out is asked again at the next commit
    assert b.recovering() is True
    assert b.phase is StepPhase.STEPPING and not b.needs_recovery
    assert b.recovering() is False  # the peer_gone was for that roll call only


def test_a_checkpoint_due_at_a_change_is_owed_to_the_next_step_and_cleared_by_its_tail():
    b = Boundary()
    b.tail_read(checkpoint=True)
    assert b.checkpoint_due and not b.checkpoint_owed
    b.defer_checkpoint()
    assert not b.checkpoint_due and b.checkpoint_owed
    b.tail_read(checkpoint=True)  # the next step's tail asked for it
    assert b.checkpoint_due and not b.checkpoint_owed


def test_a_new_generation_drops_a_held_back_leave():
    b = Boundary()
    committed(b, leaving=("h2/0",))
    assert b.leave_seen == {"h2/0"}
    b.new_generation()
    assert b.leave_seen == frozenset()


@pytest.mark.parametrize("end, phase", [("finish", StepPhase.FINISHED), ("leave", StepPhase.LEFT)])
def test_the_end_is_final_whatever_comes_after(end, phase):
    b = Boundary()
    committed(b)
    getattr(b, end)()
    assert b.phase is phase and b.over and b.take() is None
    b.finish()
    b.dropped(peer_gone=True)  # a late abort changes nothing
    assert b.phase is phase and not b.needs_recovery
    assert b.left == (phase is StepPhase.LEFT) and b.finished == (phase is StepPhase.FINISHED)


def test_transitions_outside_the_graph_are_refused():
    b = Boundary()
    b.dropped()
    with pytest.raises(RuntimeError, match="from dropped to committed"):
        committed(b)  # a dropped step is never committed: the roll call comes first
    assert TRANSITIONS[StepPhase.FINISHED] == frozenset() and TRANSITIONS[StepPhase.LEFT] == frozenset()
    assert all(p in TRANSITIONS for p in StepPhase)

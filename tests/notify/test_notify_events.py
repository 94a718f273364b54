"""Which status documents bring which notifications (notify/events.py `watch`): a plan
of documents fed in order with a fixed clock, and the kinds that must come out."""

from __future__ import annotations

from eltctl.notify.events import FORGED_REPEAT_S, Watch, watch

T0 = 1_700_000_000.0
STALL = 600.0


def doc(**over):
    d = {"job": "bert", "state": "training", "phase": "training", "message": "", "step": 10, "hosts": [
        {"name": "a", "state": "running", "benched_until": None, "last_problem": "", "reason": "1 worker(s)"},
        {"name": "b", "state": "running", "benched_until": None, "last_problem": "", "reason": "1 worker(s)"}],
        "forged": {"total": 0}, "done": None, "failed": None, "start_failed": None}
    d.update(over)
    return d


def feed(*docs_at):
    """Feed (time, doc) pairs from a fresh memory; every event, in order."""
    w, out = Watch(), []
    for t, d in docs_at:
        w, events = watch(w, d, T0 + t, STALL)
        out += events
    return out


def kinds(events):
    return [e["kind"] for e in events]


def test_the_first_document_only_sets_the_memory():
    # A controller restarted on a failed, paused, benched job does not tell it again.
    bad = doc(state="paused", failed="RuntimeError: boom", forged={"total": 5},
              hosts=[{"name": "a", "state": "quota", "benched_until": T0 + 99}])
    assert feed((0, bad)) == []


def test_finished_once_with_its_step():
    events = feed((0, doc()), (1, doc(step=99, done={"reason": "finished", "step": 99})),
                  (2, doc(step=99, done={"reason": "finished", "step": 99})))
    assert kinds(events) == ["finished"]
    assert events[0]["detail"] == "the training finished at step 99" and events[0]["job"] == "bert"
    assert events[0]["time"] == T0 + 1


def test_a_stop_by_down_is_not_finished():
    assert feed((0, doc()), (1, doc(done={"reason": "stop", "step": 10}))) == []


def test_failed_carries_the_cause_line_restart_mode_and_failed_at_start():
    events = feed((0, doc()), (1, doc(state="failed", failed="ValueError: bad batch")))
    assert kinds(events) == ["failed"] and events[0]["cause"] == "ValueError: bad batch"
    assert events[0]["detail"] == "the job stopped on its restart limit: ValueError: bad batch"
    events = feed((0, doc(state="starting")),
                  (1, doc(state="waiting", start_failed={"b": "ModuleNotFoundError: No module named 'foo'"})),
                  (2, doc(state="waiting", start_failed={"b": "ModuleNotFoundError: No module named 'foo'"})))
    assert kinds(events) == ["failed"]
    assert events[0]["host"] == "b" and events[0]["cause"] == "ModuleNotFoundError: No module named 'foo'"
    assert events[0]["detail"] == ("the job's workers failed at start on every host given slots: "
                                   "ModuleNotFoundError: No module named 'foo'")
    # a start failure that comes and goes while hosts are retried is told once, until a new step
    failing = doc(state="waiting", step=None, start_failed={"b": "ImportError: x"})
    retried = doc(state="starting", step=None)
    events = feed((0, doc(step=None)), (1, failing), (2, retried), (3, failing), (4, doc(step=1)), (5, failing))
    assert kinds(events) == ["failed", "failed"] and [e["time"] for e in events] == [T0 + 1, T0 + 5]


def test_paused_and_resumed():
    events = feed((0, doc()), (1, doc(state="paused", message="every host off-hours")), (2, doc(state="paused")),
                  (3, doc(state="training")))
    assert kinds(events) == ["paused", "resumed"] and events[0]["detail"] == "every host off-hours"


def test_stalled_once_per_stall_and_never_while_paused():
    events = feed((0, doc(step=10)), (STALL - 1, doc(step=10)), (STALL, doc(step=10)), (STALL + 5, doc(step=10)),
                  (STALL + 6, doc(step=11)), (2 * STALL + 5, doc(step=11)), (2 * STALL + 6, doc(step=11)))
    assert kinds(events) == ["stalled", "stalled"]
    assert events[0]["since"] == T0 and "no new step for 10 min" in events[0]["detail"]
    # paused the whole time: no stall; the clock starts again when it resumes
    events = feed((0, doc(step=10)), (1, doc(step=10, state="paused")), (STALL + 2, doc(step=10, state="paused")),
                  (STALL + 3, doc(step=10)), (STALL + 4, doc(step=10)))
    assert kinds(events) == ["paused", "resumed"]
    # a finished job makes no progress and is no stall
    done = {"reason": "finished", "step": 10}
    assert kinds(feed((0, doc()), (1, doc(done=done)), (2 * STALL, doc(done=done)))) == ["finished"]


def test_benched_per_host_with_its_problem_and_quota_once_for_the_hosts_reaching_it():
    benched = doc(hosts=[{"name": "a", "state": "benched", "benched_until": T0 + 300,
                          "last_problem": "worker a/0/3 crashed: CUDA error"},
                         {"name": "b", "state": "quota", "reason": "gpu_hours_per_day 8 reached"}])
    events = feed((0, doc()), (1, benched), (2, benched))
    assert kinds(events) == ["benched", "quota"]
    assert events[0]["host"] == "a" and events[0]["cause"] == "worker a/0/3 crashed: CUDA error"
    assert events[1]["hosts"] == ["b"] and "gpu_hours_per_day 8 reached" in events[1]["detail"]


def test_forged_values_are_told_at_most_once_every_ten_minutes_with_the_total():
    def forged(n):
        return doc(forged={"total": n, "controller": {"gen/plan": n}})

    events = feed((0, doc()), (1, forged(2)), (2, forged(5)), (FORGED_REPEAT_S, forged(7)),
                  (FORGED_REPEAT_S + 2, forged(9)), (FORGED_REPEAT_S + 3, forged(9)))
    events = [e for e in events if e["kind"] == "forged"]  # (the step stood still: a stall too)
    assert [e["total"] for e in events] == [2, 9]

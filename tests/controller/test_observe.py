"""The controller's observations as tables: store data and probe reports turned into views."""

from __future__ import annotations

import json

import pytest

from eltctl.controller.observe import (
    DaemonSeen,
    Observer,
    add_refusal,
    adopted,
    checkpoint_to_mirror,
    crashed_slots,
    daemon_alive,
    daemon_may_run,
    daemon_slots,
    final_checkpoint,
    host_view,
    runtime_fresh,
    seen_state,
    slot_of,
    wrong_slots,
)
from eltctl.controller.policy import DaemonSlots, HostRecord, Reach, SlotView
from eltctl.inventory import parse_inventory
from eltctl.probe import Gpu, GpuReport, GpuUse, HostReport, HostState

NOW = 10_000.0
INV = parse_inventory(
    '[job]\nname = "j"\ncommand = "python t.py"\n[policy]\nhang_timeout = 10\nwatch_interval = 0.5\n'
    '[[hosts]]\nname = "a"\naddress = "a.lab"\n'
    '[[hosts]]\nname = "b"\naddress = "b.lab"\ngpus = [1]\n'
    '[[hosts]]\nname = "c"\naddress = "c.lab"\nslots = 2\n', "hosts.toml")
A, B, C = INV.hosts
POLICY = INV.policy  # daemon fresh for max(5, 5 * 0.5) = 5 s; rank 0 fresh for max(10, 2 * 10) = 20 s


def seen(changed_ago: float = 0.0, **state) -> DaemonSeen:
    state.setdefault("time", NOW - changed_ago)
    return DaemonSeen(raw=json.dumps(state).encode(), changed=NOW - changed_ago, state=state)


def gpu(index: int, state: str, reason: str = "") -> GpuReport:
    return GpuReport(Gpu(index, f"GPU-{index}", "T4", 0, 15000, 0), GpuUse(state), reason)


def report(name: str, state: HostState, *gpus: GpuReport, reason: str = "") -> HostReport:
    return HostReport(name=name, address=f"{name}.lab", state=state, reason=reason, gpus=tuple(gpus))


# ---------------------------------------------------------------- the daemon's heartbeat

# (case, seen, alive)
ALIVE = [
    ("never seen: not alive", None, False),
    ("state changed just now: alive", seen(0.0, phase="running"), True),
    ("state unchanged for longer than 5 watch intervals: not alive", seen(6.0, phase="running"), False),
    # Host clocks are never compared with the controller's: a daemon whose host clock is a
    # minute behind is alive while its state keeps changing (finding 6 of the security review).
    ("a host clock 60 s behind, state changing: alive",
     DaemonSeen(b"{}", NOW - 1.0, {"time": NOW - 60.0, "phase": "running"}), True),
    ("a host clock 60 s ahead, state changing: alive",
     DaemonSeen(b"{}", NOW - 1.0, {"time": NOW + 60.0, "phase": "running"}), True),
    ("the daemon's last word 'stopped': not alive", seen(0.0, phase="stopped"), False),
    ("the daemon's last word 'failed': not alive", seen(0.0, phase="failed"), False),
    ("a state without a time counts by when it changed", DaemonSeen(b"{}", NOW - 1.0, {}), True),
]


@pytest.mark.parametrize("case, s, expected", ALIVE, ids=[c[0] for c in ALIVE])
def test_daemon_alive(case, s, expected):
    assert daemon_alive(s, NOW, POLICY) is expected


# (case, seen, may run): what a fix's retirement of the old daemon waits for (loop.apply_fixes)
MAY_RUN = [
    ("never seen: nothing to retire", None, False),
    ("state changing: may run", seen(0.0, phase="idle"), True),
    ("a stale state is no exit: may run (a loaded host)", seen(60.0, phase="idle"), True),
    ("the last word 'stopped': gone", seen(0.0, phase="stopped"), False),
    ("the last word 'failed': gone", seen(60.0, phase="failed"), False),
]


@pytest.mark.parametrize("case, s, expected", MAY_RUN, ids=[c[0] for c in MAY_RUN])
def test_daemon_may_run(case, s, expected):
    assert daemon_may_run(s) is expected


def test_an_unchanged_state_keeps_the_time_it_changed():
    first = seen_state(None, b'{"phase": "running"}', NOW - 3)
    assert first.changed == NOW - 3 and first.state == {"phase": "running"}
    assert seen_state(first, b'{"phase": "running"}', NOW) is first
    assert seen_state(first, b'{"phase": "idle"}', NOW).changed == NOW
    assert seen_state(None, b"not json", NOW).state == {}
    assert seen_state(None, b"[1, 2]", NOW).state == {}


# ---------------------------------------------------------------- rank 0's status

# (case, runtime status, fresh)
FRESH = [
    ("no status", None, False),
    ("a status never seen changing", {"step": 3}, False),
    ("seen changing 19 s ago (fresh for 20 s)", {"seen": NOW - 19}, True),
    ("seen changing 21 s ago", {"seen": NOW - 21}, False),
    ("rank 0's clock a minute behind does not matter", {"seen": NOW - 1, "time": NOW - 61}, True),
    ("nor one ahead", {"seen": NOW - 30, "time": NOW + 60}, False),
]


@pytest.mark.parametrize("case, rs, expected", FRESH, ids=[c[0] for c in FRESH])
def test_runtime_fresh(case, rs, expected):
    assert runtime_fresh(rs, NOW, POLICY) is expected


def ck_status(step=40, host="a", age=1.0, **extra):
    return {"seen": NOW - age, "time": NOW - 3600, "checkpoint": {"step": step, "path": f"/home/u/.eltctl/jobs/j/{host}/checkpoints/step-{step}"},
            **extra}


# (case, runtime status, restored_at, expected)
MIRROR = [
    ("rank 0's newest checkpoint goes to the mirror", ck_status(), 0.0, ("a", 40)),
    ("no checkpoint yet", {"seen": NOW}, 0.0, None),
    ("a stale status is not the current run's", ck_status(age=30.0), 0.0, None),
    ("a status older than the last restore is the old run's", ck_status(age=5.0), NOW - 2.0, None),
    ("a step that is not a number is ignored", ck_status(step="40"), 0.0, None),
    ("a checkpoint on a host not in the inventory is ignored", ck_status(host="zz"), 0.0, None),
]


@pytest.mark.parametrize("case, rs, restored_at, expected", MIRROR, ids=[c[0] for c in MIRROR])
def test_checkpoint_to_mirror(case, rs, restored_at, expected):
    assert checkpoint_to_mirror(rs, NOW, POLICY, restored_at, "j", ["a", "b", "c"]) == expected


def test_final_checkpoint_is_what_down_reports():
    rs = {"checkpoint": {"step": 7, "path": "/p", "time": 5.0, "extra": 1}}
    assert final_checkpoint(rs) == {"step": 7, "path": "/p", "time": 5.0}
    assert final_checkpoint({"checkpoint": "?"}) is None and final_checkpoint(None) is None


# ---------------------------------------------------------------- the event log

# (case, event, logged after this controller first read the log, crashed (host, slot)s)
CRASHES = [
    ("a crash names its workers' slots", {"kind": "crash", "time": NOW, "host": "a", "workers": ["a/1/0", "a/0/3"]},
     True, [("a", 1), ("a", 0)]),
    ("a crash with one worker and no host", {"kind": "crash", "time": NOW, "worker": "b/1/2"}, True, [("b", 1)]),
    ("a crash logged before this controller started is the last one's", {"kind": "crash", "time": NOW,
                                                                        "host": "a", "workers": ["a/0/1"]}, False, []),
    ("a new crash counts whatever the host's clock says", {"kind": "crash", "time": NOW - 3600, "host": "a",
                                                           "workers": ["a/0/1"]}, True, [("a", 0)]),
    ("other kinds name no crash", {"kind": "leave", "time": NOW, "host": "a", "workers": ["a/0/1"]}, True, []),
    ("a worker id without a slot is skipped", {"kind": "crash", "time": NOW, "workers": ["a"]}, True, []),
]


@pytest.mark.parametrize("case, ev, new, expected", CRASHES, ids=[c[0] for c in CRASHES])
def test_crashed_slots(case, ev, new, expected):
    assert crashed_slots(ev, new) == expected


@pytest.mark.parametrize("worker, slot", [("a/1/0", 1), ("host/-1/2", -1), ("a", None), ("a/x/1", None)])
def test_slot_of(worker, slot):
    assert slot_of(worker) == slot


# ---------------------------------------------------------------- a host's view

def slots(*specs) -> tuple[SlotView, ...]:
    return tuple(SlotView(i, GpuUse(u), r) for i, u, r in specs)


DAEMON = dict(phase="running", health="ok", seq_applied=3,
              gpus=[{"index": 0, "state": "ours"}, {"index": 1, "state": "busy", "reason": "owner pid 9"}],
              workers=[{"slot": 0, "state": "running"}, {"slot": 2, "state": "left"}], yielded=[{"slot": 1}])

# (case, host, report, seen, alive, expected fields of the view)
VIEWS = [
    ("not probed, no daemon: unknown", A, None, None, False,
     dict(reach=Reach.UNKNOWN, slots=(), workers=(), seq_applied=-1, watched=False)),
    ("probed with GPUs: their uses and reasons", A, report("a", HostState.OK, gpu(0, "free"), gpu(1, "busy", "x")),
     None, False, dict(reach=Reach.OK, slots=slots((0, "free", ""), (1, "busy", "x")))),
    ("a CPU-only host has its CPU slots, free", C, report("c", HostState.CPU_ONLY), None, False,
     dict(reach=Reach.CPU_ONLY, slots=slots((0, "free", "CPU slot"), (1, "free", "CPU slot")))),
    ("unhealthy: no slots, the probe's reason", A, report("a", HostState.UNHEALTHY, reason="nvidia-smi hung"), None,
     False, dict(reach=Reach.UNHEALTHY, reason="nvidia-smi hung", slots=())),
    ("unreachable but its daemon reports GPUs: the host works", A,
     report("a", HostState.UNREACHABLE, reason="timeout"), seen(0.0, **DAEMON), True,
     dict(reach=Reach.OK, reason="daemon reporting", slots=(), workers=(0,), daemon_alive=True)),
    ("not probed, its daemon reports no GPUs: CPU slots", C, None, seen(0.0, phase="running"), True,
     dict(reach=Reach.CPU_ONLY, reason="daemon reporting", slots=slots((0, "free", "CPU slot"),
                                                                       (1, "free", "CPU slot")))),
    ("a live daemon: its running workers, yields, seq, and the GPUs it sees busy", A,
     report("a", HostState.OK, gpu(0, "ours"), gpu(1, "free")), seen(0.0, **DAEMON), True,
     dict(workers=(0,), yielded=(1,), seq_applied=3, watched=True,
          slots=slots((0, "ours", ""), (1, "busy", "owner pid 9")))),
    ("a dead daemon's state is ignored", A, report("a", HostState.OK, gpu(0, "free")), seen(9.0, **DAEMON), False,
     dict(workers=(), yielded=(), seq_applied=-1, watched=False, slots=slots((0, "free", "")))),
    ("a daemon with unhealthy GPUs does not watch them", A, report("a", HostState.OK, gpu(0, "ours")),
     seen(0.0, **{**DAEMON, "health": "failed"}), True, dict(watched=False)),
]


@pytest.mark.parametrize("case, host, rep, s, alive, expected", VIEWS, ids=[c[0] for c in VIEWS])
def test_host_view(case, host, rep, s, alive, expected):
    v = host_view(host, rep, s, alive)
    assert v.name == host.name
    assert {k: getattr(v, k) for k in expected} == expected


def test_crashed_slots_reach_the_view_sorted():
    assert host_view(A, None, None, False, {2, 0}).crashed == (0, 2)


OK_01 = report("a", HostState.OK, gpu(1, "free"), gpu(0, "busy"))
HUNG = report("a", HostState.UNHEALTHY, reason="nvidia-smi did not answer in 10 s (driver wedged?)")
CPU = report("c", HostState.CPU_ONLY, reason="no nvidia-smi on PATH: CPU-only host, 2 slot(s)")

# (case, host, latest report, last report that told, gpus for its daemon: a tuple, "cpu", or None: it waits)
DAEMON_SLOTS = [
    ("the inventory's GPUs win", B, report("b", HostState.OK, gpu(0, "free"), gpu(1, "free")), None, (1,)),
    ("the inventory's GPUs win without any probe", B, None, None, (1,)),
    ("else the probed ones, sorted", A, OK_01, OK_01, (0, 1)),
    ("a CPU-only host: CPU slots", C, CPU, CPU, "cpu"),
    ("a probe that failed after one that told: the one that told stands", A, HUNG, OK_01, (0, 1)),
    ("an unreachable host after one that told: the one that told stands", A,
     report("a", HostState.UNREACHABLE, reason="timeout"), OK_01, (0, 1)),
    ("a CPU-only host whose probe timed out stays a CPU host", C,
     report("c", HostState.UNHEALTHY, reason="the probe did not complete: timeout"), CPU, "cpu"),
    ("the latest probe that tells wins over an older one", A, CPU, OK_01, "cpu"),
    ("no probe ever told (failed): not known, the start waits", A, HUNG, None, None),
    ("not probed: not known, the start waits", A, None, None, None),
]


@pytest.mark.parametrize("case, host, rep, settled, expected", DAEMON_SLOTS, ids=[c[0] for c in DAEMON_SLOTS])
def test_daemon_slots(case, host, rep, settled, expected):
    got = daemon_slots(host, rep, settled)
    if expected is None:
        assert got is None
    else:
        assert isinstance(got, DaemonSlots) and got.gpus == (None if expected == "cpu" else expected)


def test_the_observer_keeps_the_last_report_that_told_what_a_host_has():
    obs = Observer()
    obs.take_reports([OK_01])
    obs.take_reports([HUNG])
    assert obs.reports["a"] is HUNG and obs.daemon_slots(A).gpus == (0, 1)
    obs.forget_machine("a")  # the entry names another machine now
    assert obs.daemon_slots(A) is None


# (case, expected (kind, slots) of a daemon started now, the running daemon's state, a reason expected)
WRONG = [
    ("CPU slots on a host with GPUs", ("gpu", frozenset({0, 1})), {"slot_kind": "cpu", "valid_slots": [0]},
     "its daemon runs CPU slots [0] but the host has GPUs [0, 1]"),
    ("GPUs on a CPU-only host", ("cpu", frozenset({0, 1})), {"slot_kind": "gpu", "valid_slots": [0, 1]},
     "its daemon runs GPUs [0, 1] but the host has CPU slots [0, 1]"),
    ("a GPU the job may use that the daemon lacks", ("gpu", frozenset({0, 1})), {"slot_kind": "gpu",
                                                                              "valid_slots": [0]},
     "its daemon runs GPUs [0] but the host has GPUs [0, 1]"),
    ("the same GPUs", ("gpu", frozenset({0, 1})), {"slot_kind": "gpu", "valid_slots": [1, 0]}, None),
    ("more GPUs than asked (one fell off the probe): it has every one", ("gpu", frozenset({0})),
     {"slot_kind": "gpu", "valid_slots": [0, 1]}, None),
    ("a daemon watching any GPU", ("gpu", frozenset({0, 1})), {"slot_kind": "gpu", "valid_slots": None}, None),
    ("a daemon following its GPUs that lacks one yet: it takes it up itself (issue 49)", ("gpu", frozenset({0, 1})),
     {"slot_kind": "gpu", "valid_slots": [0], "follows_gpus": True}, None),
    ("a following daemon of the wrong kind is still wrong", ("cpu", frozenset({0})),
     {"slot_kind": "gpu", "valid_slots": [0], "follows_gpus": True},
     "its daemon runs GPUs [0] but the host has CPU slots [0]"),
    ("the same CPU slots", ("cpu", frozenset({0, 1})), {"slot_kind": "cpu", "valid_slots": [0, 1]}, None),
    ("an older daemon that does not say: never judged", ("gpu", frozenset({0})), {"phase": "running"}, None),
    ("a malformed state: never judged", ("gpu", frozenset({0})), {"slot_kind": "cpu", "valid_slots": "0"}, None),
]


@pytest.mark.parametrize("case, expected, state, why", WRONG, ids=[c[0] for c in WRONG])
def test_wrong_slots(case, expected, state, why):
    assert wrong_slots(expected, state) == why


# ---------------------------------------------------------------- requests

# (case, report, force, refusal or None)
ADDS = [
    ("a free GPU: it joins", report("a", HostState.OK, gpu(0, "free")), False, None),
    ("a GPU already ours: it joins", report("a", HostState.OK, gpu(0, "ours")), False, None),
    ("a CPU-only host joins", report("c", HostState.CPU_ONLY), False, None),
    ("unreachable: refused even with force", report("a", HostState.UNREACHABLE, reason="timeout"), True,
     "unreachable: timeout"),
    ("every GPU busy: refused, with each reason", report("a", HostState.OK, gpu(0, "busy", "pid 7"), gpu(1, "busy", "x")),
     False, "no free GPU (GPU 0: pid 7; GPU 1: x); --force adds it anyway"),
    ("every GPU busy, forced: it joins", report("a", HostState.OK, gpu(0, "busy", "pid 7")), True, None),
    ("unhealthy: refused with the probe's reason", report("a", HostState.UNHEALTHY, reason="smi hung"), False,
     "no free GPU (smi hung); --force adds it anyway"),
]


@pytest.mark.parametrize("case, rep, force, expected", ADDS, ids=[c[0] for c in ADDS])
def test_add_refusal(case, rep, force, expected):
    assert add_refusal(rep, force) == expected


# (case, record, desired document in the store, expected record)
ADOPT = [
    ("no document: the record as it was", HostRecord(seq=2), None, HostRecord(seq=2)),
    ("a newer document: its seq and slots", HostRecord(seq=2), {"seq": 5, "slots": [0, 1], "stop": False},
     HostRecord(seq=5, desired=(0, 1))),
    ("a stop request: no slots", HostRecord(), {"seq": 1, "slots": [0], "stop": True}, HostRecord(seq=1)),
    ("an older document is ignored", HostRecord(seq=9, desired=(1,)), {"seq": 5, "slots": [0]},
     HostRecord(seq=9, desired=(1,))),
]


@pytest.mark.parametrize("case, rec, doc, expected", ADOPT, ids=[c[0] for c in ADOPT])
def test_adopted(case, rec, doc, expected):
    assert adopted(rec, doc) == expected


# ---------------------------------------------------------------- reading the store

class FakeStore:
    def __init__(self, values: dict) -> None:
        self.values = values

    async def get_raw(self, key):
        v = self.values.get(key)
        return None if v is None else json.dumps(v).encode()

    async def get_json(self, key):
        return self.values.get(key)

    async def add(self, key, amount):
        return int(self.values.get(key, 0)) + amount


def test_reading_the_store_folds_states_events_and_status():
    import asyncio

    store = FakeStore({
        "daemon/a/state": {"time": NOW, "phase": "running"},
        "events/seq": 3,
        "events/1": {"kind": "join", "time": NOW},
        "events/2": "not a document",
        "events/3": {"kind": "crash", "time": NOW, "host": "a", "workers": ["a/0/0"]},
        "status": {"time": NOW - 3600, "step": 4},  # rank 0's clock an hour behind
    })
    o = Observer()
    asyncio.run(o.read_store(store, ["a", "b"], NOW))
    assert set(o.seen) == {"a"} and o.seen["a"].changed == NOW
    assert o.events_read == 3 and [e["kind"] for e in o.events] == ["join", "crash"]
    assert o.crashed == {}  # logged before this controller read the log: the last controller's
    # A status there at the start gets the benefit of the doubt while it settles ...
    assert o.runtime_status == {"time": NOW - 3600, "step": 4, "seen": NOW} and o.settling(NOW + 1)
    # ... and a crash logged afterwards counts, whatever the host's clock says.
    store.values.update({"events/seq": 4, "events/4": {"kind": "crash", "time": NOW - 3600, "host": "a",
                                                       "workers": ["a/1/0"]}})
    asyncio.run(o.read_store(store, ["a"], NOW + 1))
    assert o.crashed == {"a": {1}}
    # A status that changes is fresh by the controller's clock; one that never does is a dead run's.
    store.values["status"] = {"time": NOW - 3599, "step": 5}
    asyncio.run(o.read_store(store, ["a"], NOW + 2))
    assert o.runtime_status["seen"] == NOW + 2 and not o.settling(NOW + 2)
    dead = Observer()
    asyncio.run(dead.read_store(store, ["a"], NOW))
    asyncio.run(dead.read_store(store, ["a"], NOW + 4))
    assert dead.runtime_status["seen"] == 0.0 and not dead.settling(NOW + 4)
    # A new controller whose hosts.json read further than this store's log (a new `up`,
    # a new store): the log is read from the start, as the last controller's.
    again = Observer(events_read=10)
    store.values["events/seq"] = 1  # the counter says nothing: it is never read
    asyncio.run(again.read_store(store, ["a"], NOW + 5))
    assert again.events_read == 4 and len(again.events) == 3 and again.crashed == {}
    # A raised counter hides no event: the log is read as a run of entries.
    store.values.update({"events/seq": 10**9, "events/5": {"kind": "crash", "host": "a", "workers": ["a/2/0"]}})
    asyncio.run(again.read_store(store, ["a"], NOW + 6))
    assert again.events_read == 5 and again.crashed == {"a": {2}}


# ----------------------------------------------------------------------- crash causes, reaching the job

from eltctl.controller.observe import crash_info, in_job  # noqa: E402
from eltctl.controller.policy import Crash  # noqa: E402

CAUSE = "ModuleNotFoundError: No module named 'foo'"


@pytest.mark.parametrize("case, ev, expected", [
    ("a daemon's crash with its cause, failed at start",
     {"kind": "crash", "time": NOW, "host": "a", "workers": ["a/0/5", "a/1/6"], "cause": CAUSE, "at_start": True},
     [("a", Crash(0, CAUSE, True)), ("a", Crash(1, CAUSE, True))]),
    ("mid-training", {"kind": "crash", "time": NOW, "host": "a", "workers": ["a/1/6"], "cause": "E: x",
                      "at_start": False}, [("a", Crash(1, "E: x", False))]),
    ("an older daemon: no cause", {"kind": "crash", "time": NOW, "host": "a", "workers": ["a/0/5"]},
     [("a", Crash(0, "", False))]),
])
def test_crash_info(case, ev, expected):
    assert crash_info(ev) == expected
    assert crash_info(ev, new=False) == []  # logged before this controller: the last one's


@pytest.mark.parametrize("case, rs, host, expected", [
    ("a member in a fresh status", {"seen": NOW - 1, "members": ["b/0/3", "a/1/9"]}, "a", True),
    ("not a member", {"seen": NOW - 1, "members": ["b/0/3"]}, "a", False),
    ("a stale status says nothing", {"seen": NOW - 60, "members": ["a/0/3"]}, "a", False),
    ("no status", None, "a", False),
])
def test_in_job(case, rs, host, expected):
    assert in_job(host, rs, NOW, POLICY) is expected


def test_crash_causes_reach_the_view():
    v = host_view(A, None, None, False, {0}, [Crash(0, CAUSE, True)], True)
    assert v.crash_info == (Crash(0, CAUSE, True),) and v.in_job is True


def test_after_a_keeper_restart_the_new_stores_log_is_read_from_the_start():
    import asyncio

    store = FakeStore({"events/seq": 3, "events/1": {"kind": "join"}, "events/2": {"kind": "join"},
                       "events/3": {"kind": "join"}})
    o = Observer()
    asyncio.run(o.read_store(store, [], NOW))
    assert o.events_read == 3
    o.store_restarted()
    # The new store's first event is a crash: numbered 1, after this controller started: it counts.
    store.values = {"events/seq": 1, "events/1": {"kind": "crash", "host": "a", "workers": ["a/0/5"]}}
    asyncio.run(o.read_store(store, [], NOW + 5))
    assert o.events_read == 1 and o.crashed == {"a": {0}}


# ---------------------------------------------------------------- who runs now, the last checkpoint

from eltctl.controller.observe import live_members, newest_checkpoint  # noqa: E402
from eltctl.controller.policy import HostView  # noqa: E402


def test_a_daemons_running_workers_reach_the_view_by_id():
    s = seen(0.0, phase="running", workers=[{"slot": 0, "worker_id": "c/0/3", "state": "running"},
                                            {"slot": 1, "worker_id": "c/1/2", "state": "crashed"}])
    v = host_view(C, report("c", HostState.CPU_ONLY), s, True)
    assert (v.workers, v.worker_ids) == ((0,), ("c/0/3",))


RS = {"seen": 100.0, "time": 5000.0, "members": ["a/0/1", "b/0/1"]}

# (case, views, live members)
LIVE = [
    ("both members run", {"a": HostView("a", daemon_alive=True, worker_ids=("a/0/1",), workers=(0,)),
                          "b": HostView("b", daemon_alive=True, worker_ids=("b/0/1",), workers=(0,))},
     ["a/0/1", "b/0/1"]),
    ("the script crashed: no worker runs", {"a": HostView("a", daemon_alive=True),
                                            "b": HostView("b", daemon_alive=True)}, []),
    ("restarted after a crash: new ids in the same slots are not the old members",
     {"a": HostView("a", daemon_alive=True, worker_ids=("a/0/2",), workers=(0,)),
      "b": HostView("b", daemon_alive=True, worker_ids=("b/0/2",), workers=(0,))}, []),
    ("a daemon that names no ids: by slot", {"a": HostView("a", daemon_alive=True, workers=(0,)),
                                             "b": HostView("b", daemon_alive=True)}, ["a/0/1"]),
    ("a silent daemon contradicts nothing: rank 0's status counts",
     {"a": HostView("a", daemon_alive=True, worker_ids=("a/0/1",), workers=(0,)), "b": HostView("b")},
     ["a/0/1", "b/0/1"]),
    ("a host not in the views", {"a": HostView("a", daemon_alive=True, worker_ids=("a/0/1",), workers=(0,))},
     ["a/0/1"]),
]


@pytest.mark.parametrize("case, views, expected", LIVE, ids=[c[0] for c in LIVE])
def test_live_members(case, views, expected):
    assert live_members(RS, views) == expected


CK_A = {"step": 800, "time": 4990.0, "path": "/h/.eltctl/jobs/j/a/checkpoints/step-800"}


def test_newest_checkpoint_is_rank_0s_with_its_host_and_age():
    got = newest_checkpoint(None, {**RS, "checkpoint": CK_A}, 110.0, "j")
    assert got == {"step": 800, "time": 4990.0, "path": CK_A["path"], "host": "a", "age_s": 20.0, "seen": 110.0}
    # seen again later: the same entry, its age still counted from when it was first seen
    assert newest_checkpoint(got, {**RS, "checkpoint": CK_A}, 130.0, "j") is got


def test_after_a_resize_the_new_rank_0_has_none_yet_and_the_last_one_stays():
    known = newest_checkpoint(None, {**RS, "checkpoint": CK_A}, 110.0, "j")
    assert newest_checkpoint(known, {**RS, "members": ["b/0/1"], "checkpoint": None}, 140.0, "j") is known
    newer = {"step": 825, "time": 5010.0, "path": "/h/.eltctl/jobs/j/b/checkpoints/step-825"}
    got = newest_checkpoint(known, {**RS, "time": 5012.0, "checkpoint": newer}, 150.0, "j")
    assert (got["step"], got["host"], got["age_s"]) == (825, "b", 52.0)


def test_no_checkpoint_anywhere_is_none():
    assert newest_checkpoint(None, None, 1.0, "j") is None
    assert newest_checkpoint(None, {**RS, "checkpoint": {"step": "x"}}, 1.0, "j") is None


def test_scale_add_says_what_joins_gpus_or_cpu_slots():
    from eltctl.controller.observe import added_message

    assert added_message(report("c", HostState.CPU_ONLY), (0, 1)) == "added; 2 CPU slots join now"
    assert added_message(report("a", HostState.OK, gpu(0, "free")), (0,)) == "added; 1 GPU join now"


def test_scale_add_never_promises_what_the_policy_refuses():
    """Issue 50: `scale --add` said "its CPU slots join now" and fair share held them back
    for minutes with no word: a host given no slot says what holds it, from its status entry."""
    from eltctl.controller.observe import added_message

    fair = {"kind": "fair share", "detail": "fair share holds the job at 1 CPU slot (its share 1 of 2) while "
                                            "job b (bob: holds 1, share 1) wants more", "until": None}
    msg = added_message(report("c", HostState.CPU_ONLY), (), fair)
    assert msg.startswith("added, but its CPU slots do not join now: fair share: fair share holds the job")
    assert "join now" not in msg.replace("do not join now", "")
    assert "next pass" in added_message(report("c", HostState.CPU_ONLY), (), {"kind": "joining", "detail": "x"})
    assert "join now" not in added_message(report("c", HostState.CPU_ONLY))


# ----------------------------------------------------------------------- the job's pace: one samples/s

from eltctl.controller.observe import RATE_WINDOW_S, commit_point, pace  # noqa: E402

# (case, points (rank 0, its clock, samples committed, step), samples/s, steps/s)
PACES = [
    ("two commits 10 s apart", [("a/0/1", 100.0, 0, 0), ("a/0/1", 110.0, 2560, 10)], 256.0, 1.0),
    ("only the last RATE_WINDOW_S count", [("a/0/1", 0.0, 0, 0), ("a/0/1", 100.0, 100_000, 1000),
                                           ("a/0/1", 100.0 + RATE_WINDOW_S, 103_000, 1030)], 100.0, 1.0),
    ("a new rank 0 (another host's clock) starts the count again",
     [("a/0/1", 5000.0, 0, 0), ("a/0/1", 5010.0, 1000, 10), ("b/0/1", 20.0, 1100, 11), ("b/0/1", 30.0, 2100, 21)],
     100.0, 1.0),
    ("a restore from an older checkpoint starts it again",
     [("a/0/1", 0.0, 0, 0), ("a/0/1", 10.0, 5000, 50), ("a/0/1", 20.0, 3000, 30), ("a/0/1", 30.0, 4000, 40)],
     100.0, 1.0),
    ("one commit tells nothing", [("a/0/1", 0.0, 0, 0)], None, None),
    ("a runtime without `samples`: steps/s only", [("a/0/1", 0.0, None, 0), ("a/0/1", 4.0, None, 8)], None, 2.0),
]


@pytest.mark.parametrize("case, points, samples, steps", PACES, ids=[c[0] for c in PACES])
def test_pace_is_what_was_committed_over_the_last_window(case, points, samples, steps):
    got = pace(points)
    assert (got["samples_per_s"], got["steps_per_s"]) == (samples, steps)


def test_commit_point_reads_rank_0s_worker_clock_samples_and_step():
    assert commit_point({"time": 5.0, "members": ["a/0/1", "b/0/1"], "samples": 64, "step": 2}) == ("a/0/1", 5.0, 64, 2)
    assert commit_point({"members": ["a/0/1"], "step": 2}) is None
    assert commit_point({"time": 5.0, "step": True}) == ("", 5.0, None, None)


def test_the_observer_gives_rank_0s_status_one_samples_per_s_over_its_recent_commits():
    """Issue 50: status showed 239.6 and 315.1 samples/s for one moment (rank 0's figure of
    its last second, and another sampled apart). The controller's figure is the samples
    committed over the last RATE_WINDOW_S of commits, in the status itself, so status, the
    metrics and the usage ledger read the same one."""
    import asyncio

    store = FakeStore({"status": {"time": 50.0, "members": ["a/0/1"], "step": 10, "samples": 640,
                                  "samples_per_s": 239.6}})
    o = Observer()
    asyncio.run(o.read_store(store, [], NOW))
    assert o.runtime_status["samples_per_s"] == 239.6  # one commit: rank 0's own figure stays
    store.values["status"] = {"time": 60.0, "members": ["a/0/1"], "step": 20, "samples": 3840, "samples_per_s": 315.1}
    asyncio.run(o.read_store(store, [], NOW + 1))
    assert (o.runtime_status["samples_per_s"], o.runtime_status["steps_per_s"]) == (320.0, 1.0)
    asyncio.run(o.read_store(store, [], NOW + 2))  # the same status read again: the same figure
    assert o.runtime_status["samples_per_s"] == 320.0

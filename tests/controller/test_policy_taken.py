"""Two eltctl jobs wanting the same GPU (issue 13), as tables: a GPU another job holds
(`GpuUse.TAKEN`, its claim) is never used and never an owner's. A slot the daemon reports
taken leaves the desired slots with no failure and no cooldown, and the job uses another
free GPU; once the GPU is free again (first come, first served) the job takes it after
idle_for. The daemon's state document becomes that view in `observe.host_view`."""

from __future__ import annotations

import json

import pytest

from eltctl.controller import status
from eltctl.controller.observe import DaemonSeen, host_view
from eltctl.controller.policy import (
    GpuUse,
    HostPhase,
    HostRecord,
    HostView,
    Reach,
    SetDesired,
    SlotView,
    decide,
    eligible_slots,
    host_state,
    track,
)
from eltctl.inventory import parse_inventory
from eltctl.probe import Gpu, GpuReport, HostReport, HostState

NOW = 10_000.0


def inventory(hosts=("a", "b"), **policy):
    text = '[job]\nname = "j"\ncommand = "python t.py"\nmin_workers = 1\n[policy]\nidle_for = 10\ncooldown = 60\n'
    text += "".join(f"{k} = {v}\n" for k, v in policy.items())
    for h in hosts:
        text += f'[[hosts]]\nname = "{h}"\naddress = "{h}.lab"\n'
    return parse_inventory(text, "hosts.toml")


def view(name, *uses, workers=(), taken=(), seq_applied=-1, alive=True):
    return HostView(name=name, reach=Reach.OK, slots=tuple(SlotView(i, GpuUse(u)) for i, u in enumerate(uses)),
                    daemon_alive=alive, workers=tuple(workers), taken=tuple(taken), seq_applied=seq_applied,
                    watched=alive)


def long_free(*slots):
    return tuple((s, NOW - 99) for s in slots)


# (case, view, record, expected desired after track)
TRACK = [
    ("a desired slot its daemon found taken is dropped: no failure, no cooldown",
     view("a", "taken", "ours", workers=(1,), taken=(0,), seq_applied=2),
     HostRecord(desired=(0, 1), seq=2, free_since=long_free(0, 1)), (1,)),
    ("taken for an older request: the daemon has not tried the new one yet",
     view("a", "taken", "ours", workers=(1,), taken=(0,), seq_applied=1),
     HostRecord(desired=(0, 1), seq=2, free_since=long_free(0, 1)), (0, 1)),
    ("our own worker runs there: never dropped on a report of taken",
     view("a", "ours", "free", workers=(0,), taken=(0,), seq_applied=2),
     HostRecord(desired=(0,), seq=2, free_since=long_free(0, 1)), (0,)),
    ("a probe that says taken alone (no daemon report) drops nothing",
     view("a", "taken", "free", seq_applied=2), HostRecord(desired=(0,), seq=2, free_since=long_free(0, 1)), (0,)),
]


@pytest.mark.parametrize("case, v, rec, desired", TRACK, ids=[c[0] for c in TRACK])
def test_track_drops_taken_slots_without_blame(case, v, rec, desired):
    out = track({"a": rec}, {"a": v}, inventory(hosts=("a",)), NOW)["a"]
    assert out.desired == desired
    assert (out.failures, out.cooldown_until, out.owner_until, out.benched_until) == (0, 0.0, 0.0, 0.0)
    assert not out.cooling(NOW)


def test_a_taken_gpu_is_never_eligible_not_even_forced_and_its_free_clock_runs_on():
    inv = inventory(hosts=("a",))
    v = view("a", "taken", "free")
    rec = track({"a": HostRecord(free_since=long_free(0, 1))}, {"a": v}, inv, NOW)["a"]
    assert rec.free_since == ((0, NOW - 99), (1, NOW - 99))  # another job's use is no owner's: the clock runs
    assert eligible_slots(v, rec, inv, NOW) == [1]
    forced = HostRecord(free_since=long_free(0, 1), join_now=True, force=True)
    assert eligible_slots(v, forced, inv, NOW) == [1]
    # Free again (the other job's worker left, fair share handed it over): at once, its
    # owner last used it long ago (first come, first served; the claim decides).
    freed = view("a", "free", "free")
    rec = track({"a": rec}, {"a": freed}, inv, NOW + 1)["a"]
    assert eligible_slots(freed, rec, inv, NOW + 1) == [0, 1]
    # A GPU first seen taken waits idle_for from then; an owner's use (busy) resets it.
    rec = track({"a": HostRecord()}, {"a": v}, inv, NOW)["a"]
    rec = track({"a": rec}, {"a": freed}, inv, NOW + 1)["a"]
    assert eligible_slots(freed, rec, inv, NOW + 1) == []
    assert eligible_slots(freed, rec, inv, NOW + 10) == [0, 1]
    rec = track({"a": rec}, {"a": view("a", "busy", "free")}, inv, NOW + 10)["a"]
    rec = track({"a": rec}, {"a": freed}, inv, NOW + 11)["a"]
    assert eligible_slots(freed, rec, inv, NOW + 12) == [1]


def test_the_job_uses_another_free_gpu_and_a_fully_taken_host_looks_busy():
    inv = inventory()
    views = {"a": view("a", "taken", "taken", taken=(0, 1), seq_applied=1), "b": view("b", "free", "taken")}
    records = {"a": HostRecord(desired=(0, 1), seq=1, free_since=long_free(0, 1)),
               "b": HostRecord(free_since=long_free(0, 1))}
    records = track(records, views, inv, NOW)
    assert records["a"].desired == () and not records["a"].cooling(NOW)
    d = decide(views, records, inv, NOW)
    assert d.desired == {"a": (), "b": (0,)}
    assert [a for a in d.actions if isinstance(a, SetDesired)] == [SetDesired("b", (0,))]  # a: nothing to undo
    phase, why = host_state(views["a"], records["a"], NOW)
    assert phase is HostPhase.BUSY  # not a cooldown: nobody's owner came back
    msg = status.waiting_message(now=NOW, inventory=inv, views=views, records=records)
    assert "3 GPUs taken by another eltctl job" in msg, msg


def seen(**state) -> DaemonSeen:
    return DaemonSeen(raw=json.dumps(state).encode(), changed=NOW, state=state)


def test_host_view_reads_the_daemons_taken_slots_and_gpu_states():
    inv = parse_inventory('[job]\nname = "j"\ncommand = "python t.py"\n'
                          '[[hosts]]\nname = "a"\naddress = "a.lab"\n'
                          '[[hosts]]\nname = "c"\naddress = "c.lab"\nslots = 2\n', "hosts.toml")
    a, c = inv.hosts
    rep = HostReport(name="a", address="a.lab", state=HostState.OK, reason="",
                     gpus=tuple(GpuReport(Gpu(i, f"GPU-{i}", "T4", 0, 15000, 0), GpuUse.FREE, "") for i in (0, 1)))
    st = seen(phase="running", health="ok", seq_applied=4, taken={"0": "other"},
              gpus=[{"index": 0, "state": "taken", "reason": "taken by job other (user bob, pid 4)"},
                    {"index": 1, "state": "free"}], workers=[], yielded=[])
    v = host_view(a, rep, st, True)
    assert v.taken == (0,) and v.yielded == ()
    assert [(s.index, s.use, s.reason) for s in v.slots] == [
        (0, GpuUse.TAKEN, "taken by job other (user bob, pid 4)"), (1, GpuUse.FREE, "")]
    # A CPU-only host: its slots from the inventory, the taken ones from the daemon.
    cpu = host_view(c, HostReport(name="c", address="c.lab", state=HostState.CPU_ONLY, reason=""),
                    seen(phase="running", health="ok", seq_applied=1, taken={"1": "other"}, gpus=[], workers=[]),
                    True)
    assert [(s.index, s.use) for s in cpu.slots] == [(0, GpuUse.FREE), (1, GpuUse.TAKEN)]
    assert cpu.slots[1].reason == "taken by job other"
    # An old daemon's state (no `taken`) reads as before.
    assert host_view(a, rep, seen(phase="running", health="ok", gpus=[], workers=[]), True).taken == ()

"""Owner signals beyond the GPU (eltctl_runtime.owner): the hysteresis as tables on a fake
clock, real utmp records and tty atimes read back, a real busy process measured, the
daemon's decisions with a signal, and the probe's use of the check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from eltctl.inventory import Host
from eltctl.probe import GpuUse, HostState, assess_host, parse_probe_output, probe_command, report_to_json
from eltctl.inventory.types import Policy
from eltctl_runtime.daemon.logic import Leave, Memory, RecordYield, Start, View, WorkerState, WorkerView, decide
from eltctl_runtime.owner import (
    Login, Looks, OwnerPolicy, OwnerSignal, OwnerState, OwnerWatch, ProcessMeter, Sources, evaluate,
    pack_utmp, parse_utmp, read_input_idle, read_logins,
)
from eltctl_runtime.protocol import Desired
from tests.testbed.owner import OwnerStandIn

ALL = OwnerPolicy(signals=("login", "keyboard", "load", "memory"), idle_to_start=900, active_within=60,
                  start_load=0.3, leave_load=1.0, leave_load_for=60, memory_mib=4096)
QUIET = Looks(logins=(), input_idle=None, load=0.0, memory_mib=100.0)


def alice(idle: float) -> Login:
    return Login("alice", "pts/3", "10.1.2.3", 4242, idle)


def run(policy: OwnerPolicy, looks_by_time: list[tuple[float, Looks]]) -> list[tuple[str | None, str | None]]:
    """Evaluate a sequence of looks on a fake clock; (leave name, wait name) after each."""
    state, out = OwnerState(), []
    for now, looks in looks_by_time:
        state, v = evaluate(policy, looks, state, now, 1000.0 + now)
        out.append((v.leave.name if v.leave else None, v.wait.name if v.wait else None))
    return out


# ---------------------------------------------------------------- the hysteresis, one signal at a time

@pytest.mark.parametrize("name, looks, expected", [
    ("nothing watched is never held", [(0, replace(QUIET, logins=(alice(0),)))], [(None, None)]),
    ("quiet host: may start", [(0, QUIET)], [(None, None)]),
    ("login active now: leave", [(0, replace(QUIET, logins=(alice(5),)))], [("login", "login")]),
    ("login idle 5 min: no leave, but no start either", [(0, replace(QUIET, logins=(alice(300),)))],
     [(None, "login")]),
    ("login idle 20 min: may start", [(0, replace(QUIET, logins=(alice(1200),)))], [(None, None)]),
    ("owner back, then idle 2 min: still held (no start) until 15 min idle",
     [(0, replace(QUIET, logins=(alice(5),))), (120, replace(QUIET, logins=(alice(120),))),
      (900, replace(QUIET, logins=(alice(899),))), (901, replace(QUIET, logins=(alice(901),)))],
     [("login", "login"), (None, "login"), (None, "login"), (None, None)]),
    ("owner logs out: free at once", [(0, replace(QUIET, logins=(alice(5),))), (10, QUIET)],
     [("login", "login"), (None, None)]),
    ("keyboard input now: leave", [(0, replace(QUIET, input_idle=3, input_what="tty2"))],
     [("keyboard", "keyboard")]),
    ("keyboard idle 10 min: wait", [(0, replace(QUIET, input_idle=600))], [(None, "keyboard")]),
    ("no keyboard exposed: no signal", [(0, replace(QUIET, input_idle=None))], [(None, None)]),
    ("load unknown at the first look: wait", [(0, replace(QUIET, load=None))], [(None, "load")]),
    ("load 0.5: no start, no leave", [(0, replace(QUIET, load=0.5))], [(None, "load")]),
    ("load 2.0 for less than 60 s: wait only; for 60 s: leave",
     [(0, replace(QUIET, load=2.0)), (30, replace(QUIET, load=2.0)), (60, replace(QUIET, load=2.0))],
     [(None, "load"), (None, "load"), ("load", "load")]),
    ("a dip below leave_load restarts the 60 s",
     [(0, replace(QUIET, load=2.0)), (50, replace(QUIET, load=0.8)), (70, replace(QUIET, load=2.0)),
      (110, replace(QUIET, load=2.0)), (130, replace(QUIET, load=2.0))],
     [(None, "load"), (None, "load"), (None, "load"), (None, "load"), ("load", "load")]),
    ("load held: released only below start_load",
     [(0, replace(QUIET, load=2.0)), (60, replace(QUIET, load=2.0)), (70, replace(QUIET, load=0.5)),
      (80, replace(QUIET, load=0.1))],
     [(None, "load"), ("load", "load"), (None, "load"), (None, None)]),
    ("memory above the threshold: leave; below: free",
     [(0, replace(QUIET, memory_mib=5000)), (5, replace(QUIET, memory_mib=1000))],
     [("memory", "memory"), (None, None)]),
])
def test_hysteresis(name, looks, expected):
    policy = OwnerPolicy() if name.startswith("nothing") else ALL
    assert run(policy, looks) == expected, name


def test_a_waiting_signal_keeps_its_start():
    state, v = evaluate(ALL, replace(QUIET, logins=(alice(300),)), OwnerState(), 0.0, 5000.0)
    state, v = evaluate(ALL, replace(QUIET, logins=(alice(310),)), state, 10.0, 5010.0)
    assert v.leave is None and v.wait.since == 5000.0 and "idle 310 s" in v.wait.detail
    state, v = evaluate(ALL, QUIET, state, 20.0, 5020.0)
    assert v.wait is None and state == OwnerState()


def test_only_the_watched_signals_count():
    policy = replace(ALL, signals=("login",))
    assert run(policy, [(0, replace(QUIET, load=5.0, memory_mib=9999, input_idle=1))]) == [(None, None)]


def test_the_held_signal_keeps_its_name_and_start_and_says_who():
    state = OwnerState()
    state, v = evaluate(ALL, replace(QUIET, logins=(alice(4),)), state, 0.0, 5000.0)
    assert v.leave == v.wait and v.leave.name == "login"
    assert v.leave.user == "alice (login on pts/3)" and v.leave.pid == 4242
    assert v.leave.detail == "alice logged in on pts/3 from 10.1.2.3, idle 4 s"
    state, v = evaluate(ALL, replace(QUIET, logins=(alice(100),), load=0.9), state, 100.0, 5100.0)
    assert v.leave is None and v.wait.name == "login" and v.wait.since == 5000.0
    assert "idle 100 s" in v.wait.detail
    assert v.wait.to_dict() == {"name": "login", "detail": v.wait.detail, "since": 5000.0}


def test_policy_round_trips_and_names_bad_keys():
    assert OwnerPolicy.from_dict(ALL.to_dict()) == ALL
    assert OwnerPolicy.from_dict(None) == OwnerPolicy() and not OwnerPolicy().enabled
    with pytest.raises(ValueError, match=r"owner.signals must be a list"):
        OwnerPolicy.from_dict({"signals": ["mouse"]})
    with pytest.raises(ValueError, match=r"owner.start_load must be a number"):
        OwnerPolicy.from_dict({"start_load": "low"})


# ---------------------------------------------------------------- reading real files and processes

def test_utmp_records_are_glibc_x86_64_records():
    rec = pack_utmp("alice", "pts/3", pid=77, host="10.1.2.3", login_time=1700000000.5)
    assert len(rec) == 384
    assert parse_utmp(rec + rec[:100]) == [(7, 77, "pts/3", "alice", "10.1.2.3", 1700000000.5)]


def test_logins_of_other_users_with_their_tty_idle_times(tmp_path):
    bed = OwnerStandIn(tmp_path)
    bed.login("alice", "pts/3", idle=40)
    bed.login("root", "pts/4", idle=0)  # the job's own user: not an owner
    bed.login("bob", "pts/5", idle=7)
    (bed.dev / "pts" / "5").unlink()  # no tty file: idle since the login
    src = Sources.from_env(bed.env())
    found = {lg.user: lg for lg in read_logins(src, "root", time.time())}
    assert set(found) == {"alice", "bob"}
    assert found["alice"].line == "pts/3" and 39 <= found["alice"].idle <= 42
    assert 6 <= found["bob"].idle <= 9
    bed.logout("pts/3")
    assert [lg.user for lg in read_logins(src, "root", time.time())] == ["bob"]


def test_console_input_is_the_newest_input_device_or_tty(tmp_path):
    bed = OwnerStandIn(tmp_path)
    src = Sources.from_env(bed.env())
    assert read_input_idle(src, time.time()) == (None, "")  # nothing exposed
    bed.console_input("input/event0", ago=500)
    bed.console_input("tty2", ago=30)
    bed.console_input("ttyS0", ago=1)  # a serial line is not a console
    idle, what = read_input_idle(src, time.time())
    assert what == "tty2" and 29 <= idle <= 32


@pytest.fixture
def observer():
    """The pid the meter looks from, as a daemon would: not an ancestor of the processes the
    test starts (this test process is, and its descendants count as the meter's own)."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_busy_process_on_the_simulated_host_is_foreign_load_and_ours_is_not(tmp_path, observer):
    bed = OwnerStandIn(tmp_path)
    try:
        pid = bed.start_busy("hx", memory_mib=64)
        other = bed.start_busy("hy")  # another simulated host's: not counted on hx
        meter = ProcessMeter(Sources(sim_host="hx"), self_pid=observer)
        assert meter.look(time.monotonic())[0] is None  # a rate needs two looks
        time.sleep(1.0)
        load, top, mem, mtop = meter.look(time.monotonic())
        assert load > 0 and top[0] == pid, (load, top)
        assert mtop[0] == pid and mem >= 64
        assert other not in (top[0], mtop[0])
    finally:
        bed.close()


def test_a_process_with_eltctl_job_in_its_environment_is_not_an_owner(observer):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              env={"PATH": os.environ["PATH"], "ELTSIM_HOST": "hz", **extra})
             for extra in ({"ELTCTL_JOB": "another-job"}, {})]
    try:
        meter = ProcessMeter(Sources(sim_host="hz"), self_pid=observer)
        meter.look(time.monotonic())
        time.sleep(0.6)
        load, top, _, _ = meter.look(time.monotonic())
        assert top[0] == procs[1].pid and load < 1.5  # the one without ELTCTL_JOB alone
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_meters_own_descendants_are_not_owners(observer):
    env = {"PATH": os.environ["PATH"], "ELTSIM_HOST": "hw"}
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], env=env)  # a child of this process
    try:
        meter = ProcessMeter(Sources(sim_host="hw"))  # looking from this process
        meter.look(time.monotonic())
        time.sleep(0.6)
        assert meter.look(time.monotonic())[:2] == (0, None)
    finally:
        proc.kill()
        proc.wait()


def test_watch_steps_through_real_files(tmp_path):
    bed = OwnerStandIn(tmp_path)
    watch = OwnerWatch(replace(ALL, signals=("login", "keyboard")), Sources.from_env(bed.env()), user="root")
    assert watch.step(time.monotonic(), time.time()).holding is None
    bed.login("alice", "pts/3", idle=2)
    v = watch.step(time.monotonic(), time.time())
    assert v.leave.name == "login" and "alice logged in on pts/3" in v.leave.detail
    bed.set_idle("pts/3", 2000)
    assert watch.step(time.monotonic(), time.time()).holding is None


# ---------------------------------------------------------------- the daemon's decisions

SIGNAL = OwnerSignal("login", "alice logged in on pts/3, idle 2 s", "alice (login on pts/3)", 4242, 50.0)
APPLIED = Memory(seq_applied=1, wanted=frozenset({0, 1}), next_incarnation=3)


def running(slot: int, n: int) -> WorkerView:
    return WorkerView(slot, f"h1/{slot}/{n}", 1000 + slot, WorkerState.RUNNING, 0.0)


def test_a_firing_signal_makes_every_worker_leave_in_the_planned_way_with_one_yield_each():
    d = decide(View(now=10.0, wall=60.0, host="h1", desired=Desired(1, (0, 1)), memory=APPLIED,
                    workers=(running(0, 1), running(1, 2)), owner_leave=SIGNAL, owner_wait=SIGNAL))
    leaves = [a for a in d.actions if isinstance(a, Leave)]
    yields = [a for a in d.actions if isinstance(a, RecordYield)]
    assert [(a.slot, a.worker_id) for a in leaves] == [(0, "h1/0/1"), (1, "h1/1/2")]
    assert all("owner signal: alice logged in" in a.reason for a in leaves)
    assert [(y.record.slot, y.record.user, y.record.signal) for y in yields] == \
        [(0, "alice (login on pts/3)", "login"), (1, "alice (login on pts/3)", "login")]
    assert d.memory.urgent == frozenset()  # planned, not an eviction
    assert d.memory.leaving == {"h1/0/1", "h1/1/2"}
    assert {y["slot"]: y["signal"] for y in json.loads(d.memory.to_json())["yielded"]} == {0: "login", 1: "login"}
    assert Memory.from_json(d.memory.to_json()) == d.memory


def test_while_the_start_condition_fails_armed_slots_get_a_yield_not_a_worker():
    d = decide(View(now=10.0, wall=60.0, host="h1", desired=Desired(2, (0, 1)), memory=APPLIED,
                    owner_wait=SIGNAL))
    assert not [a for a in d.actions if isinstance(a, Start)]
    assert sorted(a.record.slot for a in d.actions if isinstance(a, RecordYield)) == [0, 1]
    assert d.memory.armed == frozenset()


def test_before_the_first_judgement_armed_slots_wait_armed():
    d = decide(View(now=10.0, wall=60.0, host="h1", desired=Desired(2, (0, 1)), memory=APPLIED,
                    owner_pending=True))
    assert not [a for a in d.actions if isinstance(a, (Start, RecordYield))]
    assert d.memory.armed == {0, 1}
    d = decide(View(now=11.0, wall=61.0, host="h1", desired=Desired(2, (0, 1)), memory=d.memory))
    assert sorted(a.slot for a in d.actions if isinstance(a, Start)) == [0, 1]


def test_a_waiting_signal_does_not_end_running_workers():
    d = decide(View(now=10.0, wall=60.0, host="h1", desired=Desired(1, (0, 1)), memory=APPLIED,
                    workers=(running(0, 1), running(1, 2)), owner_wait=SIGNAL))
    assert d.actions == ()


# ---------------------------------------------------------------- the probe

HOST = Host(name="ws", address="ws.lab", slots=2)
U0 = "GPU-00000000-0000-0000-0000-000000000000"


def _probe_text(owner_lines: str | None, smi: bool = True) -> str:
    parts = [":::eltctl:probe 1", ":::eltctl:cpus", "4", ":::eltctl:smi"]
    if smi:
        parts += ["/usr/bin/nvidia-smi", ":::eltctl:gpus 0", f"0, {U0}, NVIDIA A100, 0, 40960, 0",
                  ":::eltctl:apps 0", "", ":::eltctl:owners"]
    else:
        parts += [""]
    if owner_lines is not None:
        parts += [":::eltctl:owner", owner_lines]
    return "\n".join(parts + [":::eltctl:end"]) + "\n"


def test_probe_reports_every_slot_busy_with_the_signal():
    sig = {"name": "login", "detail": "alice logged in on pts/3, idle 40 s (starts after 900 s idle)",
           "since": 1.0}
    r = assess_host(HOST, parse_probe_output(_probe_text(json.dumps({"wait": sig, "leave": None}))), Policy())
    assert r.state is HostState.OK and r.slots == 0 and r.owner == sig
    assert r.reason == f"owner signal login: {sig['detail']}"
    assert [(g.state, g.reason) for g in r.gpus] == [(GpuUse.BUSY, f"owner: {sig['detail']}")]
    assert report_to_json(r)["owner"] == sig
    cpu = assess_host(HOST, parse_probe_output(_probe_text(json.dumps({"wait": sig, "leave": None}), smi=False)),
                      Policy())
    assert cpu.state is HostState.CPU_ONLY and cpu.slots == 0 and cpu.reason.startswith("owner signal login: alice")


def test_probe_without_a_signal_or_without_the_check_is_unchanged():
    quiet = assess_host(HOST, parse_probe_output(_probe_text(json.dumps({"wait": None, "leave": None}))), Policy())
    plain = assess_host(HOST, parse_probe_output(_probe_text(None)), Policy())
    assert quiet == plain and plain.owner is None and plain.gpus[0].state is GpuUse.FREE


def test_an_owner_check_that_cannot_run_holds_the_host():
    r = assess_host(HOST, parse_probe_output(_probe_text("sh: 1: python9: not found")), Policy())
    assert r.slots == 0 and r.owner["name"] == "unknown" and "python9: not found" in r.owner["detail"]


def test_the_probe_command_runs_the_check_on_the_host(tmp_path):
    bed = OwnerStandIn(tmp_path)
    bed.login("alice", "pts/3", idle=40)
    policy = replace(ALL, signals=("login",))
    env = {"PATH": os.environ["PATH"], **bed.env()}
    out = subprocess.run(["sh", "-c", probe_command("j", 5.0, policy, sys.executable)], env=env,
                         capture_output=True, text=True, timeout=60).stdout
    r = assess_host(HOST, parse_probe_output(out), Policy())
    assert r.owner["name"] == "login" and "alice logged in on pts/3" in r.owner["detail"], out
    assert probe_command("j", 5.0, OwnerPolicy(), sys.executable) == probe_command("j", 5.0)

"""The controller's policy as tables: which slots each host runs, and what the records remember."""

from __future__ import annotations

import pytest

from eltctl.controller.policy import (
    BENCH_BASE_S,
    GpuUse,
    HostRecord,
    HostPhase,
    HostView,
    Reach,
    SetDesired,
    SlotView,
    StartDaemon,
    bench_duration,
    decide,
    host_state,
    leave_out,
    track,
)
from eltctl.inventory import parse_inventory

NOW = 10_000.0


def inventory(min_workers=1, max_workers=None, idle_for=10, cooldown=60, bench_after=3, hosts=("a", "b")):
    job = f'[job]\nname = "j"\ncommand = "python t.py"\nmin_workers = {min_workers}\n'
    if max_workers is not None:
        job += f"max_workers = {max_workers}\n"
    text = job + (f"[policy]\nidle_for = {idle_for}\ncooldown = {cooldown}\nbench_after = {bench_after}\n")
    for h in hosts:
        text += f'[[hosts]]\nname = "{h}"\naddress = "{h}.lab"\n'
    return parse_inventory(text, "hosts.toml")


def gpus(*uses: str) -> tuple[SlotView, ...]:
    return tuple(SlotView(i, GpuUse(u)) for i, u in enumerate(uses))


def view(name, *uses, alive=False, workers=(), reach=Reach.OK, yielded=(), crashed=(), seq_applied=-1):
    return HostView(name=name, reach=reach, slots=gpus(*uses), daemon_alive=alive, workers=tuple(workers),
                    yielded=tuple(yielded), crashed=tuple(crashed), seq_applied=seq_applied)


def free_for(seconds, *slots):
    return tuple((s, NOW - seconds) for s in slots)


# (case, inventory kwargs, views, records, expected desired, expected actions, waiting)
DECIDE = [
    ("a GPU free for less than idle_for is not used",
     {}, [view("a", "free", "free")], {"a": HostRecord(free_since=free_for(5, 0, 1))},
     {"a": ()}, [], False),  # not "waiting": they become usable by themselves
    ("a GPU free for idle_for is used, and the host's daemon started",
     {}, [view("a", "free", "free")], {"a": HostRecord(free_since=free_for(10, 0, 1))},
     {"a": (0, 1)}, [StartDaemon("a"), SetDesired("a", (0, 1))], False),
    ("a busy GPU is never used",
     {}, [view("a", "busy", "free")], {"a": HostRecord(free_since=free_for(99, 1))},
     {"a": (1,)}, [StartDaemon("a"), SetDesired("a", (1,))], False),
    ("a healthy running job changes nothing (up twice)",
     {}, [view("a", "ours", "ours", alive=True, workers=(0, 1))],
     {"a": HostRecord(desired=(0, 1), seq=1, free_since=free_for(99, 0, 1))},
     {"a": (0, 1)}, [], False),
    ("a running daemon is not started again",
     {}, [view("a", "ours", "free", alive=True, workers=(0,))],
     {"a": HostRecord(desired=(0,), seq=1, free_since=free_for(99, 0, 1))},
     {"a": (0, 1)}, [SetDesired("a", (0, 1))], False),
    ("free but not yet idle long enough: starting, with the reason",
     {"min_workers": 2}, [view("a", "free", "free")], {"a": HostRecord(free_since=free_for(5, 0, 1))},
     {"a": ()}, [], False),
    ("fewer usable than min_workers and nothing running: the job waits",
     {"min_workers": 3}, [view("a", "free", "free"), view("b", "busy", "busy")],
     {"a": HostRecord(free_since=free_for(99, 0, 1))},
     {"a": (), "b": ()}, [], True),
    ("below min_workers but running: what runs keeps running",
     {"min_workers": 3}, [view("a", "ours", "busy", alive=True, workers=(0,))],
     {"a": HostRecord(desired=(0,), seq=1, free_since=free_for(99, 0))},
     {"a": (0,)}, [], False),
    ("max_workers caps the job, in inventory order",
     {"max_workers": 3}, [view("a", "free", "free"), view("b", "free", "free")],
     {"a": HostRecord(free_since=free_for(99, 0, 1)), "b": HostRecord(free_since=free_for(99, 0, 1))},
     {"a": (0, 1), "b": (0,)}, [StartDaemon("a"), SetDesired("a", (0, 1)), StartDaemon("b"), SetDesired("b", (0,))],
     False),
    ("max_workers lowered below what runs: the last host gives up slots",
     {"max_workers": 2}, [view("a", "ours", alive=True, workers=(0,)), view("b", "ours", "ours", alive=True, workers=(0, 1))],
     {"a": HostRecord(desired=(0,), seq=1), "b": HostRecord(desired=(0, 1), seq=1)},
     {"a": (0,), "b": (0,)}, [SetDesired("b", (0,))], False),
    ("a host in cooldown starts nothing new but keeps what runs",
     {}, [view("a", "ours", "free", alive=True, workers=(0,))],
     {"a": HostRecord(desired=(0,), seq=1, cooldown_until=NOW + 5, free_since=free_for(99, 0, 1))},
     {"a": (0,)}, [], False),
    ("a benched host starts nothing",
     {}, [view("a", "free", "free")], {"a": HostRecord(benched_until=NOW + 100, free_since=free_for(99, 0, 1))},
     {"a": ()}, [], True),
    ("a host benched while running gives up its slots",
     {}, [view("a", "ours", "ours", alive=True, workers=(0, 1)), view("b", "free")],
     {"a": HostRecord(desired=(0, 1), seq=4, benched_until=NOW + 100), "b": HostRecord(free_since=free_for(99, 0))},
     {"a": (), "b": (0,)}, [SetDesired("a", ()), StartDaemon("b"), SetDesired("b", (0,))], False),
    ("scale --add waives idle_for, cooldown and benching once",
     {}, [view("a", "free", "free")],
     {"a": HostRecord(join_now=True, benched_until=NOW + 100, cooldown_until=NOW + 5, free_since=free_for(0, 0, 1))},
     {"a": (0, 1)}, [StartDaemon("a"), SetDesired("a", (0, 1))], False),
    ("scale --add without --force still leaves busy GPUs alone",
     {}, [view("a", "busy", "free")], {"a": HostRecord(join_now=True, free_since=free_for(0, 1))},
     {"a": (1,)}, [StartDaemon("a"), SetDesired("a", (1,))], False),
    ("scale --add --force takes busy GPUs too",
     {}, [view("a", "busy", "free")], {"a": HostRecord(join_now=True, force=True, free_since=free_for(0, 1))},
     {"a": (0, 1)}, [StartDaemon("a"), SetDesired("a", (0, 1))], False),
    ("a removed host leaves and stays out however free",
     {}, [view("a", "ours", "ours", alive=True, workers=(0, 1))],
     {"a": HostRecord(removed=True, desired=(0, 1), seq=1, free_since=free_for(99, 0, 1))},
     {"a": ()}, [SetDesired("a", ())], True),
    ("an owner back on a used GPU: that slot is given up",
     {}, [view("a", "ours", "busy", alive=True, workers=(0, 1))],
     {"a": HostRecord(desired=(0, 1), seq=1, free_since=free_for(99, 0))},
     {"a": (0,)}, [SetDesired("a", (0,))], False),
    ("an unreachable host is not used and no daemon is started there",
     {}, [view("a", reach=Reach.UNREACHABLE), view("b", "free")],
     {"a": HostRecord(free_since=free_for(99, 0)), "b": HostRecord(free_since=free_for(99, 0))},
     {"a": (), "b": (0,)}, [StartDaemon("b"), SetDesired("b", (0,))], False),
    ("a host whose daemon reports while SSH fails keeps its slots",
     {}, [view("a", "ours", alive=True, workers=(0,), reach=Reach.OK)],
     {"a": HostRecord(desired=(0,), seq=3)}, {"a": (0,)}, [], False),
    ("an unhealthy host (nvidia-smi hangs) keeps what runs, starts nothing",
     {}, [HostView("a", reach=Reach.UNHEALTHY, daemon_alive=True, workers=(0,))],
     {"a": HostRecord(desired=(0,), seq=1)}, {"a": (0,)}, [], False),
]


@pytest.mark.parametrize("case, inv, views, records, desired, actions, waiting", DECIDE, ids=[c[0] for c in DECIDE])
def test_decide(case, inv, views, records, desired, actions, waiting):
    d = decide({v.name: v for v in views}, records, inventory(**inv), NOW)
    assert {k: v for k, v in d.desired.items() if k in desired} == desired
    assert list(d.actions) == actions
    assert d.waiting is waiting


# ----------------------------------------------------------------------- track

def test_free_clock_starts_at_first_free_sight_and_busy_resets_it():
    inv = inventory(hosts=("a",))
    r = track({}, {"a": view("a", "free", "busy")}, inv, NOW)["a"]
    assert r.free_since == ((0, NOW),)
    r = track({"a": r}, {"a": view("a", "free", "free")}, inv, NOW + 5)["a"]
    assert r.free_since == ((0, NOW), (1, NOW + 5))
    r = track({"a": r}, {"a": view("a", "busy", "ours")}, inv, NOW + 6)["a"]
    assert r.free_since == ((1, NOW + 5),)  # ours keeps its clock: our worker is not an owner


def test_unreachable_host_forgets_its_free_clocks():
    inv = inventory(hosts=("a",))
    r = track({"a": HostRecord(free_since=free_for(99, 0))}, {"a": view("a", reach=Reach.UNREACHABLE)}, inv, NOW)["a"]
    assert r.free_since == ()


def test_yield_drops_the_slot_and_cools_the_host_down():
    inv = inventory(hosts=("a",), cooldown=60)
    rec = HostRecord(desired=(0, 1), seq=2)
    r = track({"a": rec}, {"a": view("a", "ours", "busy", alive=True, workers=(0,), yielded=(1,), seq_applied=2)},
              inv, NOW)["a"]
    assert r.desired == (0,)
    assert r.cooldown_until == NOW + 60
    assert "owner took GPU 1" in r.last_problem


def test_owner_seen_by_the_probe_with_no_daemon_watching_counts_as_a_yield():
    inv = inventory(hosts=("a",), cooldown=60)
    rec = HostRecord(desired=(0, 1), seq=2)
    r = track({"a": rec}, {"a": view("a", "ours", "busy", alive=True, workers=(0, 1), seq_applied=2)}, inv, NOW)["a"]
    assert r.desired == (0,)
    assert r.cooldown_until == NOW + 60
    assert "owner took GPU 1" in r.last_problem


def test_owner_on_a_watched_host_is_left_to_its_daemon():
    # The probe saw the owner before the daemon did: the daemon yields (one yield
    # event, an urgent leave); the controller neither drops the slot nor cools down yet.
    from dataclasses import replace
    inv = inventory(hosts=("a",), cooldown=60)
    rec = HostRecord(desired=(0, 1), seq=2)
    v = replace(view("a", "ours", "busy", alive=True, workers=(0, 1), seq_applied=2), watched=True)
    r = track({"a": rec}, {"a": v}, inv, NOW)["a"]
    assert r.desired == (0, 1) and r.cooldown_until == 0.0
    assert decide({"a": v}, {"a": r}, inv, NOW).desired == {"a": (0, 1)}
    # Once the daemon reports the yield, the slot goes and the host cools down.
    v2 = replace(v, workers=(0,), yielded=(1,))
    r2 = track({"a": r}, {"a": v2}, inv, NOW)["a"]
    assert r2.desired == (0,) and r2.cooldown_until == NOW + 60


def test_a_busy_gpu_that_was_not_asked_for_is_no_yield():
    inv = inventory(hosts=("a",), cooldown=60)
    rec = HostRecord(desired=(0,), seq=2)
    r = track({"a": rec}, {"a": view("a", "ours", "busy", alive=True, workers=(0,), seq_applied=2)}, inv, NOW)["a"]
    assert r.desired == (0,) and r.cooldown_until == 0.0


def test_yield_reported_for_an_older_request_is_ignored():
    inv = inventory(hosts=("a",))
    rec = HostRecord(desired=(0, 1), seq=3)  # slot 1 asked for again in seq 3
    r = track({"a": rec}, {"a": view("a", "ours", "free", alive=True, workers=(0,), yielded=(1,), seq_applied=2)},
              inv, NOW)["a"]
    assert r.desired == (0, 1) and r.cooldown_until == 0.0


@pytest.mark.parametrize("bench_count, expected", [(0, BENCH_BASE_S), (1, 2 * BENCH_BASE_S), (3, 8 * BENCH_BASE_S)])
def test_bench_backs_off_exponentially(bench_count, expected):
    assert bench_duration(0.0, bench_count) == expected
    assert bench_duration(600.0, bench_count) == 600.0 * 2 ** bench_count


def test_repeated_crashes_bench_the_host_with_growing_back_off():
    inv = inventory(hosts=("a",), bench_after=2, cooldown=0)
    rec = HostRecord(desired=(0,), seq=1)
    crashed = {"a": view("a", "free", alive=True, crashed=(0,))}
    rec = track({"a": rec}, crashed, inv, NOW)["a"]
    assert (rec.failures, rec.benched_until, rec.desired) == (1, 0.0, ())
    rec = track({"a": HostRecord(**{**rec.__dict__, "desired": (0,)})}, crashed, inv, NOW + 1)["a"]
    assert rec.benched_until == NOW + 1 + BENCH_BASE_S and rec.bench_count == 1 and rec.failures == 0
    assert "benched after 2 failures" in rec.last_problem
    for _ in range(2):
        rec = track({"a": HostRecord(**{**rec.__dict__, "desired": (0,)})}, crashed, inv, NOW + 2)["a"]
    assert rec.benched_until == NOW + 2 + 2 * BENCH_BASE_S and rec.bench_count == 2
    state, why = host_state(view("a", "free"), rec, NOW + 3)
    assert state is HostPhase.BENCHED and "crashed" in why


def test_host_lost_while_used_counts_as_a_failure_and_gives_up_its_slots():
    inv = inventory(hosts=("a",), cooldown=30)
    r = track({"a": HostRecord(desired=(0, 1), seq=1)}, {"a": view("a", reach=Reach.UNREACHABLE)}, inv, NOW)["a"]
    assert r.desired == () and r.failures == 1 and r.cooldown_until == NOW + 30


def test_clean_running_resets_the_failure_count():
    inv = inventory(hosts=("a",), cooldown=0)
    running = {"a": view("a", "ours", alive=True, workers=(0,))}
    r = track({"a": HostRecord(desired=(0,), failures=2)}, running, inv, NOW)["a"]
    assert r.failures == 2 and r.ok_since == NOW
    r = track({"a": r}, running, inv, NOW + BENCH_BASE_S)["a"]
    assert r.failures == 0


@pytest.mark.parametrize("v, rec, state", [
    (view("a", "ours", alive=True, workers=(0,)), HostRecord(desired=(0,)), HostPhase.RUNNING),
    (view("a", "free"), HostRecord(desired=(0,)), HostPhase.STARTING),
    (view("a", "free"), HostRecord(), HostPhase.IDLE),
    (view("a", "busy", "busy"), HostRecord(), HostPhase.BUSY),
    (view("a", "free"), HostRecord(cooldown_until=NOW + 9), HostPhase.COOLDOWN),
    (view("a", "free"), HostRecord(removed=True), HostPhase.REMOVED),
    (view("a", reach=Reach.UNREACHABLE), HostRecord(), HostPhase.UNREACHABLE),
    (HostView("a", reach=Reach.UNHEALTHY), HostRecord(), HostPhase.UNHEALTHY),
])
def test_host_state(v, rec, state):
    assert host_state(v, rec, NOW)[0] is state


def test_records_round_trip_through_json():
    rec = HostRecord(removed=True, desired=(1, 3), seq=7, free_since=((1, 5.0),), cooldown_until=9.0, failures=2,
                     bench_count=1, benched_until=99.0, last_problem="x", join_now=True, force=True,
                     removed_reason="left out by `eltctl up`: torch: ...")
    assert HostRecord.from_json(rec.to_json()) == rec


UP = "left out by `eltctl up`: torch: `import torch` failed (fix: install it)"


@pytest.mark.parametrize("before, verdict, after", [
    # left out now: removed with the reason, shown as such
    (HostRecord(), {"a": UP}, HostRecord(removed=True, removed_reason=UP)),
    (HostRecord(join_now=True, force=True), {"a": UP}, HostRecord(removed=True, removed_reason=UP)),
    # left out before, passing now: back (its other memory kept)
    (HostRecord(removed=True, removed_reason=UP, failures=1), {}, HostRecord(failures=1)),
    # a new reason replaces the old one
    (HostRecord(removed=True, removed_reason="old"), {"a": UP}, HostRecord(removed=True, removed_reason=UP)),
    # `scale --remove` stands either way
    (HostRecord(removed=True), {}, HostRecord(removed=True)),
    (HostRecord(removed=True), {"a": UP}, HostRecord(removed=True)),
    (HostRecord(), {}, HostRecord()),
])
def test_leave_out(before, verdict, after):
    assert leave_out({"a": before}, verdict, ["a"]) == {"a": after}


def test_left_out_host_shows_its_reason():
    assert host_state(view("a", "free"), HostRecord(removed=True, removed_reason=UP), NOW) == (HostPhase.REMOVED, UP)
    phase, why = host_state(view("a", "free"), HostRecord(removed=True), NOW)
    assert phase is HostPhase.REMOVED and "scale --add" in why
    assert leave_out({}, {"b": UP}, ["a", "b"]) == {"b": HostRecord(removed=True, removed_reason=UP)}

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


def test_cpu_slots_start_at_once_while_gpus_wait_for_idle_for():
    # Issue 25, finding 1: a CPU slot has no owner process to watch; idle_for (600 s in
    # the starter) kept the first `up` of two local CPU hosts blocked for 10 minutes.
    inv = inventory(idle_for=600, hosts=("cpu", "gpu"))
    views = {"cpu": view("cpu", "free", reach=Reach.CPU_ONLY), "gpu": view("gpu", "free")}
    records = track({}, views, inv, NOW)
    d = decide(views, records, inv, NOW)
    assert d.desired == {"cpu": (0,), "gpu": ()}
    assert StartDaemon("cpu") in d.actions and d.starts_at is None


def test_cpu_idle_for_makes_cpu_slots_wait_when_the_inventory_asks():
    text = ('[job]\nname = "j"\ncommand = "python t.py"\n[policy]\ncpu_idle_for = "90s"\n'
            '[[hosts]]\nname = "c"\naddress = "local"\nslots = 2\n')
    inv = parse_inventory(text, "hosts.toml")
    views = {"c": view("c", "free", "free", reach=Reach.CPU_ONLY)}
    d = decide(views, {"c": HostRecord(free_since=free_for(30, 0, 1))}, inv, NOW)
    assert d.desired == {"c": ()} and not d.waiting
    assert d.starts_at == NOW + 60
    assert d.message.startswith("starts in 1 min: 2 free CPU slot(s) are used once they have been free for "
                                "cpu_idle_for (1m30s)")
    assert "`eltctl scale --add c` uses them now" in d.message


def test_a_start_that_waits_for_idle_for_says_when_it_starts():
    # `up` and `status` show a countdown instead of repeating "idle_for (600 s)".
    inv = inventory(min_workers=2, idle_for=600, hosts=("a", "b"))
    views = {"a": view("a", "free"), "b": view("b", "free")}
    records = {"a": HostRecord(free_since=free_for(48, 0)), "b": HostRecord(free_since=free_for(20, 0))}
    d = decide(views, records, inv, NOW)
    assert not d.waiting and d.starts_at == NOW + 580  # the second slot it needs (b's) decides
    assert d.message.startswith("starts in 9 min 40 s: ")


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
    assert r.owner_until == NOW + 60 and r.cooldown_until == 0.0  # an owner's cooldown, not a failure's
    assert "owner took GPU 1" in r.owner_note


def test_owner_seen_by_the_probe_with_no_daemon_watching_counts_as_a_yield():
    inv = inventory(hosts=("a",), cooldown=60)
    rec = HostRecord(desired=(0, 1), seq=2)
    r = track({"a": rec}, {"a": view("a", "ours", "busy", alive=True, workers=(0, 1), seq_applied=2)}, inv, NOW)["a"]
    assert r.desired == (0,)
    assert r.owner_until == NOW + 60 and r.cooldown_until == 0.0  # an owner's cooldown, not a failure's
    assert "owner took GPU 1" in r.owner_note


def test_owner_on_a_watched_host_is_left_to_its_daemon():
    # The probe saw the owner before the daemon did: the daemon yields (one yield
    # event, an urgent leave); the controller neither drops the slot nor cools down yet.
    from dataclasses import replace
    inv = inventory(hosts=("a",), cooldown=60)
    rec = HostRecord(desired=(0, 1), seq=2)
    v = replace(view("a", "ours", "busy", alive=True, workers=(0, 1), seq_applied=2), watched=True)
    r = track({"a": rec}, {"a": v}, inv, NOW)["a"]
    assert r.desired == (0, 1) and r.cooldown_until == 0.0 and r.owner_until == 0.0
    assert decide({"a": v}, {"a": r}, inv, NOW).desired == {"a": (0, 1)}
    # Once the daemon reports the yield, the slot goes and the host cools down.
    v2 = replace(v, workers=(0,), yielded=(1,))
    r2 = track({"a": r}, {"a": v2}, inv, NOW)["a"]
    assert r2.desired == (0,) and r2.owner_until == NOW + 60


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


# ----------------------------------------------------------------------- failures at start and fixes

from dataclasses import replace  # noqa: E402

from eltctl.controller.policy import (  # noqa: E402
    Crash, after_fix, changed_hosts, crash_problem, eligible_slots, fingerprint, fixed,
)

CANT_OPEN = "python: can't open file '/h/code/trian.py': [Errno 2] No such file or directory"


@pytest.mark.parametrize("slots, info, problem, at_start", [
    ([0], [Crash(0, CANT_OPEN, True)], f"worker on slot 0 failed at start: {CANT_OPEN}", True),
    ([0, 1], [Crash(0, "E: x", True), Crash(1, "E: x", True)], "worker on slot 0, 1 failed at start: E: x", True),
    ([0], [Crash(0, "RuntimeError: boom", False)], "worker on slot 0 crashed: RuntimeError: boom", False),
    ([0, 1], [Crash(0, "E: x", True), Crash(1, "", False)], "worker on slot 0, 1 crashed: E: x", False),
    ([0], [], "worker on slot 0 crashed", False),  # an older daemon: no cause
])
def test_crash_problem(slots, info, problem, at_start):
    assert crash_problem(slots, info) == (problem, at_start)


def test_a_failure_at_start_is_remembered_with_its_cause_until_the_host_reaches_a_step():
    inv = inventory(hosts=("a",), cooldown=60)
    v = replace(view("a", "free", alive=True, crashed=(0,)), crash_info=(Crash(0, CANT_OPEN, True),))
    r = track({"a": HostRecord(desired=(0,), seq=1)}, {"a": v}, inv, NOW)["a"]
    assert r.start_failure == r.last_problem == f"worker on slot 0 failed at start: {CANT_OPEN}"
    assert r.cooldown_until == NOW + 60 and r.failures == 1 and r.desired == ()
    assert host_state(view("a", "free"), r, NOW + 1) == (
        HostPhase.COOLDOWN, f"{r.last_problem} (usable again in 59 s; `eltctl logs a --failed` shows its output; "
                            "after a fix `eltctl up` retries at once)")
    # a worker of the host in rank 0's status: it reached a step
    r2 = track({"a": r}, {"a": replace(view("a", "ours", alive=True, workers=(0,)), in_job=True)}, inv, NOW + 70)["a"]
    assert r2.start_failure == ""
    # a crash mid-training is no failure at start
    v3 = replace(view("a", "free", alive=True, crashed=(0,)), crash_info=(Crash(0, "RuntimeError: boom", False),))
    r3 = track({"a": replace(r, desired=(0,))}, {"a": v3}, inv, NOW + 80)["a"]
    assert r3.start_failure == "" and r3.last_problem == "worker on slot 0 crashed: RuntimeError: boom"


BAD = HostRecord(failures=2, cooldown_until=NOW + 50, bench_count=3, benched_until=NOW + 900,
                 last_problem="benched after 3 failures", start_failure="worker on slot 0 failed at start: x")


# (case, record before the fix, what the fix leaves)
FIXES = [
    ("failures, failure cooldown, benching and the start failure are forgotten", BAD,
     HostRecord()),
    ("an owner's cooldown stays: it protects a person",
     replace(BAD, owner_until=NOW + 30, owner_note="its owner took GPU 1"),
     HostRecord(owner_until=NOW + 30, owner_note="its owner took GPU 1")),
    ("what the host runs and was asked stays", replace(BAD, desired=(0,), seq=4, removed=True),
     HostRecord(desired=(0,), seq=4, removed=True)),
]


@pytest.mark.parametrize("case, before, after", FIXES, ids=[c[0] for c in FIXES])
def test_after_fix(case, before, after):
    assert after_fix(before) == after


def test_a_fixed_host_is_usable_at_once_but_an_owner_cooldown_still_holds():
    inv = inventory(hosts=("a", "b"))
    v = view("a", "free")
    recs = {"a": replace(BAD, free_since=free_for(99, 0)),
            "b": replace(BAD, free_since=free_for(99, 0), owner_until=NOW + 30)}
    assert eligible_slots(v, recs["a"], inv, NOW) == []
    out = fixed(recs, ["a", "b", "c"])
    assert eligible_slots(v, out["a"], inv, NOW) == [0]
    assert eligible_slots(v, out["b"], inv, NOW) == []  # its owner came back 30 s ago
    assert eligible_slots(v, out["b"], inv, NOW + 31) == [0]
    assert "c" not in out


def _fp(text_change=lambda t: t, code="c1"):
    text = ('[job]\nname = "j"\ncommand = "python trian.py"\n[[hosts]]\nname = "a"\naddress = "a.lab"\n'
            '[[hosts]]\nname = "b"\naddress = "b.lab"\n')
    from eltctl.inventory import parse_inventory as parse
    return fingerprint(parse(text_change(text), "hosts.toml"), code)


# (case, new fingerprint, hosts concerned)
CHANGES = [
    ("nothing changed", _fp(), []),
    ("the code changed: every host", _fp(code="c2"), ["a", "b"]),
    ("the job's command changed: every host", _fp(lambda t: t.replace("trian", "train")), ["a", "b"]),
    ("one host's entry changed: that host", _fp(lambda t: t.replace('address = "b.lab"',
                                                                    'address = "b.lab"\npython = "/opt/py"')), ["b"]),
    ("a host added: that host", _fp(lambda t: t + '[[hosts]]\nname = "c"\naddress = "c.lab"\n'), ["c"]),
    ("the policy changed: no host", _fp(lambda t: t + "[policy]\ncooldown = 5\n"), []),
]


@pytest.mark.parametrize("case, new, expected", CHANGES, ids=[c[0] for c in CHANGES])
def test_changed_hosts(case, new, expected):
    assert changed_hosts(_fp(), new) == expected


def test_no_fingerprint_before_means_no_change():
    assert changed_hosts(None, _fp()) == [] and changed_hosts({}, _fp()) == []


def test_records_with_the_new_fields_round_trip_and_an_old_owner_cooldown_is_read_as_one():
    rec = HostRecord(cooldown_until=5.0, owner_until=9.0, owner_note="its owner took GPU 0", start_failure="x")
    assert HostRecord.from_json(rec.to_json()) == rec
    old = {"cooldown_until": 9.0, "last_problem": "its owner took GPU 1"}
    assert HostRecord.from_json(old) == HostRecord(owner_until=9.0, owner_note="its owner took GPU 1")


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


# ---------------------------------------------------------------- working hours, cordon, enabled

def _hours_inventory(policy: str = "", a: str = "", b: str = "", min_workers: int = 1):
    text = (f'[job]\nname = "j"\ncommand = "python t.py"\nmin_workers = {min_workers}\n'
            f'[policy]\nidle_for = 10\ncooldown = 60\ntimezone = "Europe/Berlin"\n{policy}\n'
            f'[[hosts]]\nname = "a"\naddress = "a.lab"\n{a}\n[[hosts]]\nname = "b"\naddress = "b.lab"\n{b}\n')
    return parse_inventory(text, "hosts.toml")


def _berlin(d: int, h: int, mi: int = 0) -> float:
    from datetime import datetime
    from zoneinfo import ZoneInfo

    return datetime(2026, 11, d, h, mi, tzinfo=ZoneInfo("Europe/Berlin")).timestamp()


LAB_HOURS = 'hours = ["Mon-Fri 19:00-08:00", "Sat-Sun"]'
BOTH_RUN = {n: HostRecord(desired=(0, 1), seq=1, free_since=((0, 0.0), (1, 0.0))) for n in "ab"}
BOTH_FREE = {n: HostRecord(free_since=((0, 0.0), (1, 0.0))) for n in "ab"}
BOTH_VIEWS = {n: view(n, "ours", "ours", alive=True, workers=(0, 1)) for n in "ab"}
FREE_VIEWS = {n: view(n, "free", "free", alive=True) for n in "ab"}

HOURS = [
    # case, inventory, now, views, records, desired, (a's phase, b's phase), paused
    ("Monday noon, lab hours on every host: the job pauses, resumes at 19:00",
     _hours_inventory(LAB_HOURS), _berlin(23, 12), BOTH_VIEWS, BOTH_RUN, {"a": (), "b": ()},
     (HostPhase.OFF_HOURS, HostPhase.OFF_HOURS), "outside working hours, resumes at Mon 19:00 (a)"),
    ("Monday noon, a dedicated server (hours = always) trains on alone",
     _hours_inventory(LAB_HOURS, b='hours = "always"'), _berlin(23, 12), BOTH_VIEWS, BOTH_RUN,
     {"a": (), "b": (0, 1)}, (HostPhase.OFF_HOURS, HostPhase.RUNNING), ""),
    ("Monday 19:00: the window opens, both hosts start",
     _hours_inventory(LAB_HOURS), _berlin(23, 19), FREE_VIEWS, BOTH_FREE, {"a": (0, 1), "b": (0, 1)},
     (HostPhase.STARTING, HostPhase.STARTING), ""),
    ("Tuesday 07:59, Monday's window past midnight: both run",
     _hours_inventory(LAB_HOURS), _berlin(24, 7, 59), BOTH_VIEWS, BOTH_RUN, {"a": (0, 1), "b": (0, 1)},
     (HostPhase.RUNNING, HostPhase.RUNNING), ""),
    ("Tuesday 07:45 with a 30 min margin: they leave before the window closes",
     _hours_inventory(LAB_HOURS + '\nhours_margin = "30m"'), _berlin(24, 7, 45), BOTH_VIEWS, BOTH_RUN,
     {"a": (), "b": ()}, (HostPhase.OFF_HOURS, HostPhase.OFF_HOURS),
     "outside working hours, resumes at Tue 19:00 (a)"),
    ("Friday noon: the weekend host's zone decides (b in Tokyo is already at Friday 20:00)",
     _hours_inventory(LAB_HOURS, b='timezone = "Asia/Tokyo"'), _berlin(27, 12), BOTH_VIEWS, BOTH_RUN,
     {"a": (), "b": (0, 1)}, (HostPhase.OFF_HOURS, HostPhase.RUNNING), ""),
    ("Saturday noon: the weekend is one window",
     _hours_inventory(LAB_HOURS), _berlin(28, 12), BOTH_VIEWS, BOTH_RUN, {"a": (0, 1), "b": (0, 1)},
     (HostPhase.RUNNING, HostPhase.RUNNING), ""),
    ("off-hours with a host of two left: min_workers 3 cannot be met, the job pauses",
     _hours_inventory(LAB_HOURS, b='hours = "always"', min_workers=3), _berlin(23, 12), BOTH_VIEWS, BOTH_RUN,
     {"a": (), "b": ()}, (HostPhase.OFF_HOURS, HostPhase.RUNNING), "outside working hours, resumes at Mon 19:00 (a)"),
]


@pytest.mark.parametrize("case, inv, now, views, records, desired, phases, paused", HOURS, ids=[c[0] for c in HOURS])
def test_working_hours(case, inv, now, views, records, desired, phases, paused):
    from eltctl.controller.policy import host_limits

    limits = host_limits(inv, records, now)
    d = decide(views, records, inv, now, limits)
    assert dict(d.desired) == desired
    assert d.paused == paused
    got = tuple(host_state(views[n], replace_desired(records[n], d.desired[n]), now, limits[n])[0] for n in "ab")
    assert got == phases


def replace_desired(record: HostRecord, slots) -> HostRecord:
    from dataclasses import replace

    return replace(record, desired=tuple(slots))


def test_off_hours_says_when_the_host_is_usable_again():
    from eltctl.controller.policy import host_limits

    inv = _hours_inventory('hours = ["Sat-Sun"]')
    limits = host_limits(inv, BOTH_RUN, _berlin(24, 12))
    phase, reason = host_state(BOTH_VIEWS["a"], BOTH_RUN["a"], _berlin(24, 12), limits["a"])
    assert phase is HostPhase.OFF_HOURS
    assert reason == "outside its working hours (Sat-Sun); usable again at Sat 00:00; 2 worker(s) leaving"
    assert limits["a"].until == _berlin(28, 0)


def test_off_hours_leave_is_planned_no_cooldown_no_failure():
    from eltctl.controller.policy import host_limits

    inv = _hours_inventory(LAB_HOURS, b='hours = "always"')
    now = _berlin(23, 12)
    d = decide(BOTH_VIEWS, BOTH_RUN, inv, now, host_limits(inv, BOTH_RUN, now))
    assert SetDesired("a", ()) in d.actions
    # the daemon reports the workers gone: no yield, no crash, so no cooldown and no failure
    after = track({"a": HostRecord(desired=(), seq=2, free_since=((0, 0.0), (1, 0.0))), "b": BOTH_RUN["b"]},
                  {"a": view("a", "free", "free", alive=True, seq_applied=2), "b": BOTH_VIEWS["b"]}, inv, now + 5)
    assert not after["a"].cooling(now + 5) and after["a"].failures == 0
    # the window opens: a is used again at once (its GPUs stayed free all along)
    opens = _berlin(23, 19)
    d = decide({"a": view("a", "free", "free", alive=True), "b": BOTH_VIEWS["b"]}, after, inv, opens,
               host_limits(inv, after, opens))
    assert d.desired["a"] == (0, 1) and not d.paused


def test_cordon_is_remembered_in_hosts_json():
    rec = HostRecord(desired=(0,), cordoned=True)
    assert HostRecord.from_json(rec.to_json()) == rec
    assert HostRecord.from_json({}).cordoned is False  # an older hosts.json


def test_a_disabled_host_never_observed_shows_disabled():
    from eltctl.controller.policy import host_limits

    inv = _hours_inventory(a="enabled = false")
    limits = host_limits(inv, {}, NOW)
    assert host_state(None, HostRecord(), NOW, limits["a"]) == (
        HostPhase.DISABLED, "enabled = false in the inventory: not probed, not used")
    assert host_state(None, HostRecord(), NOW, limits["b"])[0] is HostPhase.STARTING


def test_every_cooldown_and_benching_line_names_the_next_command():
    # Issue 25, finding 6: "worker on slot 0 crashed: ValueError: ... (usable again in 291 s)"
    # said neither where the traceback is nor that a fix is tried at once.
    inv = inventory(hosts=("a",), cooldown=300, bench_after=2)
    crash = replace(view("a", "free", alive=True, crashed=(0,)),
                    crash_info=(Crash(0, "ValueError: bad shape", False),))
    r = track({"a": HostRecord(desired=(0,), seq=1)}, {"a": crash}, inv, NOW)["a"]
    assert host_state(view("a", "free"), r, NOW + 9) == (
        HostPhase.COOLDOWN, "worker on slot 0 crashed: ValueError: bad shape (usable again in 291 s; "
                            "`eltctl logs a --failed` shows its output; after a fix `eltctl up` retries at once)")
    r = track({"a": replace(r, desired=(0,), seq=2)}, {"a": crash}, inv, NOW + 400)["a"]
    phase, reason = host_state(view("a", "free"), r, NOW + 401)
    assert phase is HostPhase.BENCHED and reason.endswith(
        "s more; `eltctl logs a --failed` shows its output; after a fix `eltctl up` retries at once)")
    lost = track({"a": HostRecord(desired=(0,), seq=1)}, {"a": view("a", reach=Reach.UNREACHABLE)}, inv, NOW)["a"]
    assert host_state(view("a", "free"), lost, NOW + 1)[1].endswith(
        "(usable again in 299 s; `eltctl doctor` checks the host; it is used again once it answers)")

"""Fair share's rule (eltctl/controller/fairshare.py): tables of cases, no I/O, a fixed clock."""

from __future__ import annotations

import pytest

from eltctl.controller import fairshare as fs
from eltctl.demand import Demand

DAY = 86400.0


def d(job, user, held=0, wanted=0, prio=0, usage=0.0, minw=1, t=1000.0):
    return Demand(job=job, user=user, held=held, wanted=wanted, priority=prio, usage_gpu_h=usage,
                  min_workers=minw, time=t)


def table(jobs, pool, half_life=DAY):
    return {(s.user, s.job): s.share for s in fs.shares(jobs, pool, half_life)}


@pytest.mark.parametrize("name, jobs, pool, expected", [
    ("one job alone takes what it asks", [d("a", "u1", held=6)], 6, {("u1", "a"): 6}),
    ("two equal users: halves", [d("a", "u1", held=6), d("b", "u2", wanted=6)], 6,
     {("u1", "a"): 3, ("u2", "b"): 3}),
    ("a small demand leaves the rest to the other", [d("a", "u1", held=5, wanted=1), d("b", "u2", wanted=1)], 6,
     {("u1", "a"): 5, ("u2", "b"): 1}),
    ("one user's two jobs split its half", [d("a", "u1", held=4), d("c", "u1", held=2), d("b", "u2", wanted=6)], 8,
     {("u1", "a"): 2, ("u1", "c"): 2, ("u2", "b"): 4}),
    ("priority first, the rest to the lower", [d("a", "u1", held=6), d("h", "u2", wanted=2, prio=1)], 6,
     {("u1", "a"): 4, ("u2", "h"): 2}),
    ("priority beats usage", [d("a", "u1", held=6, usage=0.0), d("h", "u2", wanted=6, prio=1, usage=1e6)], 6,
     {("u1", "a"): 0, ("u2", "h"): 6}),
    ("an hour of usage barely moves a day's half-life", [d("a", "u1", held=6, usage=1.0), d("b", "u2", wanted=6)], 6,
     {("u1", "a"): 3, ("u2", "b"): 3}),
    ("heavy recent usage weighs a user down", [d("a", "u1", held=6, usage=6 * 24), d("b", "u2", wanted=6)], 6,
     {("u1", "a"): 2, ("u2", "b"): 4}),
    ("odd pool: the job holding more keeps the extra", [d("a", "u1", held=5), d("b", "u2", wanted=5)], 5,
     {("u1", "a"): 3, ("u2", "b"): 2}),
    ("three users of 6", [d("a", "u1", held=6), d("b", "u2", wanted=6), d("c", "u3", wanted=6)], 6,
     {("u1", "a"): 2, ("u2", "b"): 2, ("u3", "c"): 2}),
])
def test_shares(name, jobs, pool, expected):
    assert table(jobs, pool) == expected
    assert sum(expected.values()) <= pool


def test_the_weight_formula():
    assert fs.weight(0.0, 6, DAY) == 1.0
    assert fs.weight(6 * 24, 6, DAY) == pytest.approx(0.5)  # usage = G * half_life_h


def test_newest_entry_of_a_job_wins():
    assert fs.merge([d("a", "u1", held=1, t=5), d("a", "u1", held=3, t=9)])[0].held == 3


def hold(name, held, ages=None, want=()):
    return fs.HostHold(name=name, held=held, ages=tuple(ages if ages is not None else [3600.0] * held),
                       others_want=tuple(want))


def plan(me, others, hosts, free=0, slack=0, hold_s=600.0):
    return fs.plan(me, others, hosts, free=free, half_life_s=DAY, slack=slack, hold_s=hold_s)


@pytest.mark.parametrize("name, me, others, hosts, kw, release, cap", [
    ("alone: nothing to do", d("a", "u1", held=6), [], [hold("h1", 2)], {}, {}, None),
    ("the other waits: release down to the share, where it wants first",
     d("a", "u1", held=6), [d("b", "u2", wanted=6)],
     [hold("h1", 2), hold("h2", 2, want=["u2/b"]), hold("h3", 2)], {}, {"h2": 2, "h3": 1}, 3),
    ("the other holds its share and wants more: nothing beyond the share", d("a", "u1", held=3),
     [d("b", "u2", held=3, wanted=3)], [hold("h1", 3)], {}, {}, 3),
    ("the other wants nothing more: the free GPUs are there to take", d("a", "u1", held=3), [d("b", "u2", held=3)],
     [hold("h1", 3)], {"free": 2}, {}, 5),
    ("within the slack: keep, but take no more", d("a", "u1", held=4), [d("b", "u2", held=2, wanted=4)],
     [hold("h1", 4)], {"slack": 1}, {}, 4),
    ("GPUs taken too recently stay", d("a", "u1", held=6), [d("b", "u2", wanted=6)],
     [hold("h1", 2, ages=[30.0, 30.0]), hold("h2", 4, ages=[900.0, 900.0, 10.0, 10.0])], {}, {"h2": 2}, 4),
    ("never below min_workers", d("a", "u1", held=6, minw=5), [d("b", "u2", wanted=6)],
     [hold("h1", 6)], {}, {"h1": 1}, 5),
    ("free GPUs serve the waiting job first", d("a", "u1", held=4), [d("b", "u2", wanted=6)],
     [hold("h1", 4)], {"free": 2}, {"h1": 1}, 3),
    ("below its share: grows as the GPUs are released (none is yet)", d("b", "u2", held=1, wanted=5),
     [d("a", "u1", held=5)], [hold("h1", 1)], {}, {}, 1),
    ("below its share: grows into the GPUs released", d("b", "u2", held=1, wanted=5),
     [d("a", "u1", held=3)], [hold("h1", 1)], {"free": 2}, {}, 3),
    ("a higher priority waits for its min_workers", d("a", "u1", held=6), [d("h", "u3", wanted=2, prio=1, minw=2)],
     [hold("h1", 6)], {}, {"h1": 2}, 4),
    ("a higher priority waiting is served before the hold time", d("a", "u1", held=6),
     [d("h", "u3", wanted=2, prio=1, minw=2)], [hold("h1", 6, ages=[5.0] * 6)], {}, {"h1": 2}, 4),
    ("a higher priority below its min_workers: the lower jobs give below theirs, the one holding more first",
     d("a", "u1", held=4, minw=4), [d("b", "u2", held=2, minw=2), d("h", "u3", wanted=2, prio=1, minw=2)],
     [hold("h1", 4)], {}, {"h1": 2}, 2),
    ("... and the other lower job keeps its min_workers", d("b", "u2", held=2, minw=2),
     [d("a", "u1", held=4, minw=4), d("h", "u3", wanted=2, prio=1, minw=2)], [hold("h1", 2)], {}, {}, 2),
    ("equal priority: a share below min_workers is not raised (it waits)", d("a", "u1", held=6, minw=6),
     [d("b", "u2", wanted=6, minw=4)], [hold("h1", 6)], {}, {}, 6),
])
def test_plan(name, me, others, hosts, kw, release, cap):
    p = plan(me, others, hosts, **kw)
    assert dict(p.release) == release
    assert p.cap == cap


def test_plan_says_why():
    p = plan(d("a", "u1", held=6), [d("b", "u2", wanted=6)], [hold("h2", 6)])
    assert p.reason == "released 3 GPUs (3 on h2) to job b (fair share 3 of 6)"
    assert fs.plan_to_json(p)["jobs"][1] == {"user": "u2", "job": "b", "priority": 0, "held": 0, "wanted": 6,
                                             "usage_gpu_h": 0.0, "min_workers": 1, "share": 3, "exact": 3.0,
                                             "waiting": True}


def test_the_rule_converges_to_halves():
    """Two controllers apply the rule in turn, the GPUs released going to the waiting job."""
    a, b = 6, 0
    moves = 0
    for _ in range(5):
        pa = plan(d("a", "u1", held=a, wanted=6 - a), [d("b", "u2", held=b, wanted=6 - b)], [hold("h", a)])
        a -= pa.releasing
        moves += pa.releasing
        pb = plan(d("b", "u2", held=b, wanted=6 - b), [d("a", "u1", held=a, wanted=6 - a)], [hold("h", b)],
                  free=6 - a - b)
        assert not pb.release
        b = min(6 - a, pb.cap if pb.cap is not None else 6)
    assert (a, b, moves) == (3, 3, 3)



def test_the_controller_publishes_its_demand_and_releases(tmp_path):
    """The loop's glue (Controller.fair_share) over probe reports of two hosts that job b
    shares: it publishes on each host, releases where b wants GPUs, and says so."""
    import asyncio
    import textwrap

    from eltctl.controller import policy as pol
    from eltctl.controller.loop import Controller
    from eltctl.inventory import parse_inventory
    from eltctl.probe import Gpu, GpuReport, GpuUse, HostReport, HostState
    from eltctl_runtime.claims import Claim

    inv = parse_inventory(textwrap.dedent("""
        [job]
        name = "a"
        command = "python t.py"
        [policy]
        fairshare_hold = "1m"
        [[hosts]]
        name = "h1"
        address = "local"
        [[hosts]]
        name = "h2"
        address = "local"
        """), tmp_path / "hosts.toml")
    now = 5000.0

    def report(name, b_wants):
        gpus = tuple(GpuReport(gpu=Gpu(i, f"u{i}", "sim", 0, 100, 0), state=GpuUse.OURS, reason="", job="a")
                     for i in range(2))
        claims = tuple((f"gpu{i}", Claim(job="a", user="alice", slot=i, since=now - 3600)) for i in range(2))
        b = Demand(job="b", user="bob", time=now, wanted=4, wants_here=b_wants)
        return HostReport(name=name, address="local", state=HostState.OK, reason="", gpus=gpus, claims=claims,
                          host_time=now, demands=(b,))

    class Events:
        def __init__(self):
            self.got = []

        async def event(self, ev):
            self.got.append(ev)

    store = Events()
    ctl = Controller(inv, None, store, None, "127.0.0.1:1", clock=lambda: now)
    ctl.observed.reports = {"h1": report("h1", False), "h2": report("h2", True)}
    ctl.records = {h: pol.HostRecord(desired=(0, 1)) for h in ("h1", "h2")}
    limits, cap = asyncio.run(ctl.fair_share({}, now))
    assert ctl._published["h2"].held == 4 and ctl._published["h2"].held_here == 2
    assert ctl._published["h1"].wanted == 0
    assert dict(ctl.fair.release) == {"h2": 2} and cap == 2 and limits["h2"].cap == 0
    assert [e["detail"] for e in store.got] == ["released 2 GPUs on h2 to job b (fair share 2 of 4)"]
    asyncio.run(ctl.fair_share({}, now))  # the same plan again: no second event
    assert len(store.got) == 2 - 1

    # The status document has it before the outputs (metrics) see the document.
    seen = []
    extend = ctl.outputs.extend
    ctl.outputs.extend = lambda doc: (seen.append(dict(doc.get("fairshare") or {})), extend(doc))[1]
    doc = ctl.status_document()
    assert seen and seen[0] == doc["fairshare"]
    fair = doc["fairshare"]
    assert (fair["share"], fair["pool"], fair["held"], fair["wanted"], fair["priority"], fair["user"]) == \
        (2, 4, 4, 0, 0, ctl.fair_me.user)
    from eltctl.metrics import render
    from tests.testbed.promtext import parse, value

    fams = parse(render(doc))
    assert value(fams, "eltctl_fairshare_share_gpus") == 2 and value(fams, "eltctl_fairshare_held_gpus") == 4
    assert value(fams, "eltctl_fairshare_releasing_gpus") == sum(fair["release"].values())


def test_a_gpu_in_hand_over_still_counts_in_the_pool():
    """A released 2 of 4; its workers are still leaving (the GPUs show as its own, not free)
    and B has not claimed them: A's share stays 2, nothing more is released."""
    p = plan(d("a", "u1", held=2), [d("b", "u2", held=0, wanted=4)], [hold("h1", 2)], free=0)
    assert p.pool == 2 and p.release  # without the hosts' GPU count, the pool shrinks
    p = fs.plan(d("a", "u1", held=2), [d("b", "u2", held=0, wanted=4)], [hold("h1", 2)], free=0,
                half_life_s=DAY, slack=0, hold_s=600.0, seen=4)
    assert (p.pool, p.share, dict(p.release), p.cap) == (4, 2, {}, 2)


def test_a_job_is_one_job_whatever_account_each_host_saw():
    got = fs.merge([d("b", "eltsim-h1", held=1, t=5), d("b", "eltsim-h2", held=2, t=9), d("a", "root", t=1)])
    assert [(x.user, x.job, x.held) for x in got] == [("eltsim-h2", "b", 2), ("root", "a", 0)]


def test_nothing_more_is_released_while_the_last_release_settles():
    p = fs.plan(d("a", "u1", held=3), [d("b", "u2", held=0, wanted=4)], [hold("h1", 3)], free=0,
                half_life_s=DAY, slack=0, hold_s=600.0, seen=4, settling=True)
    assert (dict(p.release), p.cap) == ({}, 3) and "being claimed" in p.reason


def test_a_waiting_higher_priority_job_gets_its_min_workers_from_equal_jobs():
    """Two equal jobs hold 3 each; job h (priority 1, min_workers 2, max_workers 2) arrives:
    its share is 2, each of the others releases one (hold time or not), and no more."""
    a, b, h = d("a", "u1", held=3, wanted=0), d("b", "u2", held=3, wanted=0), d("h", "u1", wanted=2, prio=1, minw=2)
    assert table([a, b, h], 6) == {("u1", "a"): 2, ("u2", "b"): 2, ("u1", "h"): 2}
    young = [5.0] * 3
    pa, pb = plan(a, [b, h], [hold("h1", 3, ages=young)]), plan(b, [a, h], [hold("h2", 3, ages=young)])
    assert (dict(pa.release), dict(pb.release)) == ({"h1": 1}, {"h2": 1})
    ph = plan(h, [a, b], [], free=0)
    assert ph.share == 2 and not ph.release


def test_status_json_has_the_jobs_own_figures():
    me = d("a", "u1", held=6, wanted=0, prio=2, usage=1.23456, minw=2)
    p = plan(me, [d("b", "u2", wanted=6)], [hold("h2", 6)])
    doc = fs.plan_to_json(p, me)
    assert {k: doc[k] for k in ("share", "pool", "held", "wanted", "priority", "usage_gpu_h", "user", "min_workers")} \
        == {"share": 6, "pool": 6, "held": 6, "wanted": 0, "priority": 2, "usage_gpu_h": 1.235, "user": "u1",
            "min_workers": 2}
    alone = fs.plan_to_json(fs.Plan(), me)
    assert alone["share"] is None and alone["held"] == 6


def test_a_gpu_asked_for_but_not_claimed_yet_counts_once():
    """A released two GPUs; B asked for them (its `held` counts them) but has not claimed
    them yet, so they show free: the pool stays 6, A's cap 3 (it does not grab them back)."""
    p = fs.plan(d("a", "u1", held=3), [d("b", "u2", held=3, wanted=1)], [hold("h1", 3)], free=2,
                half_life_s=DAY, slack=0, hold_s=600.0, seen=6)
    assert (p.pool, p.share, dict(p.release), p.cap) == (6, 3, {}, 3)


def test_gpus_another_job_asked_for_are_not_grabbed_while_it_claims_them():
    """A released two GPUs to h (max_workers 2: it wants nothing more once it asked for
    them); they show free until h's daemon claims them: A's cap stays at what it holds."""
    p = fs.plan(d("a", "u1", held=2), [d("h", "u2", held=2, wanted=0, prio=1, minw=2)], [hold("h1", 2)], free=2,
                half_life_s=DAY, slack=0, hold_s=600.0, seen=4)
    assert (p.pool, p.share, dict(p.release), p.cap) == (4, 2, {}, 2)


def test_a_new_demand_a_daemon_read_counts_before_the_next_probe(tmp_path):
    """Job b's entry appeared after the last probe of h2; job a's daemon there passed it on
    in its state document: the controller releases to b at its next pass, no probe between."""
    import asyncio
    import textwrap
    from types import SimpleNamespace

    from eltctl.controller import policy as pol
    from eltctl.controller.loop import Controller
    from eltctl.inventory import parse_inventory
    from eltctl.probe import Gpu, GpuReport, GpuUse, HostReport, HostState
    from eltctl_runtime.claims import Claim

    inv = parse_inventory(textwrap.dedent("""
        [job]
        name = "a"
        command = "python t.py"
        [[hosts]]
        name = "h2"
        address = "local"
        """), tmp_path / "hosts.toml")
    now = 5000.0
    gpus = tuple(GpuReport(gpu=Gpu(i, f"u{i}", "sim", 0, 100, 0), state=GpuUse.OURS, reason="", job="a")
                 for i in range(2))
    claims = tuple((f"gpu{i}", Claim(job="a", user="alice", slot=i, since=now - 3600)) for i in range(2))
    probed = HostReport(name="h2", address="local", state=HostState.OK, reason="", gpus=gpus, claims=claims,
                        host_time=now - 5, demands=())

    class Events:
        async def event(self, ev):
            pass

    ctl = Controller(inv, None, Events(), None, "127.0.0.1:1", clock=lambda: now)
    ctl.observed.reports = {"h2": probed}
    ctl.records = {"h2": pol.HostRecord(desired=(0, 1))}
    asyncio.run(ctl.fair_share({}, now))
    assert not ctl.fair.release  # nobody else seen
    entry = {"job": "b", "user": "bob", "time": now - 1, "priority": 1, "wanted": 1, "wants_here": True,
             "min_workers": 1, "every": 1.0}
    ctl.observed.seen = {"h2": SimpleNamespace(state={"time": now, "demands": [entry]})}
    asyncio.run(ctl.fair_share({}, now))
    assert dict(ctl.fair.release) == {"h2": 1} and "b" in ctl.fair.to


@pytest.mark.parametrize("name, report_demands, state, expected", [
    ("a daemon's newer entry wins", (d("b", "u2", wanted=1, t=990.0),),
     {"time": 1000.0, "demands": [{"job": "b", "user": "u2", "wanted": 3, "time": 999.0}]}, {"b": 3}),
    ("the probe's newer entry wins", (d("b", "u2", wanted=1, t=999.0),),
     {"time": 1000.0, "demands": [{"job": "b", "user": "u2", "wanted": 3, "time": 990.0}]}, {"b": 1}),
    ("a new job from the daemon", (), {"time": 1000.0, "demands": [{"job": "c", "user": "u3", "wanted": 2,
                                                                     "time": 999.0}]}, {"c": 2}),
    ("a stale entry is ignored", (), {"time": 1000.0, "demands": [{"job": "c", "user": "u3", "wanted": 2,
                                                                    "time": 100.0}]}, {}),
    ("no state, no change", (d("b", "u2", wanted=1),), None, {"b": 1}),
    ("junk is ignored", (), {"time": 1000.0, "demands": [{"user": "x"}, "junk", 3]}, {}),
])
def test_with_daemon_demands(name, report_demands, state, expected):
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Report:
        host_time: float
        demands: tuple

    out = fs.with_daemon_demands({"h": Report(995.0, report_demands)}, {"h": state} if state is not None else {})
    assert {x.job: x.wanted for x in out["h"].demands} == expected, name


@pytest.mark.parametrize("name, kw, wanted", [
    ("a new job wants up to max_workers", dict(min_workers=2, max_workers=2, desired={}), 2),
    ("without max_workers: all it can get (the pool caps it)", dict(min_workers=3, max_workers=None, desired={}),
     fs.UNSEEN_WANT),
    ("a controller restarted beside its workers: nothing more until measured",
     dict(min_workers=1, max_workers=4, desired={"h1": (0, 1)}), 0),
])
def test_first_demand(name, kw, wanted):
    out = fs.first_demand(job="c", user="u", priority=1, hosts=["h1", "h2"], usage_gpu_h=0.5, every=30.0, **kw)
    assert sorted(out) == ["h1", "h2"]
    assert {e.wanted for e in out.values()} == {wanted}, name
    assert all(e.wants_here == (wanted > 0) and e.priority == 1 for e in out.values())
    assert out["h1"].held_here == len(kw["desired"].get("h1", ()))



def test_the_jobs_own_account_wins_over_an_entry_of_its_name_by_another_account():
    """Issue 49: another account may publish an entry named like this job (as itself);
    this job's own figures stay under the controller's account."""
    from types import SimpleNamespace

    mine = Demand(job="mnist", user="alice", time=10.0)
    squat = Demand(job="mnist", user="nobody", time=20.0)
    reports = {"h1": SimpleNamespace(demands=(squat,)), "h2": SimpleNamespace(demands=(mine,))}
    assert fs.own_user(reports, "mnist", "alice") == "alice"
    assert fs.own_user({"h1": SimpleNamespace(demands=(squat,))}, "mnist", "alice") == "nobody"  # as before
    assert fs.own_user({}, "mnist", "alice") == "alice"
    # and the plan of "mnist" never counts an entry of its own name as another job
    me = Demand(job="mnist", user="alice", held=2, wanted=0, min_workers=1)
    ghost = Demand(job="mnist", user="nobody", priority=100, min_workers=8, held=0, wanted=8, time=1.0)
    assert fs.plan(me, [ghost], [], free=0, half_life_s=3600, slack=0, hold_s=0).release == {}


# ----------------------------------------------------------------------- issue 50: fair share counts GPUs only

NOW = 5000.0


def fake_report(name, kind, mine=(), job="a"):
    """A probe's report of a host: `kind` "cpu" (no GPU: 2 CPU slots) or "gpu" (2 GPUs, `mine` this job's)."""
    from eltctl.probe import Gpu, GpuReport, GpuUse, HostReport, HostState

    if kind == "cpu":
        return HostReport(name=name, address="local", state=HostState.CPU_ONLY, reason="", slots=2, host_time=NOW)
    gpus = tuple(GpuReport(gpu=Gpu(i, f"{name}-u{i}", "sim", 0, 100, 0),
                           state=GpuUse.OURS if i in mine else GpuUse.FREE, reason="", job=job if i in mine else "")
                 for i in range(2))
    return HostReport(name=name, address="local", state=HostState.OK, reason="", gpus=gpus, host_time=NOW)


def fake_view(name, kind, mine=()):
    from eltctl.controller import policy as pol
    from eltctl.probe import GpuUse

    reach = pol.Reach.CPU_ONLY if kind == "cpu" else pol.Reach.OK
    slots = tuple(pol.SlotView(i, GpuUse.OURS if (i in mine and kind == "gpu") else GpuUse.FREE, "") for i in range(2))
    return pol.HostView(name, reach, slots=slots, daemon_alive=bool(mine), workers=tuple(mine))


def published(job, hosts):
    """The demand job `job` publishes on its hosts {name: (kind, its slots there)}: the
    controller's arithmetic (own_demand, with the views' CPU hosts)."""
    reports = {n: fake_report(n, k, mine, job) for n, (k, mine) in hosts.items()}
    me, _ = fs.own_demand(job=job, user=f"user-{job}", priority=0, min_workers=1, max_workers=None,
                          desired={n: mine for n, (_, mine) in hosts.items()}, reports=reports, usable=list(hosts),
                          usage_gpu_h=0.0, every=30.0, cpu_hosts={n for n, (k, _) in hosts.items() if k == "cpu"})
    return replace_time(me)


def replace_time(d_):
    from dataclasses import replace

    return replace(d_, time=NOW)


def job_a_decides(hosts, other, hold_s=600.0):
    """Job a's pass (Controller.fair_share, then policy.decide) over its hosts {name: (kind,
    its slots there, added by `scale --add`)}, with another job's entry `other`: the
    release and the slots each host runs."""
    import textwrap

    from eltctl.controller import policy as pol
    from eltctl.inventory import parse_inventory

    inv = parse_inventory(textwrap.dedent('[job]\nname = "a"\ncommand = "python t.py"\n') + "".join(
        f'[[hosts]]\nname = "{n}"\naddress = "local"\n' + ("slots = 2\n" if k == "cpu" else "")
        for n, (k, _, _) in hosts.items()), "hosts.toml")
    reports = {n: fake_report(n, k, mine) for n, (k, mine, _) in hosts.items()}
    views = {n: fake_view(n, k, mine) for n, (k, mine, _) in hosts.items()}
    records = {n: pol.HostRecord(desired=tuple(mine), join_now=added) for n, (_, mine, added) in hosts.items()}
    desired = {n: r.desired for n, r in records.items()}
    cpu = {n for n, v in views.items() if pol.cpu_host(v)}
    usable = list(hosts)
    me, _ = fs.own_demand(job="a", user="user-a", priority=0, min_workers=1, max_workers=None, desired=desired,
                          reports=reports, usable=usable, usage_gpu_h=0.0, every=30.0, cpu_hosts=cpu)
    p = fs.plan(me, [other], fs.holds(desired, reports, "a", cpu), free=fs.free_gpus(reports, usable),
                half_life_s=DAY, slack=0, hold_s=hold_s, seen=fs.shared_gpus(reports, usable))
    limits = pol.fair_limits({}, records, p.release, p.reason) if p.release else {}
    decision = pol.decide(views, records, inv, NOW, limits, p.cap)
    return me, dict(p.release), {n: tuple(s) for n, s in decision.desired.items()}


# (case, job a's hosts {name: (kind, its slots, added)}, the other job's hosts (as for `published`),
#  a's held and wanted, a's release, the slots each host runs after a's pass)
CPU_AND_GPU = [
    ("two jobs on CPU hosts: the added host's free CPU slots are given (issue 50: none joined)",
     {"c1": ("cpu", (0, 1), False), "c2": ("cpu", (), True)}, {"c1": ("cpu", (0, 1))},
     (0, 0), {}, {"c1": (0, 1), "c2": (0, 1)}),
    ("a CPU host added beside GPUs held while another job waits for GPUs: its CPU slots join",
     {"g1": ("gpu", (0, 1), False), "c1": ("cpu", (), True)}, {"g1": ("gpu", ())},
     (2, 0), {}, {"g1": (0, 1), "c1": (0, 1)}),
    ("GPU hosts unchanged: an added GPU host's free GPUs are left to the job that waits below its share",
     {"g1": ("gpu", (0, 1), False), "g2": ("gpu", (), True)}, {"g3": ("gpu", ())},
     (2, 2), {}, {"g1": (0, 1), "g2": ()}),
]


@pytest.mark.parametrize("case, mine, theirs, figures, release, runs", CPU_AND_GPU, ids=[c[0] for c in CPU_AND_GPU])
def test_fair_share_counts_gpus_only_and_cpu_slots_join(case, mine, theirs, figures, release, runs):
    other = published("b", theirs)
    me, got_release, got_runs = job_a_decides(mine, other)
    assert (me.held, me.wanted) == figures, case
    assert got_release == release and got_runs == runs, case


def test_cpu_slots_held_do_not_count_in_the_gpus_released():
    """Job a holds 2 GPUs and 2 CPU slots, b waits for GPUs: a's share is 1 of the 2 GPUs,
    so it releases 1 GPU (counting its CPU slots it held 4 of a pool of 4 and released 2),
    and its CPU slots stay."""
    other = Demand(job="b", user="user-b", held=0, wanted=2, time=NOW)
    me, release, runs = job_a_decides({"g1": ("gpu", (0, 1), False), "c1": ("cpu", (0, 1), False)}, other, hold_s=0.0)
    assert (me.held, release, runs) == (2, {"g1": 1}, {"g1": (0,), "c1": (0, 1)})


def test_a_cpu_only_job_publishes_no_gpu_and_is_no_other_job():
    """A job of CPU slots holds and wants no GPU: the jobs sharing its hosts see no other job."""
    cpu_job = published("b", {"c1": ("cpu", (0, 1))})
    assert (cpu_job.held, cpu_job.wanted) == (0, 0)
    p = fs.plan(d("a", "u1", held=2, wanted=2), [cpu_job], [hold("g1", 2)], free=2, half_life_s=DAY, slack=0,
                hold_s=600.0, seen=4)
    assert p == fs.Plan()


def test_a_finished_or_stopping_job_publishes_held_0_wanted_0(tmp_path):
    """Issue 50: a finished job's controller went on publishing its last demand (held 2),
    seen by the other jobs and `eltctl lab` as "holding 2" until the entry went stale."""
    import asyncio
    import textwrap

    from eltctl.controller import policy as pol
    from eltctl.controller.loop import Controller
    from eltctl.inventory import parse_inventory

    inv = parse_inventory(textwrap.dedent("""
        [job]
        name = "a"
        command = "python t.py"
        [[hosts]]
        name = "g1"
        address = "local"
        [[hosts]]
        name = "g2"
        address = "local"
        enabled = false
        """), tmp_path / "hosts.toml")
    for how in ("finished", "down"):
        ctl = Controller(inv, None, None, None, "127.0.0.1:1", clock=lambda: NOW)
        ctl.observed.reports = {"g1": fake_report("g1", "gpu", (0, 1)), "g2": fake_report("g2", "gpu")}
        ctl.records = {"g1": pol.HostRecord(desired=(0, 1))}
        asyncio.run(ctl.fair_share({}, NOW))
        assert ctl.to_publish()["g1"].held == 2  # training: what it holds
        if how == "finished":
            ctl.outputs.done = {"step": 30, "reason": "finished"}
        else:
            ctl.stopping = True
        out = ctl.to_publish()
        assert sorted(out) == ["g1"], how  # its enabled hosts: what its probe reaches
        assert {(e.job, e.user, e.held, e.wanted, e.held_here, e.wants_here) for e in out.values()} == \
            {("a", ctl.fair_me.user, 0, 0, 0, False)}, how

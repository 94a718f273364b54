"""Demand documents (eltctl/demand.py) and the probe's `demand` section (eltctl/probe.py)."""

from __future__ import annotations

import os
import subprocess

from eltctl.demand import Demand, stale_after
from eltctl.probe import parse_probe_output, probe_command
from eltctl.sharedir import parse_demands


def test_parse_keeps_fresh_entries_and_the_write_failure():
    fresh = Demand(job="a", user="alice", time=1000.0, held=2, wanted=1, every=30.0)
    old = Demand(job="b", user="bob", time=1000.0 - stale_after(30.0) - 200, held=4)
    # each entry: name, its owner's uid and account, content
    lines = ["1050", f"demand.alice.a 1001 alice {fresh.to_json()}", f"demand.bob.b 1002 bob {old.to_json()}",
             "demand.x.y 1003 x not json", "!cannot write /tmp/eltctl-gpus/demand.alice.a"]
    got = parse_demands(lines)
    assert got["host_time"] == 1050.0
    assert got["demands"] == (fresh,)
    assert got["demand_error"] == "cannot write /tmp/eltctl-gpus/demand.alice.a"


def test_bad_fields_are_defaults():
    d = Demand.from_json('{"job": "a", "held": -3, "wanted": "x", "priority": true, "min_workers": 0}')
    assert (d.held, d.wanted, d.priority, d.min_workers) == (0, 0, 0, 1)
    assert Demand.from_json('{"held": 1}') is None


def test_the_probe_script_publishes_and_reads_back(tmp_path):
    cdir = tmp_path / "claims"
    mine = Demand(job="jobA", priority=1, held=2, wanted=3, held_here=1, wants_here=True, usage_gpu_h=0.5)
    env = dict(os.environ, ELTCTL_CLAIMS_DIR=str(cdir))
    for demand in (mine, None):  # a controller's probe writes; `eltctl probe` only reads
        out = subprocess.run(probe_command("jobA", 5, None, "python3", demand), shell=True, capture_output=True,
                             text=True, env=env, timeout=60)
        probe = parse_probe_output(out.stdout)
        assert probe.complete and probe.host_time is not None
        (got,) = probe.demands
        assert got.published() == mine.published() and got.user
    assert oct(cdir.stat().st_mode & 0o7777) == "0o1777"
    (f,) = cdir.iterdir()
    assert f.name == f"demand.{got.user}.jobA" and oct(f.stat().st_mode & 0o777) == "0o644"


def test_entries_a_daemon_passed_on_are_judged_on_its_hosts_clock():
    from eltctl.demand import from_daemon_state

    state = {"time": 1000.0, "demands": [{"job": "b", "user": "bob", "time": 990.0, "every": 1.0},
                                         {"job": "x", "time": 10.0, "every": 1.0}, {"nojob": 1}]}
    assert [d.job for d in from_daemon_state(state)] == ["b"]
    assert from_daemon_state(state, not_before=990.0 + 61) == ()  # a newer probe of the host: b is stale by then
    assert from_daemon_state({"demands": []}) == () and from_daemon_state(None) == ()


def test_a_time_in_the_future_is_never_fresh():
    """Issue 49: `time: 9e12` kept a forged entry fresh for ever; a small clock skew is allowed."""
    from eltctl_runtime.claims import CLOCK_SKEW_S, demand_fresh

    now = 1000.0
    assert not Demand(job="g", time=9e12).fresh(now)
    assert not Demand(job="g", time=now + CLOCK_SKEW_S + 1).fresh(now)
    assert Demand(job="g", time=now + CLOCK_SKEW_S - 1).fresh(now)
    assert not demand_fresh({"time": 9e12}, now) and demand_fresh({"time": now + 5}, now)

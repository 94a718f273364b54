"""The real host daemon with an owner signal: a real busy process on its (simulated)
host makes both workers leave in the planned way, with one yield per slot naming the
load signal; once the process is gone, the next desired seq starts workers again.

The host has a name of its own: the daemon counts only processes whose environment
holds the same ELTSIM_HOST (tests/testbed/owner.py), and other tests name theirs h1, h2.
"""

from __future__ import annotations

import uuid

import pytest

from daemon_fixtures import SimHost, alive
from tests.testbed.owner import OwnerStandIn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Leave at once above 0.05 CPUs of other processes' load; start below 0.05.
LOAD = {"signals": ["load"], "start_load": 0.05, "leave_load": 0.05, "leave_load_for": 0}


@pytest.fixture
def host(tmp_path):
    h = SimHost(tmp_path, name=f"o{uuid.uuid4().hex[:6]}", overrides={"owner": LOAD})
    bed = OwnerStandIn(tmp_path / "owner")
    try:
        yield h, bed
    finally:
        bed.close()
        h.close()


def test_foreign_load_makes_the_workers_leave_in_the_planned_way_and_they_come_back(host):
    host, bed = host
    host.start_daemon()
    host.desire([0, 1])
    host.wait_world(2)
    first = host.live_workers()
    assert (host.state() or {}).get("signal") is None

    busy = bed.start_busy(host.name)
    host.wait_for(lambda: not any(alive(w["pid"]) for w in first.values()), "both workers to leave", timeout=90)
    yields = host.wait_for(lambda: len(host.events("yield")) >= 2 and host.events("yield"), "two yield events")
    assert sorted(w for e in yields for w in e["workers"]) == sorted(w["worker_id"] for w in first.values())
    assert all(e["detail"].startswith("owner signal load: ") for e in yields), yields
    # The state document is republished each tick: wait for one written after the leave.
    state = host.wait_for(lambda: (s := host.state()) and s.get("signal") and s, "the state to name the signal")
    assert state["signal"]["name"] == "load" and f"pid {busy}" in state["signal"]["detail"], state["signal"]
    assert sorted((y["slot"], y["signal"]) for y in state["yielded"]) == [(0, "load"), (1, "load")]
    assert not [e for e in host.events() if e["kind"] == "crash"]
    for w in first.values():
        assert not host.dead_reported(w["worker_id"])  # planned leaves, not deaths
    assert "owner signal load" in host.log()

    # Armed slots wait while the load holds: a new seq gets yields, not workers.
    seq = host.desire([0, 1])
    host.wait_for(lambda: len(host.events("yield")) >= 4 and (host.state() or {}).get("seq_applied") == seq
                  and not host.live_workers(), "the new seq's yields")
    assert host.log().count("started worker") == 2

    bed.stop_busy()
    host.wait_for(lambda: (host.state() or {"signal": 1}).get("signal") is None, "the signal to clear")
    host.desire([0, 1])
    host.wait_world(2)
    again = host.live_workers()
    assert not {w["worker_id"] for w in again.values()} & {w["worker_id"] for w in first.values()}

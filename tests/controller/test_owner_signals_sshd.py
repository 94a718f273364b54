"""An owner logs in on a host, end to end on real sshd hosts.

Plan: two simulated GPU hosts (2 GPUs each, four CPU workers), each with its own
utmp and /dev (tests/testbed/owner.py: real glibc utmp records and tty atimes, named
through $ELTCTL_UTMP and $ELTCTL_DEV_ROOT in the hosts' sessions), the login signal
watched. alice logs in on h2 (a utmp record and a tty used just now): both workers of
h2 leave in the planned way (a `leave` generation that lost nobody, no crash), h1's
go on, one yield per slot names the signal, `eltctl status` shows it and `eltctl probe`
reports h2's GPUs busy with it. alice logs out: after idle_for and the cooldown h2
comes back and the job is at four again.
"""

from __future__ import annotations

import json

import pytest

from tests.testbed.jobenv import job_env_on, wait_for, worker_pids
from tests.testbed.owner import OwnerStandIn

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(300)]

OWNER_POLICY = """\
owner_signals = ["login"]
owner_idle_to_start = "5s"
owner_active_within = "1m"
"""


def _host(doc: dict, name: str) -> dict:
    return next(h for h in doc["hosts"] if h["name"] == name)


@pytest.fixture
def owned(testbed, tmp_path):
    """(job_env, {host name: OwnerStandIn}) on two hosts that watch logins."""
    stand_ins = {name: OwnerStandIn(tmp_path / name) for name in ("h1", "h2")}
    hosts = testbed.add_hosts(2, gpus=2, names=list(stand_ins), envs=[s.env() for s in stand_ins.values()])
    gen = job_env_on(testbed, hosts, extra=OWNER_POLICY)
    je = next(gen)
    try:
        yield je, stand_ins
    finally:
        for s in stand_ins.values():
            s.close()
        for _ in gen:
            pass


def test_an_owner_logging_in_empties_the_host_in_the_planned_way_and_logging_out_brings_it_back(owned):
    je, bed = owned
    je.eltctl("up")
    st = je.training_at(4)
    before = worker_pids(je.job)
    h2_workers = sorted(w for w in before if w.startswith("h2/"))
    assert len(h2_workers) == 2, before

    bed["h2"].login("alice", "pts/3", idle=0)
    wait_for(lambda: not any(w.startswith("h2/") for w in worker_pids(je.job)), 60,
             "h2's workers to leave for alice's login", interval=0.1)
    assert {w: p for w, p in worker_pids(je.job).items()} == {w: p for w, p in before.items()
                                                              if w.startswith("h1/")}
    st = je.training_at(2, after_step=st["step"])

    events = st["events"]
    yields = [e for e in events if e["kind"] == "yield" and e["host"] == "h2"]
    assert len(yields) >= 2 and all("owner signal login: alice (login on pts/3)" in e["detail"] for e in yields)
    first = min(e["time"] for e in yields)
    after = [e for e in events if e["time"] >= first]
    assert not [e for e in after if e["kind"] in ("crash", "hang", "restore")], after
    leaves = [e for e in after if e["kind"] == "leave"]
    assert leaves and all(not e.get("lost") for e in leaves), leaves  # planned: nobody lost, no step redone
    assert sorted(w for e in leaves for w in e.get("left", [])) == h2_workers

    shown = wait_for(lambda: _host(json.loads(je.eltctl("status", "--json").stdout), "h2").get("signal"), 30,
                     "status to show h2's owner signal")
    assert shown["name"] == "login" and "alice logged in on pts/3" in shown["detail"], shown
    view = je.eltctl("status").stdout
    assert "owner signal login" in view and "alice" in view, view
    probed = {h["name"]: h for h in json.loads(je.eltctl("probe", "--json").stdout)}
    assert probed["h1"]["owner"] is None
    assert probed["h2"]["owner"]["name"] == "login" and probed["h2"]["slots"] == 0
    assert {g["state"] for g in probed["h2"]["gpus"]} == {"busy"}
    assert all(g["reason"].startswith("owner: alice logged in on pts/3") for g in probed["h2"]["gpus"])

    bed["h2"].logout("pts/3")
    st = je.training_at(4, after_step=st["step"], timeout=120)
    back = worker_pids(je.job)
    assert sorted(w.rsplit("/", 1)[0] for w in back if w.startswith("h2/")) == ["h2/0", "h2/1"]
    assert not set(back) & set(h2_workers)  # new workers
    assert _host(json.loads(je.eltctl("status", "--json").stdout), "h2")["signal"] is None

"""`eltctl lab`'s view (eltctl/lab.py): the hosts' claims and demand entries, folded per job."""

from __future__ import annotations

import pytest

from eltctl.demand import Demand
from eltctl.lab import lab_view, view_to_json
from eltctl.probe import Gpu, GpuReport, GpuUse, HostReport, HostState
from eltctl_runtime.claims import Claim


def host(name, holders, demands=()):
    """`holders`: per GPU, the (user, job) whose claim holds it, or None (free)."""
    gpus = tuple(GpuReport(gpu=Gpu(i, f"{name}-{i}", "sim", 0, 100, 0),
                           state=GpuUse.FREE if h is None else GpuUse.TAKEN, reason="")
                 for i, h in enumerate(holders))
    claims = tuple((f"gpu{i}", Claim(job=h[1], user=h[0], slot=i)) for i, h in enumerate(holders) if h)
    return HostReport(name=name, address=name, state=HostState.OK, reason="", gpus=gpus, claims=claims,
                      host_time=100.0, demands=tuple(demands))


def test_two_users_on_three_hosts():
    a = Demand(job="a", user="alice", time=100.0, held=5, wanted=1, usage_gpu_h=2.0)
    b = Demand(job="b", user="bob", time=100.0, held=0, wanted=6, priority=0)
    reports = [host("h1", [("alice", "a"), ("alice", "a")], [a, b]),
               host("h2", [("alice", "a"), ("alice", "a")], [a]),
               host("h3", [("alice", "a"), None], [b]),
               HostReport(name="h4", address="h4", state=HostState.UNREACHABLE, reason="down")]
    doc = view_to_json(lab_view(reports, 86400.0))
    assert (doc["pool"], doc["free"], doc["unreachable"]) == (6, 1, ["h4"])
    assert doc["jobs"] == [
        {"job": "a", "user": "alice", "priority": 0, "held": 5, "held_gpus": 5, "held_cpu_slots": 0, "wanted": 1,
         "usage_gpu_h": 2.0, "share": 3,
         "hosts": {"h1": 2, "h2": 2, "h3": 1}, "published": True},
        {"job": "b", "user": "bob", "priority": 0, "held": 0, "held_gpus": 0, "held_cpu_slots": 0, "wanted": 6,
         "usage_gpu_h": 0.0, "share": 3,
         "hosts": {}, "published": True},
    ]


def test_a_job_seen_only_by_its_claims():
    doc = view_to_json(lab_view([host("h1", [("carol", "old"), None])], 86400.0))
    assert doc["jobs"] == [{"job": "old", "user": "carol", "priority": None, "held": 1, "held_gpus": 1,
                            "held_cpu_slots": 0, "wanted": None,
                            "usage_gpu_h": None, "share": 1, "hosts": {"h1": 1}, "published": False}]


def cpu_host(name, holders, demands=(), machine_claims=()):
    """A host without GPUs: `holders` per CPU slot as in `host`; `machine_claims`: the
    claims of the other inventory hosts of the same machine (its claims directory is shared)."""
    claims = tuple((f"cpu{i}.{name}", Claim(job=h[1], user=h[0], slot=i)) for i, h in enumerate(holders) if h)
    return HostReport(name=name, address="local", state=HostState.CPU_ONLY, reason="", slots=len(holders),
                      claims=claims + tuple(machine_claims), host_time=100.0, demands=tuple(demands))


def test_cpu_slots_are_held_and_their_hosts_counted():
    """Issue 50: a CPU-slot job showed `held 0` and "2 job(s) on 0 host(s)": CPU slots'
    claims (`cpu0.HOST`) were not counted, nor hosts without GPUs."""
    a = Demand(job="a", user="alice", time=100.0, held=2, wanted=0)
    b = Demand(job="b", user="bob", time=100.0, held=1, wanted=2)
    other = (("cpu0.local-a", Claim(job="a", user="alice", slot=0)),)  # local-a's claim, seen from local-b's machine
    reports = [cpu_host("local-a", [("alice", "a"), ("bob", "b")], [a, b]),
               cpu_host("local-b", [("alice", "a"), None], [a, b], machine_claims=other)]
    view = lab_view(reports, 86400.0)
    doc = view_to_json(view)
    assert doc["hosts"] == ["local-a", "local-b"]
    jobs = {j["job"]: j for j in doc["jobs"]}
    assert (jobs["a"]["held"], jobs["a"]["held_cpu_slots"], jobs["a"]["held_gpus"]) == (2, 2, 0)
    assert jobs["a"]["hosts"] == {"local-a": 1, "local-b": 1}  # local-a's claim is not counted twice
    assert (jobs["b"]["held"], jobs["b"]["hosts"]) == (1, {"local-a": 1})
    assert jobs["a"]["share"] is None  # fair share counts GPUs only: a job of CPU slots has no share
    text = lab_text(view, 80)
    assert "2 job(s) on 2 host(s); 3 slots shared" in text and "2 CPU" in text


def lab_text(view, width):
    import io

    from rich.console import Console

    from eltctl.commands.lab import lab_renderables

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None, highlight=False)
    for part in lab_renderables(view):
        console.print(part)
    return console.export_text()


@pytest.mark.parametrize("width", [120, 80, 60])
def test_the_table_never_cuts_a_column_header(width):
    """Issue 50: at 80 columns the table showed "priorit" and "wante": values give way
    (long names cut with an ellipsis; narrower than 100 columns, the hosts go under the
    table), headers never."""
    long = Demand(job="a-job-with-a-very-long-name", user="someone-with-a-long-account", time=100.0, held=2,
                  wanted=4, priority=10, usage_gpu_h=12.5)
    reports = [host(f"workstation-{i}", [("someone-with-a-long-account", "a-job-with-a-very-long-name")] * 2,
                    [long]) for i in range(4)]
    text = lab_text(lab_view(reports, 86400.0), width)
    header = next(line for line in text.splitlines() if "job" in line and "share" in line)
    assert header.split() == ["job", "user", "prio", "held", "wants", "GPU-h", "share"] + (["hosts"] if width >= 100
                                                                                          else [])
    assert all(len(line.rstrip()) <= width for line in text.splitlines())
    assert "workstation-3:2" in text and "1 job(s) on 4 host(s); 8 GPUs shared, 0 GPU(s) free" in text

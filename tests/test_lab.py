"""`eltctl lab`'s view (eltctl/lab.py): the hosts' claims and demand entries, folded per job."""

from __future__ import annotations

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
        {"job": "a", "user": "alice", "priority": 0, "held": 5, "wanted": 1, "usage_gpu_h": 2.0, "share": 3,
         "hosts": {"h1": 2, "h2": 2, "h3": 1}, "published": True},
        {"job": "b", "user": "bob", "priority": 0, "held": 0, "wanted": 6, "usage_gpu_h": 0.0, "share": 3,
         "hosts": {}, "published": True},
    ]


def test_a_job_seen_only_by_its_claims():
    doc = view_to_json(lab_view([host("h1", [("carol", "old"), None])], 86400.0))
    assert doc["jobs"] == [{"job": "old", "user": "carol", "priority": None, "held": 1, "wanted": None,
                            "usage_gpu_h": None, "share": 1, "hosts": {"h1": 1}, "published": False}]

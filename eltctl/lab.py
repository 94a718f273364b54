"""`eltctl lab`: every eltctl job on the inventory's hosts, as the hosts themselves say.

One probe of every host (eltctl/probe.py) gives each host's held GPU claims (which job,
which user) and the demand entries the jobs' controllers published beside them
(eltctl/demand.py). `lab_view` folds them into one line per job: its user, priority,
the GPUs it holds on these hosts (its claims), how many more it wants, its recent usage
and its fair share by the rule every controller applies (controller/fairshare.py),
over the pool of GPUs held plus those free. Pure; `JSON_FORMAT` documents `--json`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from eltctl.controller import fairshare
from eltctl.demand import Demand
from eltctl.probe import GpuUse, HostReport, HostState


@dataclass(frozen=True)
class LabJob:
    job: str
    user: str
    priority: int | None  # None: the job published no demand here (not known)
    held: int  # GPUs its claims hold on the probed hosts
    wanted: int | None
    usage_gpu_h: float | None
    share: int | None
    hosts: tuple[tuple[str, int], ...]  # (host, GPUs held there)
    published: bool  # a fresh demand entry was seen


@dataclass(frozen=True)
class LabView:
    jobs: tuple[LabJob, ...]
    pool: int  # GPUs held by eltctl jobs plus free GPUs on the probed hosts
    free: int
    hosts: tuple[str, ...]  # the hosts that answered with GPUs
    unreachable: tuple[str, ...]


def lab_view(reports: Iterable[HostReport], half_life_s: float) -> LabView:
    reports = list(reports)
    held: dict[str, dict[str, int]] = {}  # job -> host -> GPUs its claims hold there
    users: dict[str, set[str]] = {}  # job -> the accounts seen holding its claims
    free = 0
    seen: list[Demand] = []
    answered, lost = [], []
    for r in reports:
        if not r.reachable:
            lost.append(r.name)
            continue
        if r.state is HostState.OK:
            answered.append(r.name)
            free += sum(1 for g in r.gpus if g.state is GpuUse.FREE)
        for name, claim in r.claims:
            if name.startswith("gpu") and claim.job:
                per = held.setdefault(claim.job, {})
                per[r.name] = per.get(r.name, 0) + 1
                if claim.user:
                    users.setdefault(claim.job, set()).add(claim.user)
        seen.extend(r.demands)
    # A job is known by its name, as its claims are (its account may differ between hosts).
    demands = {d.job: d for d in fairshare.merge(seen)}
    names = sorted(set(demands) | set(held))
    counts = {j: sum(held.get(j, {}).values()) for j in names}
    user = {j: demands[j].user if j in demands else ", ".join(sorted(users.get(j, ()))) for j in names}
    pool = sum(counts.values()) + free
    table_in = [Demand(**{**demands[j].__dict__, "held": counts[j]}) if j in demands
                else Demand(job=j, user=user[j], held=counts[j]) for j in names]
    shares = {s.job: s.share for s in fairshare.shares(table_in, pool, half_life_s)}
    jobs = []
    for j in sorted(names, key=lambda j: (user[j], j)):
        d = demands.get(j)
        jobs.append(LabJob(job=j, user=user[j], priority=d.priority if d else None, held=counts[j],
                           wanted=d.wanted if d else None, usage_gpu_h=d.usage_gpu_h if d else None,
                           share=shares.get(j), hosts=tuple(sorted(held.get(j, {}).items())), published=d is not None))
    return LabView(jobs=tuple(jobs), pool=pool, free=free, hosts=tuple(answered), unreachable=tuple(lost))


def view_to_json(v: LabView) -> dict:
    return {
        "pool": v.pool, "free": v.free, "hosts": list(v.hosts), "unreachable": list(v.unreachable),
        "jobs": [{"job": j.job, "user": j.user, "priority": j.priority, "held": j.held, "wanted": j.wanted,
                  "usage_gpu_h": None if j.usage_gpu_h is None else round(j.usage_gpu_h, 3), "share": j.share,
                  "hosts": {h: n for h, n in j.hosts}, "published": j.published} for j in v.jobs],
    }


JSON_FORMAT = """\
`eltctl lab --json` prints one object:

| key | type | meaning |
|---|---|---|
| `pool` | int | GPUs the fair share divides: those eltctl jobs hold on the probed hosts plus the free ones |
| `free` | int | free GPUs on the probed hosts |
| `hosts` | [string] | the hosts that answered with GPUs |
| `unreachable` | [string] | the hosts that did not answer |
| `jobs` | [object] | one per eltctl job seen (its GPU claims or its demand entry), by user then job |

Each job: `job`, `user` (the host account), `priority` (int, null when it published no
demand), `held` (GPUs its claims hold on these hosts), `wanted` (how many more it could
use, null when unknown), `usage_gpu_h` (its recent usage: GPU-hours decayed with its
`usage_half_life`, null when unknown), `share` (its fair share of `pool`, by
docs/fairshare.md's rule), `hosts` ({host: GPUs held there}), `published` (a fresh demand
entry was seen: a running controller; false for a job seen only by its claims).
"""

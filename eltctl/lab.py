"""`eltctl lab`: every eltctl job on the inventory's hosts, as the hosts themselves say.

One probe of every host (eltctl/probe.py) gives each host's held GPU claims (which job,
which user) and the demand entries the jobs' controllers published beside them
(eltctl/demand.py). `lab_view` folds them into one line per job: its user, priority,
the slots it holds on these hosts (its claims: GPUs, and CPU slots on hosts without
GPUs, counted apart), how many more it wants, its recent usage and its fair share by
the rule every controller applies (controller/fairshare.py), over the pool of GPUs
held plus the free GPUs (as a controller counts it: fair share counts no CPU slot; a
job that holds and wants no GPU has no share). Pure; `JSON_FORMAT` documents `--json`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from eltctl.controller import fairshare
from eltctl.demand import Demand
from eltctl.probe import GpuUse, HostReport, HostState
from eltctl_runtime.claims import parse_slot_file


@dataclass(frozen=True)
class LabJob:
    job: str
    user: str
    priority: int | None  # None: the job published no demand here (not known)
    held: int  # slots its claims hold on the probed hosts: GPUs and CPU slots
    wanted: int | None
    usage_gpu_h: float | None
    share: int | None
    hosts: tuple[tuple[str, int], ...]  # (host, slots held there)
    published: bool  # a fresh demand entry was seen
    held_cpu: int = 0  # of `held`, the CPU slots (hosts without GPUs)

    @property
    def held_gpus(self) -> int:
        return self.held - self.held_cpu


@dataclass(frozen=True)
class LabView:
    jobs: tuple[LabJob, ...]
    pool: int  # slots held by eltctl jobs plus free GPUs on the probed hosts
    free: int  # free GPUs
    hosts: tuple[str, ...]  # the hosts that answered with GPUs or CPU slots
    unreachable: tuple[str, ...]
    refused: tuple[tuple[str, object], ...] = ()  # (host, claims.Refusal): entries of its claims directory not believed


def lab_view(reports: Iterable[HostReport], half_life_s: float) -> LabView:
    reports = list(reports)
    held: dict[str, dict[str, int]] = {}  # job -> host -> slots its claims hold there
    cpu: dict[str, int] = {}  # job -> the CPU slots among them
    users: dict[str, set[str]] = {}  # job -> the accounts seen holding its claims
    free = 0
    seen: list[Demand] = []
    answered, lost = [], []
    refused: list = []
    for r in reports:
        if not r.reachable:
            lost.append(r.name)
            continue
        if r.state in (HostState.OK, HostState.CPU_ONLY):
            answered.append(r.name)
            free += sum(1 for g in r.gpus if g.state is GpuUse.FREE)
        for name, claim in r.claims:
            kind = slot_claim(name, r.name)
            if kind is None or not claim.job:
                continue
            per = held.setdefault(claim.job, {})
            per[r.name] = per.get(r.name, 0) + 1
            if kind == "cpu":
                cpu[claim.job] = cpu.get(claim.job, 0) + 1
            if claim.user:
                users.setdefault(claim.job, set()).add(claim.user)
        seen.extend(r.demands)
        refused.extend((r.name, x) for x in getattr(r, "refused", ()))
    # A job is known by its name, as its claims are (its account may differ between hosts).
    demands = {d.job: d for d in fairshare.merge(seen)}
    names = sorted(set(demands) | set(held))
    counts = {j: sum(held.get(j, {}).values()) for j in names}
    user = {j: demands[j].user if j in demands else ", ".join(sorted(users.get(j, ()))) for j in names}
    pool = sum(counts.values()) + free
    gpus = {j: counts[j] - cpu.get(j, 0) for j in names}  # fair share counts GPUs only
    table_in = [Demand(**{**demands[j].__dict__, "held": gpus[j]}) if j in demands
                else Demand(job=j, user=user[j], held=gpus[j]) for j in names]
    table_in = [d for d in table_in if d.held or d.wanted]
    shares = {s.job: s.share for s in fairshare.shares(table_in, sum(gpus.values()) + free, half_life_s)}
    jobs = []
    for j in sorted(names, key=lambda j: (user[j], j)):
        d = demands.get(j)
        jobs.append(LabJob(job=j, user=user[j], priority=d.priority if d else None, held=counts[j],
                           wanted=d.wanted if d else None, usage_gpu_h=d.usage_gpu_h if d else None,
                           share=shares.get(j), hosts=tuple(sorted(held.get(j, {}).items())), published=d is not None,
                           held_cpu=cpu.get(j, 0)))
    return LabView(jobs=tuple(jobs), pool=pool, free=free, hosts=tuple(answered), unreachable=tuple(lost),
                   refused=tuple(refused))


def slot_claim(file: str, host: str) -> str | None:
    """`gpu` or `cpu` when the claim file `file`, read on `host`, is one of that host's
    slots; None otherwise. A CPU slot's claim names its inventory host (`cpu0.HOST`): hosts
    of one machine share the claims directory, so each counts only its own."""
    parsed = parse_slot_file(file)
    if parsed is None:
        return None
    kind, _, of = parsed
    return kind if kind == "gpu" or of in ("", host) else None


def view_to_json(v: LabView) -> dict:
    return {
        "pool": v.pool, "free": v.free, "hosts": list(v.hosts), "unreachable": list(v.unreachable),
        "jobs": [{"job": j.job, "user": j.user, "priority": j.priority, "held": j.held, "held_gpus": j.held_gpus,
                  "held_cpu_slots": j.held_cpu, "wanted": j.wanted,
                  "usage_gpu_h": None if j.usage_gpu_h is None else round(j.usage_gpu_h, 3), "share": j.share,
                  "hosts": {h: n for h, n in j.hosts}, "published": j.published} for j in v.jobs],
        "refused": [{"host": h, **r.to_dict()} for h, r in v.refused],
    }


JSON_FORMAT = """\
`eltctl lab --json` prints one object:

| key | type | meaning |
|---|---|---|
| `pool` | int | the slots eltctl jobs hold on the probed hosts (GPUs, CPU slots) and the free GPUs; fair share divides its GPUs |
| `free` | int | free GPUs on the probed hosts |
| `hosts` | [string] | the hosts that answered (with GPUs, or CPU slots on a host without GPUs) |
| `unreachable` | [string] | the hosts that did not answer |
| `jobs` | [object] | one per eltctl job seen (its GPU claims or its demand entry), by user then job |
| `refused` | [object] | entries of the hosts' claims directories that were not believed (a file whose owner is not the account it names, a name outside the strict set, a time in the future, a lock without a live process of its account): `host`, `file`, `owner` (the file owner's account), `reason` |

Each job: `job`, `user` (the host account), `priority` (int, null when it published no
demand), `held` (slots its claims hold on these hosts: `held_gpus` GPUs plus
`held_cpu_slots` CPU slots), `wanted` (how many more it could
use, null when unknown), `usage_gpu_h` (its recent usage: GPU-hours decayed with its
`usage_half_life`, null when unknown), `share` (its fair share of the GPUs in `pool`, by
docs/fairshare.md's rule, which counts no CPU slot; null for a job that holds and wants
no GPU), `hosts` ({host: slots held there}), `published` (a fresh demand
entry was seen: a running controller; false for a job seen only by its claims).
"""

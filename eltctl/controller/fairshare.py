"""Fair share between eltctl jobs sharing hosts, without a central server. Pure.

Every job's controller publishes its demand beside the GPU claims of each host it
probes (eltctl/demand.py) and reads everyone's back; each then computes the same
table from the same entries (`shares`) and decides only about itself (`plan`): how
many GPUs to release, on which hosts, and how many it may hold at most while another
job waits. The rule (docs/fairshare.md has it for users):

1. The pool `G`: the GPUs of this job's hosts that are free or held by eltctl jobs (a
   GPU in hand-over counts once, whether it shows free or as the job's that asked for
   it), at least the GPUs every job seen holds.
2. Priorities, highest first: the jobs of one priority share what the higher ones left
   (each job at most its demand `held + wanted`); a lower priority gets the rest.
3. Within one priority, users share by weighted max-min fairness (water-filling: no
   user gets more than it asks, what it leaves goes to the others in proportion to
   their weights) with the weight

       w(user) = 1 / (1 + usage(user) / (G * half_life_h))

   where usage(user) is the sum of the user's jobs' recent usage (GPU-hours decayed by
   half every `usage_half_life`) and half_life_h the half-life in hours: a user who
   kept the whole pool busy for about a half-life weighs about 0.6, a new user 1.
4. A user's share is split equally among its jobs (water-filling again).
5. Whole GPUs: each job's share is rounded down, and the GPUs left over go, one each,
   to the largest remainders (ties: the job holding more, then by user and job name),
   so every controller rounds alike.

Fair share shares GPUs only. A CPU slot (a worker slot of a host without GPUs) is
cheap, is declared per host entry by each job's own inventory (`slots`), and is no pool
every job sees alike; the usage that weighs users is GPU-hours (the ledger's GPU
intervals). So a CPU slot counts nowhere here: not in `held` (`own_demand`, `holds`),
not in `wanted`, the free GPUs or the pool, and the cap `plan` returns is on GPUs
(policy.decide applies it to GPU slots alone); CPU slots are used first come, first
served. (Issue 50: `held` counted CPU slots while the rest counted GPUs, so two jobs on
CPU hosts each wanted 0 more, the pool was what they held, and each was capped at it:
the CPU slots a `scale --add` brought sat unused.) An entry that holds and wants no GPU
(a CPU-only job, a job that finished or stopped: `withdrawn`) takes no part.

`plan` then applies hysteresis: a job releases only when it holds more than
`share + fairshare_slack` and another job waits (holds less than its share and wants
more); it releases down to its share, never below its `min_workers`, never a GPU
it took less than `fairshare_hold` ago, preferring hosts where a waiting job wants
GPUs; while another job wants more and is not above its share, it takes no new GPU
beyond its own share (it does not grab back what it released).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from eltctl.demand import Demand, from_daemon_state


@dataclass(frozen=True)
class Share:
    """One job's line of the table."""

    user: str
    job: str
    priority: int
    held: int
    wanted: int
    usage_gpu_h: float
    min_workers: int
    share: int
    exact: float  # before rounding

    @property
    def waiting(self) -> bool:
        return self.held < self.share and self.wanted > 0


@dataclass(frozen=True)
class Plan:
    """What this job does about fair share now."""

    shares: tuple[Share, ...] = ()
    pool: int = 0
    share: int | None = None  # this job's share (None: no other job seen)
    release: Mapping[str, int] = field(default_factory=dict)  # host -> GPUs to release there
    cap: int | None = None  # the most GPUs to hold while a job waits (None: no cap)
    to: str = ""  # the waiting job the GPUs go to ("user/job")
    reason: str = ""  # one line for status and events

    @property
    def releasing(self) -> int:
        return sum(self.release.values())


def merge(entries: Iterable[Demand]) -> list[Demand]:
    """One entry per job: the newest of those seen on the hosts. A job is known by its
    name, as its GPU claims are (its account may differ from host to host). What makes
    that safe (issue 49) is upstream: an entry reaches here only when its file's owner
    is the account it names (runtime/claims.py `judge`), and never with a time in the
    future (which would make it the newest for ever); another account can publish under
    a job's name only as itself, and a job's own controller ignores every entry of its
    name (`plan`, `others_seen`)."""
    out: dict[str, Demand] = {}
    for d in entries:
        if d.job not in out or d.time > out[d.job].time:
            out[d.job] = d
    return sorted(out.values(), key=lambda d: d.key)


def weight(usage_gpu_h: float, pool: int, half_life_s: float) -> float:
    """A user's weight from its recent usage (rule 3)."""
    scale = max(pool, 1) * half_life_s / 3600.0
    return 1.0 / (1.0 + max(usage_gpu_h, 0.0) / scale) if scale > 0 else 1.0


def water_fill(capacity: float, items: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """Weighted max-min fair split of `capacity`: items {name: (weight, cap)} -> amount."""
    out = {k: 0.0 for k in items}
    left = {k: v for k, v in items.items() if v[1] > 0 and v[0] > 0}
    cap_left = max(capacity, 0.0)
    while left and cap_left > 1e-9:
        total_w = sum(w for w, _ in left.values())
        level = cap_left / total_w
        full = {k for k, (w, c) in left.items() if w * level >= c - 1e-9}
        if not full:
            for k, (w, _) in left.items():
                out[k] = w * level
            break
        for k in full:
            out[k] = left[k][1]
            cap_left -= left[k][1]
            del left[k]
    return out


def shares(demands: Iterable[Demand], pool: int, half_life_s: float) -> list[Share]:
    """Every job's fair share of `pool` GPUs (rules 2 to 5)."""
    jobs = merge(demands)
    exact: dict[tuple[str, str], float] = {}
    left = float(pool)
    for prio in sorted({d.priority for d in jobs}, reverse=True):
        level = [d for d in jobs if d.priority == prio]
        users = sorted({d.user for d in level})
        usage = {u: sum(d.usage_gpu_h for d in level if d.user == u) for u in users}
        asks = {u: float(sum(d.held + d.wanted for d in level if d.user == u)) for u in users}
        per_user = water_fill(left, {u: (weight(usage[u], pool, half_life_s), asks[u]) for u in users})
        for u in users:
            mine = [d for d in level if d.user == u]
            split = water_fill(per_user[u], {d.job: (1.0, float(d.held + d.wanted)) for d in mine})
            for d in mine:
                exact[d.key] = split[d.job]
        left -= sum(per_user.values())
    whole = {k: math.floor(v + 1e-9) for k, v in exact.items()}
    spare = min(pool, round(sum(exact.values()))) - sum(whole.values())
    by_key = {d.key: d for d in jobs}
    order = sorted(exact, key=lambda k: (-(exact[k] - whole[k]), -by_key[k].held, k))
    for k in order:
        if spare <= 0:
            break
        if exact[k] - whole[k] > 1e-9:
            whole[k] += 1
            spare -= 1
    return [Share(user=d.user, job=d.job, priority=d.priority, held=d.held, wanted=d.wanted,
                  usage_gpu_h=d.usage_gpu_h, min_workers=d.min_workers, share=whole[d.key], exact=exact[d.key])
            for d in jobs]


@dataclass(frozen=True)
class HostHold:
    """This job on one host: the GPUs it holds there and when each was taken (host clock
    ages, seconds), and whether another job waiting wants a GPU there."""

    name: str
    held: int
    ages: tuple[float, ...] = ()  # seconds since each held GPU was taken (unknown: not listed)
    others_want: tuple[str, ...] = ()  # "user/job" of the other jobs that want a GPU here


def plan(me: Demand, others: Iterable[Demand], hosts: Iterable[HostHold], *, free: int,
         half_life_s: float, slack: int, hold_s: float, seen: int = 0, settling: bool = False) -> Plan:
    """What this job (`me`, its own figures) does about the other jobs seen on its hosts
    (`others`: their entries) now. `free`: GPUs free on this job's hosts; `hosts`: where it
    holds GPUs; `seen`: the GPUs of its hosts that eltctl jobs may use (free, its own,
    another job's), which also counts GPUs in hand-over (released, not yet claimed);
    `settling`: this job released GPUs a moment ago (`settle_s`): nothing more is released
    until the waiting job has had time to claim them (the pool looks smaller meanwhile)."""
    # A job that holds and wants no GPU (CPU slots only, finished, stopped) shares nothing.
    others = [d for d in merge(others) if d.job != me.job and (d.held > 0 or d.wanted > 0)]
    if not others:
        return Plan()
    # The GPUs of this job's hosts that jobs may use, when known: a GPU another job asked
    # for but has not claimed yet shows as free and is in its `held` (never count it twice).
    held_all = me.held + sum(d.held for d in others)
    pool = max(seen, held_all) if seen > 0 else held_all + max(free, 0)
    table = shares([me, *others], pool, half_life_s)
    mine = next(s for s in table if s.job == me.job)
    waiting = [s for s in table if s.waiting and s.job != me.job]
    # Only the GPUs nobody holds are there to take: a GPU another job asked for shows free
    # until its daemon claims it, and is no one else's to grab meanwhile.
    unheld = me.held + max(0, pool - held_all)
    base = Plan(shares=tuple(table), pool=pool, share=mine.share, cap=unheld)
    if not waiting:
        # Another job wants more and is not above its share (it may be about to claim the
        # GPUs it is owed): take nothing beyond this job's share either.
        if any(s.job != me.job and s.wanted > 0 and s.held <= s.share for s in table):
            return Plan(shares=base.shares, pool=pool, share=mine.share, cap=min(max(mine.share, me.held), unheld))
        return base
    to = f"{waiting[0].user}/{waiting[0].job}"
    deficit = sum(s.share - s.held for s in waiting)
    cap = max(mine.share, me.held)
    excess = me.held - mine.share
    extra = 0 if settling else priority_extra(me, table, free)
    if (excess <= slack or excess <= 0) and not extra:
        return Plan(shares=base.shares, pool=pool, share=mine.share, cap=cap, to=to,
                    reason=f"job {waiting[0].job} waits: holding {me.held}, fair share {mine.share} of {pool}")
    usual = max(0, min(excess, max(deficit - max(free, 0), 0), me.held - me.min_workers))
    want = 0 if settling else min(usual + extra, me.held)
    names = {f"{s.user}/{s.job}" for s in waiting}
    # `fairshare_hold` keeps equals from trading GPUs back and forth; a job of higher
    # priority waiting is served at once (there is no ping-pong: it always wins).
    if any(s.priority > me.priority for s in waiting):
        hold_s = 0.0
    release: dict[str, int] = {}
    # Hosts where a waiting job wants GPUs first; then the others, in reverse order.
    ordered = sorted(list(hosts)[::-1], key=lambda h: not (set(h.others_want) & names))
    for h in ordered:
        if want <= 0:
            break
        old_enough = sum(1 for a in h.ages if a >= hold_s) + max(h.held - len(h.ages), 0) * (hold_s <= 0)
        n = min(want, h.held, old_enough)
        if n > 0:
            release[h.name] = n
            want -= n
    n = sum(release.values())
    if n:
        where = ", ".join(f"{c} on {h}" for h, c in release.items())
        reason = (f"released {n} GPU{'s' if n != 1 else ''} ({where}) to job {waiting[0].job} "
                  f"(fair share {mine.share} of {pool})")
    else:
        why = "GPUs released a moment ago are being claimed" if settling else "fairshare_hold, or min_workers"
        reason = (f"holding {me.held}, fair share {mine.share} of {pool}: job {waiting[0].job} waits; "
                  f"nothing released now ({why})")
    return Plan(shares=base.shares, pool=pool, share=mine.share, release=release,
                cap=cap - n, to=to, reason=reason)




def priority_extra(me: Demand, table: Iterable[Share], free: int) -> int:
    """GPUs this job gives beyond its usual release (down to its share, never below its
    `min_workers`) because a job of higher priority waits below its own `min_workers`
    and the lower jobs' usual releases and the free GPUs cannot make up the lack: the
    lower jobs then give GPUs below their `min_workers` too, the lowest priority first
    (then the job holding more, then by user and job), every controller computing the
    same split. 0 in every other case."""
    table = list(table)
    top = [s for s in table if s.priority > me.priority and s.held < s.min_workers and s.job != me.job]
    if not top:
        return 0
    lack = sum(min(s.min_workers, s.held + s.wanted) - s.held for s in top) - max(free, 0)
    lower = [s for s in table if s.priority < max(t.priority for t in top)]
    usual = {s.job: max(0, min(s.held - s.share, s.held - s.min_workers)) for s in lower}
    short = lack - sum(usual.values())
    for s in sorted(lower, key=lambda s: (s.priority, -s.held, s.user, s.job)):
        if short <= 0:
            break
        give = min(short, s.held - usual[s.job])
        if s.job == me.job:
            return give
        short -= give
    return 0


# --------------------------------------------------------------------------- this job's side

def settle_s(idle_for: float, probe_interval: float) -> float:
    """How long after a release this job releases nothing more: the waiting job needs a
    probe to see the GPUs free and `idle_for` before it claims them."""
    return idle_for + 3 * probe_interval + 10.0


def cpu_only(reports: Mapping[str, object], cpu_hosts: Iterable[str] = ()) -> set[str]:
    """The hosts whose slots are CPU slots: `cpu_hosts` (the controller's views: policy.cpu_host)
    and those the probe found without GPUs."""
    from eltctl.probe import HostState

    return set(cpu_hosts) | {n for n, r in reports.items() if getattr(r, "state", None) is HostState.CPU_ONLY}


def own_demand(*, job: str, user: str, priority: int, min_workers: int, max_workers: int | None,
               desired: Mapping[str, Iterable[int]], reports: Mapping[str, object], usable: Iterable[str],
               usage_gpu_h: float, every: float, cpu_hosts: Iterable[str] = ()) -> tuple[Demand, dict[str, Demand]]:
    """This job's demand (job-wide) and the entry it publishes on each host (`held_here`,
    `wants_here` filled in). `reports`: the probe's HostReports by host name; `usable`: the
    hosts the job may use now (not removed, cordoned, off-hours...). `held`: its desired
    slots on GPU hosts (`cpu_hosts` and the hosts probed CPU-only hold CPU slots, which fair
    share does not count); `wanted`: GPUs on the usable hosts that are free or another
    job's, not more than `max_workers` allows."""
    from eltctl.probe import GpuUse, HostState

    usable = set(usable)
    cpu = cpu_only(reports, cpu_hosts)
    held_by = {h: len(tuple(s)) for h, s in desired.items() if h not in cpu}
    held = sum(held_by.values())
    could: dict[str, int] = {}
    for name, r in reports.items():
        if name not in usable or getattr(r, "state", None) is not HostState.OK:
            continue
        mine = set(desired.get(name, ()))
        could[name] = sum(1 for g in r.gpus if g.gpu.index not in mine and g.state in (GpuUse.FREE, GpuUse.TAKEN))
    wanted = sum(could.values())
    if max_workers is not None:
        wanted = max(0, min(wanted, max_workers - held))
    me = Demand(job=job, user=user, priority=priority, held=held, wanted=wanted, usage_gpu_h=round(usage_gpu_h, 4),
                min_workers=min_workers, every=every)
    per_host = {name: Demand(**{**me.__dict__, "held_here": held_by.get(name, 0),
                                "wants_here": wanted > 0 and could.get(name, 0) > 0})
                for name in reports}
    return me, per_host


# A starting job's want before it has seen its hosts and has no max_workers: "all it can get".
UNSEEN_WANT = 1024


def first_demand(*, job: str, user: str, priority: int, min_workers: int, max_workers: int | None,
                 desired: Mapping[str, Iterable[int]], hosts: Iterable[str], usage_gpu_h: float,
                 every: float) -> dict[str, Demand]:
    """What a controller publishes in its first probe, before it has seen its hosts: it
    holds what its memory says (`desired`); a job holding nothing yet wants up to
    `max_workers`, without one as many as it can get (`UNSEEN_WANT`: the pool caps it, as
    it caps a measured demand, which counts every GPU free or another job's), on every
    host. A job that just started is then known to the jobs sharing its hosts a probe
    sooner; its next probe publishes the measured demand (`own_demand`). A job holding
    GPUs already (a controller restarted beside its workers) wants nothing more until
    its probe measured it."""
    held_by = {h: len(tuple(s)) for h, s in desired.items()}
    held = sum(held_by.values())
    wanted = max(min_workers, max_workers if max_workers is not None else UNSEEN_WANT) if held == 0 else 0
    me = Demand(job=job, user=user, priority=priority, held=held, wanted=wanted, usage_gpu_h=round(usage_gpu_h, 4),
                min_workers=min_workers, every=every)
    return {name: Demand(**{**me.__dict__, "held_here": held_by.get(name, 0), "wants_here": wanted > 0})
            for name in hosts}


def holds(desired: Mapping[str, Iterable[int]], reports: Mapping[str, object], job: str,
          cpu_hosts: Iterable[str] = ()) -> list[HostHold]:
    """Where this job holds GPUs (not its CPU slots: `cpu_only`), with each one's age (its
    claim's `since` against the host's clock) and the other jobs that want a GPU there
    (their entries on that host)."""
    out = []
    cpu = cpu_only(reports, cpu_hosts)
    for name, slots in desired.items():
        slots = tuple(slots)
        if not slots or name in cpu:
            continue
        r = reports.get(name)
        ages: list[float] = []
        others: tuple[str, ...] = ()
        if r is not None:
            now = getattr(r, "host_time", None)
            for file, claim in getattr(r, "claims", ()):
                if claim.job == job and file.startswith("gpu") and claim.slot in slots and claim.since is not None \
                        and now is not None:
                    ages.append(max(0.0, now - claim.since))
            others = tuple(f"{d.user}/{d.job}" for d in getattr(r, "demands", ()) if d.job != job and d.wants_here)
        out.append(HostHold(name=name, held=len(slots), ages=tuple(sorted(ages, reverse=True)), others_want=others))
    return out


def withdrawn(me: Demand, hosts: Iterable[str]) -> dict[str, Demand]:
    """The entries a job that finished or stopped publishes on its hosts: held 0, wanted 0
    (`me`: its last demand, for its name, account and settings). Its last entry would
    otherwise say it holds its GPUs until the entry is stale (`stale_after`: a minute or
    more), to the jobs sharing its hosts and to `eltctl lab` (issue 50)."""
    from dataclasses import replace

    gone = replace(me, held=0, wanted=0, held_here=0, wants_here=False)
    return {name: gone for name in hosts}


def with_daemon_demands(reports: Mapping[str, object], states: Mapping[str, object]) -> dict[str, object]:
    """The probe's reports with the demand entries this job's daemons passed on since
    (their state documents' `demands`, eltctl/demand.py `from_daemon_state`): per job,
    the newest entry of the two wins. A daemon reads its host's entries every watch
    interval, so another job's new or raised demand counts within a second or two of
    its publication instead of at this job's next probe."""
    from dataclasses import replace

    out = dict(reports)
    for name, r in reports.items():
        seen = from_daemon_state(states.get(name), getattr(r, "host_time", None))
        if not seen:
            continue
        newest = {d.job: d for d in getattr(r, "demands", ())}
        changed = False
        for d in seen:
            if d.job not in newest or d.time > newest[d.job].time:
                newest[d.job] = d
                changed = True
        if changed:
            out[name] = replace(r, demands=tuple(sorted(newest.values(), key=lambda d: d.key)))
    return out


def others_seen(reports: Mapping[str, object], job: str) -> list[Demand]:
    """The other jobs' entries on this job's hosts (newest of each; a job is known by its
    name, as its GPU claims are)."""
    return [d for d in merge(d for r in reports.values() for d in getattr(r, "demands", ())) if d.job != job]


def own_user(reports: Mapping[str, object], job: str, default: str) -> str:
    """The host account this job's entries were written under (else `default`). `default`
    (this controller's account) wins when an entry of it is seen: another account may
    publish an entry with this job's name under its own account (issue 49)."""
    users = [d.user for r in reports.values() for d in getattr(r, "demands", ()) if d.job == job and d.user]
    return default if default in users or not users else users[0]


def free_gpus(reports: Mapping[str, object], usable: Iterable[str], states: tuple = ()) -> int:
    """GPUs free on the usable hosts (`states`: count GPUs in these GpuUse states instead)."""
    from eltctl.probe import GpuUse, HostState

    usable = set(usable)
    states = states or (GpuUse.FREE,)
    return sum(1 for name, r in reports.items() if name in usable and getattr(r, "state", None) is HostState.OK
               for g in r.gpus if g.state in states)


def shared_gpus(reports: Mapping[str, object], usable: Iterable[str]) -> int:
    """The GPUs of the usable hosts that eltctl jobs may use: free, this job's, another job's."""
    from eltctl.probe import GpuUse

    return free_gpus(reports, usable, (GpuUse.FREE, GpuUse.OURS, GpuUse.TAKEN))


def share_to_json(s: Share) -> dict:
    return {"user": s.user, "job": s.job, "priority": s.priority, "held": s.held, "wanted": s.wanted,
            "usage_gpu_h": round(s.usage_gpu_h, 3), "min_workers": s.min_workers, "share": s.share,
            "exact": round(s.exact, 3), "waiting": s.waiting}


def plan_to_json(p: Plan, me: Demand | None = None) -> dict:
    """status.json's `fairshare`: this job's share (None: no other job seen), what it
    releases and why, and the table; with `me` (this job's published demand) its own
    figures too: `user`, `priority`, `held`, `wanted`, `usage_gpu_h`, `min_workers`."""
    doc = {"share": p.share, "pool": p.pool, "cap": p.cap, "release": dict(p.release), "to": p.to,
           "reason": p.reason, "jobs": [share_to_json(s) for s in p.shares]}
    if me is not None:
        doc.update(user=me.user, priority=me.priority, held=me.held, wanted=me.wanted,
                   usage_gpu_h=round(me.usage_gpu_h, 3), min_workers=me.min_workers)
    return doc


__all__ = ["HostHold", "Plan", "Share", "cpu_only", "free_gpus", "holds", "merge", "others_seen", "own_demand",
           "own_user", "plan", "plan_to_json", "priority_extra", "share_to_json", "shared_gpus", "shares",
           "water_fill", "weight", "withdrawn"]

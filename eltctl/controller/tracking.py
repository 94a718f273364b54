"""Tracking: folding each observation into what is remembered of a host (`track`: free
clocks, an owner's yield, crashes, a host lost while used; `track_stragglers`: rank 0's
per-worker figures), a failure counted and the back-off of benching (`record_failure`,
`bench_duration`), and how a failure reads to a person (`crash_problem`, `next_step`).
Pure functions of records, views and a clock; the rules are in policy.py's module
docstring.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

from eltctl.controller.values import Crash, HostRecord, HostView, Reach
from eltctl.inventory import Inventory
from eltctl.probe import GpuUse

BENCH_BASE_S = 30.0
BENCH_MAX_S = 24 * 3600.0


def bench_duration(cooldown: float, bench_count: int) -> float:
    """Exponential back-off: the n-th benching (from 0) lasts base * 2**n, capped."""
    return min(BENCH_MAX_S, max(cooldown, BENCH_BASE_S) * (2 ** bench_count))


def record_failure(record: HostRecord, inventory: Inventory, now: float, problem: str) -> HostRecord:
    """One more failure in a row; benches the host when there are `bench_after` of them."""
    policy = inventory.policy
    failures = record.failures + 1
    record = replace(record, failures=failures, ok_since=None, last_problem=problem,
                     cooldown_until=max(record.cooldown_until, now + policy.cooldown))
    if failures >= policy.bench_after:
        until = now + bench_duration(policy.cooldown, record.bench_count)
        record = replace(record, failures=0, bench_count=record.bench_count + 1, benched_until=until,
                         last_problem=f"benched after {failures} failures in a row; last: {problem}")
    return record


def track(records: Mapping[str, HostRecord], views: Mapping[str, HostView], inventory: Inventory,
          now: float) -> dict[str, HostRecord]:
    """Fold one observation into the records (free clocks, yields, crashes, lost hosts)."""
    policy = inventory.policy
    out: dict[str, HostRecord] = {}
    for host in inventory.hosts:
        rec = records.get(host.name, HostRecord())
        view = views.get(host.name)
        if view is None or view.reach is Reach.UNKNOWN:
            out[host.name] = rec
            continue
        # Free clocks: a slot that looks free or ours keeps its clock, and so does one
        # another eltctl job holds (taken: no owner's use; it is never eligible while
        # taken); busy (an owner) resets it. An unreachable or unhealthy host tells us
        # nothing about its GPUs: the clocks restart when it is seen again.
        since = dict(rec.free_since)
        if view.reach in (Reach.OK, Reach.CPU_ONLY):
            since = {s.index: since.get(s.index, now) for s in view.slots if s.use is not GpuUse.BUSY}
        elif view.reach is Reach.UNREACHABLE:
            since = {}
        rec = replace(rec, free_since=tuple(sorted(since.items())))

        # A yield reported for an older request is history: the slot was asked for again.
        yielded = [s for s in view.yielded if s in rec.desired] if view.seq_applied >= rec.seq else []
        if view.reach is Reach.OK and not view.watched and not rec.force:
            # No daemon watching: the probe's view of an owner on a GPU we use is the yield.
            yielded += [s.index for s in view.slots
                        if s.use is GpuUse.BUSY and s.index in rec.desired and s.index not in yielded]
        gone = yielded + [s for s in view.crashed if s in rec.desired]
        if yielded:
            slots = ", ".join(map(str, yielded))
            rec = replace(rec, owner_until=max(rec.owner_until, now + policy.cooldown),
                          owner_note=f"its owner took GPU {slots}")
        crashed = [s for s in view.crashed if s in rec.desired]
        if crashed:
            problem, at_start = crash_problem(crashed, view.crash_info)
            rec = record_failure(rec, inventory, now, problem)
            rec = replace(rec, start_failure=problem if at_start else "")
        if view.in_job and rec.start_failure:
            rec = replace(rec, start_failure="")
        if view.reach is Reach.UNREACHABLE and rec.desired:
            rec = record_failure(rec, inventory, now, f"host became unreachable while used: {view.reason}")
            gone = list(rec.desired)
        # Another eltctl job holds it (first come, first served): dropped, no failure, no cooldown.
        gone += [s for s in view.taken if s in rec.desired and s not in view.workers and s not in gone
                 and view.seq_applied >= rec.seq]
        if gone:
            rec = replace(rec, desired=tuple(s for s in rec.desired if s not in gone))

        # Clean running resets the failure count after a bench-length period.
        healthy = bool(rec.desired) and view.daemon_alive and set(rec.desired) <= set(view.workers)
        if healthy:
            ok_since = rec.ok_since if rec.ok_since is not None else now
            rec = replace(rec, ok_since=ok_since)
            if rec.failures and now - ok_since >= bench_duration(policy.cooldown, 0):
                rec = replace(rec, failures=0)
        elif not rec.desired:
            rec = replace(rec, ok_since=None)
        out[host.name] = rec
    return out


def worker_slot(worker: str) -> tuple[str, int] | None:
    """(host, slot) of a daemon's worker id `<host>/<slot>/<incarnation>` (None: another form)."""
    parts = str(worker).split("/")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def track_stragglers(records: Mapping[str, HostRecord], runtime_status: Mapping | None, inventory: Inventory,
                     now: float) -> dict[str, HostRecord]:
    """Fold rank 0's per-worker figures (`workers` in its status) into the records:
    when a worker has held the job back (the job predicted at least
    straggler_gain_percent faster without it) since straggler_since, and for
    straggler_for, its slot is dropped and its host rests for `cooldown`. Never
    below min_workers running; a host none of whose workers holds the job back
    forgets its clock. See the module docstring."""
    policy, cooldown = inventory.stragglers, inventory.policy.cooldown
    rs = runtime_status or {}
    per = rs.get("workers") if isinstance(rs.get("workers"), dict) else {}
    members = [str(m) for m in rs.get("members") or []]
    if not per or not members:
        return dict(records)  # nothing measured (or no status): the clocks stand
    holding: dict[str, tuple[int, str]] = {}  # host -> (slot, why)
    for w in members:
        entry = per.get(w)
        where = worker_slot(w)
        if not isinstance(entry, dict) or where is None:
            continue
        gain = entry.get("speedup_without")
        if isinstance(gain, (int, float)) and gain >= 1.0 + policy.straggler_gain_percent / 100.0:
            speed = entry.get("samples_per_s")
            holding.setdefault(where[0], (where[1], f"dropped worker {w} as a straggler: the job was predicted "
                                                    f"{gain:.2f}x as fast without it ({speed} samples/s)"))
    out = dict(records)
    running = len(members)
    for host in inventory.hosts:
        rec = out.get(host.name, HostRecord())
        if host.name not in holding or not policy.drop_stragglers:
            if rec.straggler_since is not None:
                out[host.name] = replace(rec, straggler_since=None)
            continue
        slot, why = holding[host.name]
        since = rec.straggler_since if rec.straggler_since is not None else now
        rec = replace(rec, straggler_since=since)
        if now - since >= policy.straggler_for and running > inventory.job.min_workers and slot in rec.desired:
            rec = replace(rec, desired=tuple(s for s in rec.desired if s != slot), straggler_since=None,
                          straggler_until=now + cooldown, straggler_note=why)
            running -= 1
        out[host.name] = rec
    return out


def crash_problem(slots: list[int], info: Iterable[Crash]) -> tuple[str, bool]:
    """What a host's crashed slots say as its last problem, and whether every one of
    them failed at start: `worker on slot 0 failed at start: <cause>`, `worker on
    slot 1 crashed: <cause>`, or `worker on slot 0, 1 crashed` when the daemon gave no cause."""
    by_slot = {c.slot: c for c in info}
    known = [by_slot[s] for s in slots if s in by_slot]
    at_start = bool(known) and len(known) == len(slots) and all(c.at_start for c in known)
    what = "failed at start" if at_start else "crashed"
    cause = next((c.cause for c in known if c.cause), "")
    text = f"worker on slot {', '.join(map(str, slots))} {what}"
    return (f"{text}: {cause}" if cause else text), at_start


def next_step(host: str, problem: str) -> str:
    """What to run about a host's failure (`last_problem`), for the lines that show it:
    where its cause is seen, and that a fix is tried at once (`after_fix`)."""
    retry = "after a fix `eltctl up` retries at once"
    if problem.startswith("benched after") and "; last: " in problem:
        problem = problem.split("; last: ", 1)[1]
    if problem.startswith("worker on slot"):
        return f"`eltctl logs {host} --failed` shows its output; {retry}"
    if "unreachable" in problem:
        return "`eltctl doctor` checks the host; it is used again once it answers"
    return f"`eltctl logs {host}` shows the host's log; {retry}"

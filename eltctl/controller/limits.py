"""Limits: what caps a host's slots apart from its GPUs (`host_limits`, from the
inventory, a cordon, the clock and the quota figures; `fair_limits`, fair share's
releases) and why the job pauses when they leave too few (`pause_reason`).

A host that is disabled, cordoned, outside its working hours or over a quota gets
none (its workers leave in the planned way at a step boundary, no cooldown), and
`max_gpus_per_host` caps the rest. When the limits alone leave fewer than
`min_workers` slots, the job pauses (policy.decide: `Decision.paused`). Pure.
"""

from __future__ import annotations

from typing import Mapping

from eltctl.controller import hours as hrs
from eltctl.controller import quotas
from eltctl.controller.values import NO_LIMIT, HostPhase, HostRecord, Limit
from eltctl.inventory import Inventory
from eltctl.inventory.hours import for_host


def host_limits(inventory: Inventory, records: Mapping[str, HostRecord], now: float,
                use: quotas.QuotaUse | None = None) -> dict[str, Limit]:
    """Each host's `Limit` now: `enabled = false`, a cordon, its working hours (with
    `hours_margin`), a gpu-hours quota (`use`: the figures; None: not enforced), then
    `max_gpus_per_host`, in that order (the first that takes every slot is shown)."""
    out: dict[str, Limit] = {}
    total = inventory.schedule.gpu_hours_total
    for host in inventory.hosts:
        rec = records.get(host.name, HostRecord())
        if not host.schedule.enabled:
            out[host.name] = Limit(0, HostPhase.DISABLED, "enabled = false in the inventory: not probed, not used")
            continue
        if rec.cordoned:
            out[host.name] = Limit(0, HostPhase.CORDONED, "cordoned by `eltctl cordon`; `eltctl uncordon` "
                                                          "brings it back")
            continue
        sched = for_host(inventory.schedule, host.schedule)
        tz = hrs.zone(sched.timezone)
        if not sched.hours.always and not hrs.usable(sched.hours, tz, now, sched.hours_margin):
            again = hrs.usable_again(sched.hours, tz, now, sched.hours_margin)
            shown = hrs.show_time(again, tz, now) if again is not None else ""
            when = f"usable again at {shown}" if shown else "no window opens within a week"
            out[host.name] = Limit(0, HostPhase.OFF_HOURS,
                                   f"outside its working hours ({', '.join(sched.hours.text)}); {when}", again, shown)
            continue
        cap = quotas.host_cap(host.name, max_gpus=sched.max_gpus_per_host, per_day_h=sched.gpu_hours_per_day,
                              total_h=total, use=use, tz=tz, now=now)
        out[host.name] = (Limit(0, HostPhase.QUOTA, cap.reason, cap.until,
                                hrs.show_time(cap.until, tz, now) if cap.until is not None else "")
                          if cap.reached else Limit(cap.slots))
    return out


def fair_limits(limits: Mapping[str, Limit], records: Mapping[str, HostRecord], release: Mapping[str, int],
                reason: str) -> dict[str, Limit]:
    """The limits with fair share's releases (controller/fairshare.py `Plan.release`): a host
    that releases n GPUs is capped at n fewer than it runs, so they leave in the planned way
    (the last of its slots, at a step boundary, no cooldown). No phase: it is not a pause."""
    out = dict(limits)
    for name, n in release.items():
        held = len(records.get(name, HostRecord()).desired)
        cap = max(held - n, 0)
        old = out.get(name, NO_LIMIT)
        if old.cap is None or old.cap > cap:
            out[name] = Limit(cap, None, reason)
    return out


def pause_reason(limits: Mapping[str, Limit], inventory: Inventory) -> str:
    """Why the job pauses, and when it resumes by itself: "outside working hours,
    resumes at Sat 00:00 (h1)"."""
    held = [(h.name, limits[h.name]) for h in inventory.hosts if h.name in limits and limits[h.name].phase]
    phases = {lim.phase for _, lim in held}
    what = {HostPhase.OFF_HOURS: "outside working hours", HostPhase.QUOTA: "quota reached",
            HostPhase.CORDONED: "every host cordoned", HostPhase.DISABLED: "every host disabled"}
    text = what[next(iter(phases))] if len(phases) == 1 else "no host usable (" + ", ".join(
        f"{n}: {lim.phase}" for n, lim in held) + ")"
    timed = sorted((lim.until, n, lim.again) for n, lim in held if lim.until is not None)
    if not timed:
        return f"{text}; resumes when a host is usable again"
    _, name, when = timed[0]
    return f"{text}, resumes at {when} ({name})"

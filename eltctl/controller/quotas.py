"""Quotas: how many slots each host may run under the inventory's limits. Pure.

Three limits, each optional (eltctl/inventory/hours.py `Quotas`):

- `max_gpus_per_host`: at most N slots on a host (needs no figures);
- `gpu_hours_per_day` (per host, an owner's agreement): once the job has used that many
  GPU-hours on the host since the host's local midnight, it runs nothing there until
  the next midnight;
- `gpu_hours_total` (the job): once reached, nothing runs anywhere.

The GPU-hours come from an injected provider (`QuotaProvider`, fed by the usage
ledger): `QuotaUse` holds GPU-seconds per host since its local midnight and the job's
total. Without figures (`None`) the two hour limits are not enforced;
`max_gpus_per_host` always is. `slot_caps` gives each host's cap and, when a quota
holds it, the reason a person reads in `eltctl status` (phase `quota`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, tzinfo
from typing import Callable, Mapping, Optional


@dataclass(frozen=True)
class QuotaUse:
    """What the job has used: GPU-seconds per host since that host's local midnight
    (`today`), and in total (`total`). A CPU slot counts as a GPU."""

    today: Mapping[str, float] = field(default_factory=dict)
    total: float = 0.0


QuotaProvider = Callable[[float], Optional[QuotaUse]]  # now -> figures, or None: no figures yet


def no_figures(now: float) -> QuotaUse | None:
    """The provider until a ledger supplies figures: the hour quotas are not enforced."""
    return None


@dataclass(frozen=True)
class Cap:
    """A host's slot cap (None: no limit) and, when a quota holds it back, why."""

    slots: int | None = None
    reason: str = ""  # "" unless a gpu-hours quota is reached (the host is in phase `quota`)
    until: float | None = None  # when that quota lifts (the host's next local midnight); None: never

    @property
    def reached(self) -> bool:
        return bool(self.reason)


def next_midnight(t: float, tz: tzinfo) -> float:
    """The host's next local midnight after `t` (when its daily quota starts over)."""
    d = datetime.fromtimestamp(t, tz).date() + timedelta(days=1)
    return datetime(d.year, d.month, d.day, tzinfo=tz).timestamp()


def host_cap(name: str, *, max_gpus: int | None, per_day_h: float | None, total_h: float | None,
             use: QuotaUse | None, tz: tzinfo, now: float) -> Cap:
    """One host's cap: 0 when a gpu-hours quota is reached (with the reason), else
    `max_gpus` (None: no limit)."""
    if use is not None and total_h is not None and use.total >= total_h * 3600.0:
        return Cap(0, f"the job's quota of {total_h:g} GPU-hours is used up ({use.total / 3600.0:.2f} h)")
    if use is not None and per_day_h is not None:
        today = float(use.today.get(name, 0.0))
        if today >= per_day_h * 3600.0:
            until = next_midnight(now, tz)
            from eltctl.controller.hours import show_time

            return Cap(0, f"used {today / 3600.0:.2f} of its {per_day_h:g} GPU-hours today; usable again at "
                          f"{show_time(until, tz, now)}", until)
    return Cap(max_gpus)


def slot_caps(limits: Mapping[str, tuple[int | None, float | None, float | None, tzinfo]],
              use: QuotaUse | None, now: float) -> dict[str, Cap]:
    """Every host's cap from its (max_gpus_per_host, gpu_hours_per_day, gpu_hours_total, zone)."""
    return {name: host_cap(name, max_gpus=m, per_day_h=d, total_h=t, use=use, tz=tz, now=now)
            for name, (m, d, t, tz) in limits.items()}


__all__ = ["Cap", "QuotaProvider", "QuotaUse", "host_cap", "next_midnight", "no_figures", "slot_caps"]

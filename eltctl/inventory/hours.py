"""The inventory's working hours, quotas and `enabled` keys: their values and checks.

In `[policy]` (for every host) and, with the same names, in `[[hosts]]` (that host only):
`hours`, `timezone`, `hours_margin`, `gpu_hours_per_day`, `max_gpus_per_host`; in
`[policy]` only: `gpu_hours_total` (the job's); in `[[hosts]]` only: `enabled`.
`Schedule` holds [policy]'s, `HostSchedule` a host's overrides (None: [policy]'s);
`for_host` merges them. The windows' syntax and meaning: eltctl/controller/hours.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from eltctl.controller.hours import ALWAYS, HoursError, HoursSpec, parse_hours, valid_zone
from eltctl.inventory.tables import ABSENT, BAD, Table, got

SCHEDULE_KEYS = ("hours", "timezone", "hours_margin", "gpu_hours_per_day", "gpu_hours_total",
                 "max_gpus_per_host")
HOST_SCHEDULE_KEYS = ("enabled", "hours", "timezone", "hours_margin", "gpu_hours_per_day", "max_gpus_per_host")


@dataclass(frozen=True)
class Schedule:
    """When and how much the job may use a host ([policy]; a host's, once merged)."""

    hours: HoursSpec = ALWAYS  # the windows the host may be used in
    timezone: str | None = None  # IANA zone of the windows and of "today"; None: the controller's
    hours_margin: float = 0.0  # seconds before a window closes that the workers leave
    gpu_hours_per_day: float | None = None  # per host, since its local midnight; None: no limit
    gpu_hours_total: float | None = None  # the job's, over all hosts; None: no limit
    max_gpus_per_host: int | None = None  # None: every free GPU (or slot)


@dataclass(frozen=True)
class HostSchedule:
    """A [[hosts]] entry's own values; None: [policy]'s."""

    enabled: bool = True  # false: never probed, never used
    hours: HoursSpec | None = None
    timezone: str | None = None
    hours_margin: float | None = None
    gpu_hours_per_day: float | None = None
    max_gpus_per_host: int | None = None


def for_host(policy: Schedule, host: HostSchedule) -> Schedule:
    """The schedule that holds for one host: its own values over [policy]'s."""
    over = {k: getattr(host, k) for k in ("hours", "timezone", "hours_margin", "gpu_hours_per_day",
                                          "max_gpus_per_host") if getattr(host, k) is not None}
    return replace(policy, **over) if over else policy


def _hours(t: Table) -> Any:
    value = t.raw("hours")
    if value is ABSENT:
        return None
    fix = 'write hours = "always" or a list of windows such as ["Mon-Fri 19:00-08:00", "Sat-Sun"]'
    if isinstance(value, list) and all(isinstance(v, str) for v in value) or isinstance(value, str):
        try:
            return parse_hours(value)
        except HoursError as exc:
            return t.fail("hours", f"{exc}")
    return t.fail("hours", f"must be a string or a list of strings, {got(value)}; {fix}")


def _timezone(t: Table) -> Any:
    value = t.string("timezone")
    if isinstance(value, str) and not valid_zone(value):
        return t.fail("timezone", f"{value!r} is not a time zone this machine knows; write an IANA name such as "
                                  "\"Europe/Berlin\" (leave it out for this machine's zone)")
    return value


def _hours_amount(t: Table, key: str) -> Any:
    value = t.raw(key)
    if value is ABSENT:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return t.fail(key, f"must be a number of GPU-hours above 0, {got(value)}; write {key} = 8 "
                           "(or leave it out: no limit)")
    return float(value)


def read(t: Table, *, host: bool) -> dict[str, Any]:
    """The keys of one table ([policy] or a [[hosts]] entry), None where absent, BAD where wrong."""
    values: dict[str, Any] = {
        "hours": _hours(t),
        "timezone": _timezone(t),
        "hours_margin": t.duration("hours_margin", None, positive=False),
        "gpu_hours_per_day": _hours_amount(t, "gpu_hours_per_day"),
        "max_gpus_per_host": t.integer("max_gpus_per_host", None, lo=1,
                                       meaning=" (GPUs or CPU slots the job uses on one host)"),
    }
    if host:
        values["enabled"] = t.boolean("enabled", True)
    else:
        values["gpu_hours_total"] = _hours_amount(t, "gpu_hours_total")
    return values


def policy_schedule(t: Table) -> Schedule:
    d = Schedule()
    v = read(t, host=False)
    return Schedule(**{k: (getattr(d, k) if x is BAD or x is None else x) for k, x in v.items()})


def host_schedule(t: Table) -> HostSchedule:
    v = read(t, host=True)
    return HostSchedule(**{k: (None if x is BAD else x) for k, x in v.items() if k != "enabled"},
                        enabled=v["enabled"] is not False)


__all__ = ["HOST_SCHEDULE_KEYS", "SCHEDULE_KEYS", "HostSchedule", "Schedule", "for_host", "host_schedule",
           "policy_schedule"]

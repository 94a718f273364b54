"""The owner signals' keys ([policy] and per [[hosts]] entry): which signals beyond the
GPU say the machine's owner is using it, and their thresholds (eltctl_runtime.owner
documents the signals and the hysteresis; docs/inventory.md the keys).

    owner_signals = ["login", "keyboard", "load", "memory"]   # default []: none watched
    owner_idle_to_start = "15m"    # login/keyboard idleness before workers may start
    owner_active_within = "1m"     # input this recent: the owner is back, workers leave
    owner_start_load = 0.3         # CPUs of other processes' load below which workers may start
    owner_leave_load = 1.0         # CPUs above which, for owner_leave_load_for, workers leave
    owner_leave_load_for = "1m"
    owner_memory_mib = 4096        # MiB of other processes' resident memory above which workers leave

A [[hosts]] entry may set any of them; the rest come from [policy]
(`Inventory.owner_policy(host)`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from eltctl.inventory.tables import ABSENT, BAD, Table, got
from eltctl_runtime.owner import SIGNALS, OwnerPolicy

OWNER_KEYS = ("owner_signals", "owner_idle_to_start", "owner_active_within", "owner_start_load",
              "owner_leave_load", "owner_leave_load_for", "owner_memory_mib")


def _number(t: Table, key: str) -> Any:
    value = t.raw(key)
    if value is ABSENT:
        return ABSENT
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        fix = ""
        if isinstance(value, str):
            try:
                fix = f"; remove the quotes: {key} = {float(value):g}"
            except ValueError:
                pass
        return t.fail(key, f"must be a number of CPUs >= 0 (e.g. 0.3), {got(value)}{fix}")
    return float(value)


def owner_values(t: Table) -> tuple[tuple[str, Any], ...]:
    """The owner keys written in table `t`, checked, as (OwnerPolicy field, value) pairs."""
    values = {
        "signals": t.names("owner_signals", ABSENT, SIGNALS, noun="owner signal"),
        "idle_to_start": t.duration("owner_idle_to_start", ABSENT, positive=False),
        "active_within": t.duration("owner_active_within", ABSENT, positive=False),
        "start_load": _number(t, "owner_start_load"),
        "leave_load": _number(t, "owner_leave_load"),
        "leave_load_for": t.duration("owner_leave_load_for", ABSENT, positive=False),
        "memory_mib": t.integer("owner_memory_mib", ABSENT, lo=1, meaning=" (MiB)"),
    }
    return tuple((k, v) for k, v in values.items() if v is not ABSENT and v is not BAD)


def owner_policy(t: Table) -> OwnerPolicy:
    """[policy]'s owner keys over the defaults."""
    return replace(OwnerPolicy(), **dict(owner_values(t)))

"""Courtesy while running: how the job's workers share a host with its owner.

Four keys, in `[policy]` and per host in `[[hosts]]` (same names; a host's value wins):

    nice = 10                  # the workers' nice level, 0 (none) to 19 (the lowest priority)
    ionice = "best-effort"     # I/O class: "best-effort" (its lowest level, 7), "idle", or "none"
    cpu_threads = 4            # CPU threads per worker (OMP/MKL/OpenBLAS and torch); absent: no limit
    memory_limit = "16GiB"     # per worker; absent: no limit (see docs/inventory.md for CUDA workers)

The host daemon applies them when it starts a worker (runtime/daemon/courtesy.py);
the controller hands them over in daemon.json's "courtesy" object (`to_json`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from eltctl.inventory.tables import ABSENT, BAD, Table, got, show

KEYS = ("nice", "ionice", "cpu_threads", "memory_limit")
IONICE_CLASSES = ("best-effort", "idle", "none")
NICE_MAX = 19

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_UNIT_MIB = {"": 1.0, "B": 1 / 2**20, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2}


@dataclass(frozen=True)
class Courtesy:
    """The courtesy a host's workers run with (the defaults are [policy]'s)."""

    nice: int = 10
    ionice: str = "best-effort"
    cpu_threads: int | None = None  # None: no limit
    memory_limit_mib: int | None = None  # None: no limit

    def to_json(self) -> dict[str, Any]:
        """daemon.json's "courtesy" object (runtime/daemon/courtesy.py reads it)."""
        return {"nice": self.nice, "ionice": self.ionice, "cpu_threads": self.cpu_threads,
                "memory_limit_mib": self.memory_limit_mib}


# A host's overrides: (key, value) pairs of the keys its [[hosts]] entry sets.
Overrides = tuple[tuple[str, Any], ...]


def parse_size_mib(value: str) -> int:
    """'16GiB', '16G', '512MiB', '512M', '2T' -> MiB (binary units either way)."""
    m = _SIZE.fullmatch(value)
    if not m:
        raise ValueError
    unit = (m.group(2) or "").upper()
    mib = float(m.group(1)) * _UNIT_MIB["B" if unit == "B" else unit[:1]]
    if mib < 1:
        raise ValueError
    return int(mib)


def _values(t: Table) -> dict[str, Any]:
    """The courtesy keys `t` sets, checked (a bad one is reported and left out)."""
    out: dict[str, Any] = {}
    nice = t.integer("nice", ABSENT, lo=0, hi=NICE_MAX, meaning=" (0: as the daemon; 19: the lowest priority)")
    ionice = t.choice("ionice", ABSENT, IONICE_CLASSES, aliases={"best_effort": "best-effort", "be": "best-effort",
                                                                 "off": "none"})
    threads = t.integer("cpu_threads", ABSENT, lo=1, meaning=" (CPU threads per worker)")
    memory = _memory(t)
    for key, value in (("nice", nice), ("ionice", ionice), ("cpu_threads", threads),
                       ("memory_limit_mib", memory)):
        if value is not ABSENT and value is not BAD:
            out[key] = value
    return out


def _memory(t: Table) -> Any:
    value = t.raw("memory_limit")
    if value is ABSENT:
        return ABSENT
    fix = 'write it as a size such as memory_limit = "16GiB" or "512MiB" (or an integer: MiB)'
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return t.fail("memory_limit", f"must be a size, {got(value)}; {fix}")
    if isinstance(value, int):
        if value < 1:
            return t.fail("memory_limit", f"must be at least 1 MiB, got {value}; {fix}")
        return value
    try:
        return parse_size_mib(value)
    except ValueError:
        return t.fail("memory_limit", f"{show(value)} is not a size; {fix}")


def parse_policy(t: Table) -> Courtesy:
    """[policy]'s courtesy (defaults for what it leaves out)."""
    return replace(Courtesy(), **_values(t))


def parse_host(t: Table) -> Overrides:
    """A [[hosts]] entry's courtesy overrides."""
    return tuple(sorted(_values(t).items()))


def for_host(policy: Courtesy, overrides: Overrides) -> Courtesy:
    """The courtesy a host's workers run with: [policy]'s, with the host's keys over it."""
    return replace(policy, **dict(overrides)) if overrides else policy

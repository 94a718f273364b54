"""A check's result, the one type every "can this be used?" question answers with.

`eltctl doctor` (eltctl/doctor.py) checks each host, `eltctl up` (eltctl/preflight.py)
the hosts it is about to use, and the mirror check (eltctl/mirror/check.py) every
account that touches the checkpoint mirror; each says what it found as `Check`s
(name, ok/warn/fail/skip, detail, fix), gathered in a `Report` per thing checked: a
host, or the mirror (shown by doctor as one more entry, `mirror`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"  # usable, but worth a look
    FAIL = "fail"  # eltctl cannot use this until it is fixed
    SKIP = "skip"  # not checked, because an earlier check failed

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Check:
    """One thing checked: `name` (`python`, `host key`; for the mirror an account:
    `this machine`, `h1 (alice)`, `job directory`, `login`), how it went, and the fix."""

    name: str
    status: Status
    detail: str
    fix: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not Status.FAIL


@dataclass(frozen=True)
class Report:
    """The checks of one thing: `host` is a host's name (or `mirror`), `address` its
    address (or the mirror's target)."""

    host: str
    address: str
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def problems(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

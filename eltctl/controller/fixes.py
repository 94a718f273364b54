"""A fix takes effect at once: what a fix can change, hashed (`fingerprint`; one host's
part as the digest its daemon is started with, `host_config`), the hosts a change
concerns (`changed_hosts`), and their records once fixed (`after_fix`, `fixed`); a
person's `up` (`retried`) and `uncordon` or `scale --add` (`failure_cleared`). An owner's
cooldown always stays: it protects a person, not a mistake. Pure.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

from eltctl.controller.values import HostRecord
from eltctl.inventory import Inventory


def after_fix(record: HostRecord) -> HostRecord:
    """A host whose setup changed (the code, the job, its entry): its failures, failure
    cooldown and benching are forgotten, so the fix is tried at once. An owner's
    cooldown stays: it protects a person, not a mistake."""
    return replace(record, failures=0, cooldown_until=0.0, bench_count=0, benched_until=0.0, last_problem="",
                   start_failure="", ok_since=None)


def fingerprint(inventory: Inventory, code: str) -> dict:
    """What a fix can change, hashed: the job's code (`code`, a digest of its
    directory), its [job] and [ssh] settings (every host), and each host's entry."""
    import hashlib

    def h(x: object) -> str:
        return hashlib.sha256(repr(x).encode()).hexdigest()[:16]

    return {"code": code, "job": h((inventory.job, inventory.ssh)),
            "hosts": {host.name: h(host) for host in inventory.hosts}}


def host_config(fp: Mapping | None, name: str) -> str:
    """One host's part of a fingerprint as one digest: the job's code and settings and the
    host's entry. A daemon is started with it (daemon.json's config) and publishes it in its
    state and crash events, so a daemon or a failure from before a fix is told apart ("":
    no fingerprint yet)."""
    import hashlib

    if not fp or name not in (fp.get("hosts") or {}):
        return ""
    part = (fp.get("code"), fp.get("job"), fp["hosts"][name])
    return hashlib.sha256(repr(part).encode()).hexdigest()[:16]


def stale_config(config: object, current: str) -> bool:
    """Whether a daemon's (or its crash's) `config` is from before the job's last fix:
    both known and different."""
    return bool(config) and bool(current) and config != current


def changed_hosts(old: Mapping | None, new: Mapping) -> list[str]:
    """The hosts a change between two fingerprints concerns (none without an old one)."""
    if not old:
        return []
    names = list(new.get("hosts", {}))
    if old.get("code") != new.get("code") or old.get("job") != new.get("job"):
        return names
    before = old.get("hosts") or {}
    return [n for n in names if before.get(n) != new["hosts"][n]]


def failure_cleared(record: HostRecord) -> HostRecord:
    """A host a person asked to use now (`uncordon`, a `scale --add` whose slots were
    written): its failure cooldown is over, so it cannot come back later (an uncordon, a
    leave) from a failure the host has since been tried past. Its failure count and
    benching stay (they back off a host that keeps failing), and so do an owner's and a
    straggler's cooldowns."""
    if not record.cooldown_until:
        return record
    return replace(record, cooldown_until=0.0,
                   last_problem=record.last_problem if record.benched_until else "")


def retried(records: Mapping[str, HostRecord], now: float) -> dict[str, HostRecord]:
    """`eltctl up` run by a person: "after a fix `eltctl up` retries at once" (the hint of
    every failure), whether or not the fix changed anything the controller sees (a
    package installed on the host, a full disk emptied). The hosts held by a failure
    (cooldown, benching, a start failure) are `after_fix`; the others are left as they are."""
    held = [name for name, r in records.items()
            if r.cooldown_until > now or r.benched_until > now or r.failures or r.start_failure]
    return fixed(records, held)


def fixed(records: Mapping[str, HostRecord], names: Iterable[str]) -> dict[str, HostRecord]:
    """The records once the hosts `names` were fixed (`after_fix`)."""
    out = dict(records)
    for name in names:
        if name in out:
            out[name] = after_fix(out[name])
    return out

"""Demand documents: what each eltctl job sharing a host wants, published beside the GPU claims.

Fair share between jobs (controller/fairshare.py, docs/fairshare.md) needs no central
server: at every probe, each job's controller writes its demand into the host's claims
directory (runtime/claims.py: one per host, shared by every job and user, mode 1777),
as `demand.<host user>.<job>`, and reads every job's file back in the same round trip
(`eltctl.probe`'s `demand` section). The probe script writes it atomically (a temporary
file in the same directory, then `mv`), mode 0644, and stamps it with the host's
account (`user`) and clock (`time`), so a reader compares times on one clock::

    {"user": "alice", "time": 1700000000, "job": "mnist", "priority": 0, "held": 6,
     "wanted": 0, "held_here": 2, "wants_here": false, "usage_gpu_h": 1.5,
     "min_workers": 1, "every": 30.0}

`held` and `wanted` are job-wide (GPUs held; how many more it could use); `held_here`
and `wants_here` are about this host (whether the job would take a GPU here);
`usage_gpu_h` is the job's recent usage (GPU-hours decayed with its
`usage_half_life`); `every` its probe interval. An entry older than `stale_after(every)`
on the host's clock is ignored (its controller is gone), and so is one dated more than
`CLOCK_SKEW_S` in the future. Anyone can write that directory: an entry is believed only
when the file's owner is the account its name and its `user` name, and its `job` is the
one its name names (runtime/claims.py `judge`, applied by the probe's parser and the
daemons; a refused entry is reported with its owner). Another account that created this
job's file name first is reported and the alternate `demand.<user>.<job>~1` is written. The job's host daemons read the
entries too (runtime/claims.py `DemandReader`, every watch interval) and pass them on in
their state documents (`demands`): a controller sees another job's new demand within
a second or two of its publication (`from_daemon_state`). The file's name and the
staleness rule are runtime/claims.py's, which both sides import. Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from eltctl_runtime.claims import CLOCK_SKEW_S
from eltctl_runtime.claims import DEMAND_PREFIX as PREFIX
from eltctl_runtime.claims import DEMAND_STALE_MIN_S as STALE_MIN_S
from eltctl_runtime.claims import demand_stale_after as stale_after


@dataclass(frozen=True)
class Demand:
    job: str
    user: str = ""
    time: float = 0.0  # the host's clock when it was written
    priority: int = 0
    held: int = 0
    wanted: int = 0
    held_here: int = 0
    wants_here: bool = False
    usage_gpu_h: float = 0.0
    min_workers: int = 1
    every: float = 30.0

    @property
    def key(self) -> tuple[str, str]:
        return (self.user, self.job)

    def published(self) -> dict:
        """What the controller hands the probe (the script adds `user` and `time`)."""
        d = asdict(self)
        del d["user"], d["time"]
        return d

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Demand | None":
        """A demand file's content; None when it is not one."""
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            return None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: Any) -> "Demand | None":
        """A demand file's JSON object; None when it is not one."""
        if not isinstance(d, dict) or not isinstance(d.get("job"), str) or not d["job"]:
            return None

        def num(key: str, kind: type, default):
            v = d.get(key)
            return kind(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

        return cls(job=d["job"], user=str(d.get("user") or ""), time=num("time", float, 0.0),
                   priority=num("priority", int, 0), held=max(0, num("held", int, 0)),
                   wanted=max(0, num("wanted", int, 0)), held_here=max(0, num("held_here", int, 0)),
                   wants_here=bool(d.get("wants_here")), usage_gpu_h=max(0.0, num("usage_gpu_h", float, 0.0)),
                   min_workers=max(1, num("min_workers", int, 1)), every=num("every", float, 30.0))

    def fresh(self, host_now: float | None) -> bool:
        """Written recently enough to count, on the host's clock; a time further in the
        future than the clock skew allowed is never fresh (it would stay fresh for ever)."""
        return host_now is None or (host_now - self.time <= stale_after(self.every)
                                    and self.time <= host_now + CLOCK_SKEW_S)


def file_name(user: str, job: str) -> str:
    return f"{PREFIX}{user}.{job}"


def from_daemon_state(state: Any, not_before: float | None = None) -> tuple[Demand, ...]:
    """The fresh demand entries a host daemon passed on in its state document
    (`demands`, read from its host's claims directory and believed by its owner rule;
    `time` is that host's clock), judged at `not_before` when that is later (a newer
    probe of the host)."""
    if not isinstance(state, Mapping) or not isinstance(state.get("demands"), list):
        return ()
    now = state.get("time")
    if not isinstance(now, (int, float)) or isinstance(now, bool):
        return ()
    now = max(float(now), not_before or 0.0)
    out = (Demand.from_dict(d) for d in state["demands"])
    return tuple(d for d in out if d is not None and d.fresh(now))


__all__ = ["Demand", "PREFIX", "STALE_MIN_S", "file_name", "from_daemon_state", "stale_after"]

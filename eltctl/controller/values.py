"""The policy's values: what it reads of a host (`HostView`: one observation; `HostRecord`:
what is remembered of it, hosts.json), what caps a host's slots apart from its GPUs
(`Limit`), and what it answers (`Decision` with its actions `StartDaemon` and `SetDesired`).
Frozen dataclasses and enums, no logic beyond reading and writing them as JSON; the
rules that use them are in policy.py (its module docstring), tracking.py, fixes.py and
limits.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping

from eltctl.probe import GpuUse  # one vocabulary: what the probe classified a GPU as

class Reach(str, enum.Enum):
    OK = "ok"  # reachable, GPUs listed
    CPU_ONLY = "cpu-only"  # reachable, no nvidia-smi: `slots` CPU slots
    UNHEALTHY = "unhealthy"  # reachable, nvidia-smi failed or hung
    UNREACHABLE = "unreachable"
    UNKNOWN = "unknown"  # not observed yet

    def __str__(self) -> str:
        return self.value


class HostPhase(str, enum.Enum):
    """How a host looks in `eltctl status` (docs/control-plane.md)."""

    RUNNING = "running"
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    COOLDOWN = "cooldown"
    BENCHED = "benched"
    REMOVED = "removed"
    UNREACHABLE = "unreachable"
    UNHEALTHY = "unhealthy"
    CORDONED = "cordoned"  # `eltctl cordon`: no new workers until `uncordon`
    OFF_HOURS = "off-hours"  # outside its working hours ([policy] hours)
    QUOTA = "quota"  # a gpu-hours quota is reached
    DISABLED = "disabled"  # `enabled = false` in the inventory

    def __str__(self) -> str:
        return self.value


LIMIT_PHASES = (HostPhase.DISABLED, HostPhase.CORDONED, HostPhase.OFF_HOURS, HostPhase.QUOTA)


@dataclass(frozen=True)
class Limit:
    """What caps a host's slots apart from its GPUs (`host_limits`): `cap` slots at
    most (None: no cap); when a limit takes every slot, its phase, the reason a
    person reads and when it lifts (None: not by itself)."""

    cap: int | None = None
    phase: HostPhase | None = None  # one of LIMIT_PHASES when cap is 0 because of it
    reason: str = ""
    until: float | None = None
    again: str = ""  # `until` as a person reads it, in the host's zone: "Sat 00:00"


NO_LIMIT = Limit()


@dataclass(frozen=True)
class SlotView:
    index: int
    use: GpuUse
    reason: str = ""


@dataclass(frozen=True)
class Crash:
    """A worker crash a host's daemon reported: its slot, the line of its output that
    says why, and whether it failed at start (before its first step)."""

    slot: int
    cause: str = ""
    at_start: bool = False
    config: str = ""  # the digest its daemon was started with (`host_config`; "": not said)


@dataclass(frozen=True)
class DaemonSlots:
    """What a host's daemon is started with, and so what its slots are for its whole
    life (a daemon never changes them): the GPU indices the job may use there
    (`gpus`), or CPU slots (`gpus` None). `source` says where that was learnt, for the
    log (observe.daemon_slots)."""

    gpus: tuple[int, ...] | None
    source: str = ""

    def describe(self) -> str:
        return "CPU slots" if self.gpus is None else f"GPUs {list(self.gpus)}"


@dataclass(frozen=True)
class HostView:
    """One observation of one host."""

    name: str
    reach: Reach = Reach.UNKNOWN
    reason: str = ""
    slots: tuple[SlotView, ...] = ()  # its GPUs (or CPU slots), by index
    daemon_alive: bool = False  # its daemon's state heartbeat is fresh
    workers: tuple[int, ...] = ()  # slots where one of our workers runs now
    worker_ids: tuple[str, ...] = ()  # the ids of those workers (its live daemon's state), when it names them
    yielded: tuple[int, ...] = ()  # slots the daemon gave back to their owner
    taken: tuple[int, ...] = ()  # slots its daemon found claimed by another eltctl job (started nothing there)
    crashed: tuple[int, ...] = ()  # slots whose worker crashed since the last observation
    seq_applied: int = -1  # the desired seq its daemon has acted on (-1: no daemon state)
    # Its live daemon watches the GPUs itself (it reports their states): an owner on a
    # GPU we use is the daemon's to yield, so one yield is recorded, not two races.
    watched: bool = False
    crash_info: tuple[Crash, ...] = ()  # what the daemon said of the crashes in `crashed`
    in_job: bool = False  # a worker of this host is a member in rank 0's fresh status (it reached a step)
    owner: dict | None = field(default=None, hash=False)  # the probe's owner signal holding the host ({"name", "detail", "since"}), or None

    def slot(self, index: int) -> SlotView | None:
        for s in self.slots:
            if s.index == index:
                return s
        return None


@dataclass(frozen=True)
class HostRecord:
    """What the controller remembers about a host (hosts.json)."""

    removed: bool = False
    # Why `eltctl up` left it out (its checks failed there); "" when removed by
    # `scale --remove`. Such a host comes back at the next `up` that finds it fixed.
    removed_reason: str = ""
    desired: tuple[int, ...] = ()  # the slots last asked of its daemon
    seq: int = 0  # the sequence number of that request
    free_since: tuple[tuple[int, float], ...] = ()  # slot -> since when it looks free (or ours)
    cooldown_until: float = 0.0  # after a failure (cleared by a fix)
    failures: int = 0  # in a row
    ok_since: float | None = None  # running cleanly since (resets `failures` after a while)
    bench_count: int = 0
    benched_until: float = 0.0
    last_problem: str = ""  # the last failure: why it was benched or cooled down
    join_now: bool = False  # `scale --add`: waive idle_for, cooldown and benching once
    force: bool = False  # `scale --add --force`: also take busy GPUs once
    owner_until: float = 0.0  # an owner took a GPU back: rest until then (a fix keeps it)
    owner_note: str = ""  # which GPU its owner took
    start_failure: str = ""  # its workers failed at start (none reached a first step): the cause
    straggler_since: float | None = None  # a worker here has held the job back since (every status)
    straggler_until: float = 0.0  # dropped as a straggler: rest until then
    straggler_note: str = ""  # which worker, and the figure
    cordoned: bool = False  # `eltctl cordon`: no workers here until `eltctl uncordon`

    def cooling(self, now: float) -> bool:
        """In a cooldown, after a failure, an owner's return or a straggler's drop."""
        return self.cooldown_until > now or self.owner_until > now or self.straggler_until > now

    def free_since_of(self, index: int) -> float | None:
        for i, t in self.free_since:
            if i == index:
                return t
        return None

    def to_json(self) -> dict:
        return {"removed": self.removed, "removed_reason": self.removed_reason, "desired": list(self.desired),
                "seq": self.seq,
                "free_since": {str(i): t for i, t in self.free_since},
                "cooldown_until": self.cooldown_until, "failures": self.failures, "ok_since": self.ok_since,
                "bench_count": self.bench_count, "benched_until": self.benched_until,
                "last_problem": self.last_problem, "join_now": self.join_now, "force": self.force,
                "owner_until": self.owner_until, "owner_note": self.owner_note,
                "start_failure": self.start_failure, "straggler_since": self.straggler_since,
                "straggler_until": self.straggler_until, "straggler_note": self.straggler_note,
                "cordoned": self.cordoned}

    @classmethod
    def from_json(cls, d: Mapping) -> "HostRecord":
        if "owner_until" not in d and str(d.get("last_problem", "")).startswith("its owner took"):
            # hosts.json of an older controller: its one cooldown was an owner's
            d = {**d, "owner_until": d.get("cooldown_until", 0.0), "owner_note": d.get("last_problem", ""),
                 "cooldown_until": 0.0, "last_problem": ""}
        return cls(removed=bool(d.get("removed", False)), removed_reason=str(d.get("removed_reason", "")),
                   desired=tuple(int(x) for x in d.get("desired", ())),
                   seq=int(d.get("seq", 0)),
                   free_since=tuple(sorted((int(k), float(v)) for k, v in dict(d.get("free_since", {})).items())),
                   cooldown_until=float(d.get("cooldown_until", 0.0)), failures=int(d.get("failures", 0)),
                   ok_since=d.get("ok_since"), bench_count=int(d.get("bench_count", 0)),
                   benched_until=float(d.get("benched_until", 0.0)), last_problem=str(d.get("last_problem", "")),
                   join_now=bool(d.get("join_now", False)), force=bool(d.get("force", False)),
                   owner_until=float(d.get("owner_until", 0.0)), owner_note=str(d.get("owner_note", "")),
                   start_failure=str(d.get("start_failure", "")),
                   straggler_since=(float(d["straggler_since"]) if d.get("straggler_since") is not None
                                    else None),
                   straggler_until=float(d.get("straggler_until", 0.0)),
                   straggler_note=str(d.get("straggler_note", "")),
                   cordoned=bool(d.get("cordoned", False)))


@dataclass(frozen=True)
class Action:
    host: str


@dataclass(frozen=True)
class StartDaemon(Action):
    """Ship the runtime and code if needed, write daemon.json and start the daemon."""


@dataclass(frozen=True)
class SetDesired(Action):
    """Write `daemon/<host>/desired` with these slots and a new sequence number."""

    slots: tuple[int, ...] = ()


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    desired: Mapping[str, tuple[int, ...]]  # every host's slots after the actions
    usable: int  # slots the job could use now (kept plus eligible)
    # (`waiting` counts free slots that only wait for idle_for as good as usable)
    waiting: bool  # fewer than min_workers usable and nothing running: the job waits
    message: str = ""
    paused: str = ""  # the limits leave fewer than min_workers slots: every worker leaves; why, and until when
    # When the job starts by itself: enough free slots will have looked free for their
    # idle_for (the clock of `decide`'s `now`); None when it is not waiting for that.
    starts_at: float | None = None


"""The policy: which hosts and GPUs the job uses now. Pure functions of a view and a clock.

The controller observes each host (`HostView`: probe results and the daemon's
state), remembers things about it across observations (`HostRecord`: when each GPU
was first seen free, cooldowns, benching, removal), and asks `decide` what to do.
`track` folds a new observation into the records; `decide` turns views and records
into actions; `host_state` says how a host looks to a person. None of them does I/O,
so tables of cases test them (tests/controller/test_policy.py).

The rules (the README's "Policy"):

- A slot is a GPU index (or a CPU slot number on a host without GPUs). A free GPU is
  used only after it has looked free for `idle_for`; a busy one never (except once
  after `scale --add --force`). A CPU slot has no owner process to watch: it waits for
  `cpu_idle_for` (default 0, at once; `owner_signals` watch the owner there). While
  free slots only wait for that, the job is starting and `Decision.starts_at` says when.
  A GPU another eltctl job holds (`GpuUse.TAKEN`, its claim: runtime/claims.py) is
  never used and is no owner's: a slot its daemon reports taken leaves the desired
  slots with no failure and no cooldown. Its free clock keeps running while another
  eltctl job holds it (no owner used it): a GPU fair share hands over, or another
  job lets go, is used at once once `idle_for` has passed since its owner last used
  it, not `idle_for` after the other job left (first come, first served; the claim
  decides).
- At most `max_workers` slots are used; fewer than `min_workers` usable slots and the
  job waits (nothing new starts; what runs keeps running).
- A host whose worker left (its owner came back, a crash, the host vanished) rests for
  `cooldown` before new slots start there; the slots still running there stay. The
  two cooldowns are kept apart: a failure's (`cooldown_until`) and an owner's
  (`owner_until`: it protects a person).
- A fix takes effect at once: when the job's code, its [job] or [ssh] settings or a
  host's entry change, the failures, failure cooldown and benching of the hosts
  concerned are forgotten (`after_fix`); an owner's cooldown stays.
- `bench_after` failures in a row (a worker crash, a daemon that would not start, the
  host vanishing while used) bench the host for `max(cooldown, 30 s) * 2**n` (n: how
  often it was benched before), capped at a day. A host that runs cleanly for that
  long has its failure count reset.
- `scale --remove` keeps a host out until `scale --add`; an add waives `idle_for`,
  cooldown and benching once (`--force` also takes GPUs that look busy).
- Stragglers (`track_stragglers`): rank 0 reports, per worker, how much faster the job
  would be without it (the runtime's prediction from every worker's measured speed,
  the others taking its samples). A worker the job would be at least
  `straggler_gain_percent` faster without, in every status for `straggler_for` in a
  row, is dropped in the planned way (its slot leaves the host's desired slots) while
  more than `min_workers` run, and its host rests for `cooldown`, as after an owner's
  return (`straggler_until`). `drop_stragglers = false`: reported, never dropped.

Host state graph (what `host_state` shows)::

    idle --free for idle_for--> starting --daemon reports workers--> running
    running --owner/crash/vanished--> cooldown --cooldown over--> idle
    any --bench_after failures--> benched --back-off over--> idle
    any --scale --remove--> removed --scale --add--> idle
    any --`up`'s checks fail there--> removed (their reason) --an `up` finds it fixed--> idle
    any --`eltctl cordon`--> cordoned --`eltctl uncordon`--> idle
    any --its window closes (hours, hours_margin)--> off-hours --a window opens--> idle
    any --a gpu-hours quota is reached--> quota --its local midnight--> idle
    any --`enabled = false` in the inventory--> disabled

Limits (`host_limits`, from the inventory, a cordon, the clock and the quota figures)
cap a host's slots apart from its GPUs: a host that is disabled, cordoned, outside
its working hours or over a quota gets none (its workers leave in the planned way at
a step boundary, no cooldown), and `max_gpus_per_host` caps the rest. When the limits
alone leave fewer than `min_workers` slots, the job pauses: every worker leaves,
rank 0 writes a checkpoint first (the runtime's "every member leaves": the mirror
copies it), and when a window opens (or a quota lifts) the job restarts from the
newest checkpoint as after the loss of every host (`Decision.paused`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from eltctl.controller import hours as hrs
from eltctl.controller import quotas
from eltctl.durations import format_duration, format_left
from eltctl.inventory import Inventory
from eltctl.inventory.hours import for_host
from eltctl.probe import GpuUse  # one vocabulary: what the probe classified a GPU as

BENCH_BASE_S = 30.0
BENCH_MAX_S = 24 * 3600.0


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


# --------------------------------------------------------------------------- tracking

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


# --------------------------------------------------------------------------- deciding

def _slot_indices(view: HostView) -> list[int]:
    return sorted(s.index for s in view.slots)


def eligible_slots(view: HostView, record: HostRecord, inventory: Inventory, now: float) -> list[int]:
    """Slots of this host that may start a worker now (not counting those it runs)."""
    if record.removed or view.reach not in (Reach.OK, Reach.CPU_ONLY):
        return []
    waived = record.join_now
    if not waived and (record.benched_until > now or record.cooling(now)):
        return []
    out = []
    for s in sorted(view.slots, key=lambda s: s.index):
        if s.index in record.desired or s.use is GpuUse.TAKEN:  # another eltctl job's: never, even forced
            continue
        if s.use is GpuUse.BUSY:
            if record.force:
                out.append(s.index)
            continue
        since = record.free_since_of(s.index)
        if waived or (since is not None and now - since >= idle_for(view, inventory)):
            out.append(s.index)
    return out


def cpu_host(view: HostView | None) -> bool:
    """The host's slots are CPU slots (it has no GPU, or its daemon reports none while SSH
    is down: observe.host_view). Fair share counts GPUs only (controller/fairshare.py)."""
    return view is not None and view.reach is Reach.CPU_ONLY


def idle_for(view: HostView, inventory: Inventory) -> float:
    """How long a slot of this host must look free before it is used: `idle_for` for a
    GPU, `cpu_idle_for` (default 0: at once) for a CPU slot of a host without GPUs, where
    no owner's process can be seen (`owner_signals` watch the owner there)."""
    policy = inventory.policy
    return policy.cpu_idle_for if view.reach is Reach.CPU_ONLY else policy.idle_for


def idle_for_key(view: HostView) -> str:
    """The inventory key `idle_for` reads for this host."""
    return "cpu_idle_for" if view.reach is Reach.CPU_ONLY else "idle_for"


def maturing_slots(view: HostView, record: HostRecord, inventory: Inventory, now: float) -> list[int]:
    """Free slots that only wait for their `idle_for` to pass (usable soon)."""
    return [i for i, _ in maturing(view, record, inventory, now)]


def maturing(view: HostView, record: HostRecord, inventory: Inventory, now: float) -> list[tuple[int, float]]:
    """(slot, when it is usable) of the free slots that only wait for their `idle_for`."""
    if record.removed or record.join_now or view.reach not in (Reach.OK, Reach.CPU_ONLY):
        return []
    if record.benched_until > now or record.cooling(now):
        return []
    wait = idle_for(view, inventory)
    out = []
    for s in view.slots:
        since = record.free_since_of(s.index)
        if (s.use not in (GpuUse.BUSY, GpuUse.TAKEN) and s.index not in record.desired and since is not None
                and now - since < wait):
            out.append((s.index, since + wait))
    return out


def kept_slots(view: HostView | None, record: HostRecord, now: float) -> list[int]:
    """Slots asked of this host before that it keeps: not removed or benched, not taken by someone."""
    if record.removed or view is None or not record.desired:
        return []
    if record.benched_until > now and not record.join_now:
        return []
    if view.reach is Reach.UNREACHABLE:
        return []
    out = []
    for index in record.desired:
        s = view.slot(index)
        if s is not None and s.use is GpuUse.BUSY and not record.force and not view.watched:
            continue  # the owner is back and no daemon watches: leave it
        out.append(index)
    return out


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


def _capacity(view: HostView | None, limit: Limit) -> float:
    """The most slots the limits leave this host, whatever its GPUs do now (unknown: any)."""
    if limit.cap == 0:
        return 0
    if view is None or view.reach not in (Reach.OK, Reach.CPU_ONLY, Reach.UNHEALTHY):
        return float("inf")
    return min(len(view.slots), limit.cap if limit.cap is not None else len(view.slots))


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


def decide(views: Mapping[str, HostView], records: Mapping[str, HostRecord], inventory: Inventory,
           now: float, limits: Mapping[str, Limit] | None = None, fair_cap: int | None = None) -> Decision:
    """What to do now: the slots each host should run, and the daemon starts and stops.
    `limits` (`host_limits`) cap each host's slots; none: no cap. `fair_cap`: the most
    GPUs fair share lets the job hold while another job waits (no new ones beyond it);
    it caps the slots of GPU hosts only: fair share counts no CPU slot (`cpu_host`)."""
    job = inventory.job
    limits = limits or {}
    cap = job.max_workers if job.max_workers is not None else 1 << 30
    gpu_cap = None if fair_cap is None else max(fair_cap, job.min_workers)
    gpu_hosts = {h.name for h in inventory.hosts if not cpu_host(views.get(h.name))}
    kept: dict[str, list[int]] = {}
    candidates: list[tuple[str, int]] = []
    soon_at: list[tuple[float, str, str]] = []  # (when usable, the key that delays it, host) per maturing slot
    kinds: set[str] = set()  # "idle_for" (GPUs) / "cpu_idle_for" (CPU slots) of the free slots counted
    capacity = 0.0
    for host in inventory.hosts:
        view = views.get(host.name)
        rec = records.get(host.name, HostRecord())
        lim = limits.get(host.name, NO_LIMIT)
        here = kept_slots(view, rec, now)
        if lim.cap is not None:
            here = here[:lim.cap]  # over its cap: the last slots leave in the planned way
        kept[host.name] = here
        room = None if lim.cap is None else max(lim.cap - len(here), 0)
        capacity += _capacity(view, lim)
        if view is not None:
            new = [i for i in eligible_slots(view, rec, inventory, now) if i not in here]
            soon = maturing(view, rec, inventory, now)
            if room is not None:
                new, soon = new[:room], soon[:max(room - len(new), 0)]
            candidates += [(host.name, i) for i in new]
            soon_at += [(at, idle_for_key(view), host.name) for _, at in soon]
            if new or soon:
                kinds.add(idle_for_key(view))
    if capacity < job.min_workers and any(lim.phase for lim in limits.values()):
        # The limits alone leave too few slots: pause (every worker leaves; rank 0
        # checkpoints first) and start again from that checkpoint when they lift.
        desired_none = {h.name: () for h in inventory.hosts}
        actions = tuple(SetDesired(h.name, ()) for h in inventory.hosts
                        if records.get(h.name, HostRecord()).desired)
        return Decision(actions=actions, desired=desired_none, usable=0, waiting=False,
                        message="", paused=pause_reason(limits, inventory))
    n_kept = sum(len(v) for v in kept.values())
    n_gpus = sum(len(v) for k, v in kept.items() if k in gpu_hosts)
    extra_gpus = 0 if gpu_cap is None else n_gpus - gpu_cap
    usable = n_kept + len(candidates)
    maturing_n = len(soon_at)
    waiting = False
    message = ""
    starts_at = None
    desired = {name: list(slots) for name, slots in kept.items()}
    if n_kept > cap or extra_gpus > 0:  # max_workers or fair share's cap lowered: drop from the last hosts first
        extra = n_kept - cap
        for host in reversed(inventory.hosts):
            gpu = host.name in gpu_hosts
            while (extra > 0 or (gpu and extra_gpus > 0)) and desired[host.name]:
                desired[host.name].pop()
                extra -= 1
                extra_gpus -= gpu
    elif usable < job.min_workers and n_kept == 0:
        # Free GPUs that only wait for idle_for will do: the job is starting, not waiting.
        waiting = usable + maturing_n < job.min_workers
        if waiting:
            message = (f"{usable + maturing_n} {_slot_word(kinds)} free, min_workers is {job.min_workers}: "
                       "waiting for more to be free")
        else:
            # The job starts when the min_workers-th slot is usable: the last of the
            # soonest maturing slots it needs.
            starts_at, key, host_name = sorted(soon_at)[max(job.min_workers - usable, 1) - 1]
            wait = inventory.policy.cpu_idle_for if key == "cpu_idle_for" else inventory.policy.idle_for
            message = (f"starts in {format_left(starts_at - now)}: {maturing_n} free {_slot_word(kinds)} are used once "
                       f"they have been free for {key} ({format_duration(wait)}); "
                       f"`eltctl scale --add {host_name}` uses them now")
    else:
        room = cap - n_kept
        gpu_room = None if gpu_cap is None else gpu_cap - n_gpus
        for name, index in candidates:
            if room <= 0:
                break
            if name in gpu_hosts and gpu_room is not None:
                if gpu_room <= 0:
                    continue  # fair share's cap: no new GPU; a CPU slot still joins
                gpu_room -= 1
            desired[name].append(index)
            room -= 1
    actions: list[Action] = []
    for host in inventory.hosts:
        view = views.get(host.name)
        rec = records.get(host.name, HostRecord())
        want = tuple(sorted(desired[host.name]))
        alive = view is not None and view.daemon_alive
        if want and not alive and view is not None and view.reach in (Reach.OK, Reach.CPU_ONLY, Reach.UNHEALTHY):
            actions.append(StartDaemon(host.name))
        if want != tuple(rec.desired):
            actions.append(SetDesired(host.name, want))
        # An idle daemon is left running (it costs one sleeping process): a daemon
        # restarted after a clean stop would start its worker ids over, and a reused
        # id finds its old `leave/<id>` key in the store and leaves at once.
    return Decision(actions=tuple(actions), desired={k: tuple(sorted(v)) for k, v in desired.items()},
                    usable=usable, waiting=waiting, message=message, starts_at=starts_at)


def _slot_word(kinds: set[str]) -> str:
    """What the free slots counted are called: GPUs, CPU slots (hosts without GPUs), or both."""
    if kinds == {"cpu_idle_for"}:
        return "CPU slot(s)"
    return "GPU(s)" if kinds == {"idle_for"} else "GPU/slot(s)"


def leave_out(records: Mapping[str, HostRecord], left_out: Mapping[str, str],
              names: Iterable[str]) -> dict[str, HostRecord]:
    """`eltctl up`'s verdict on `names`: the hosts in `left_out` are removed with that
    reason; a host it left out before and not now comes back. A host removed by
    `scale --remove` stays removed (and keeps its reason)."""
    out = dict(records)
    for name in names:
        rec = out.get(name, HostRecord())
        if name in left_out:
            if not (rec.removed and not rec.removed_reason):
                out[name] = replace(rec, removed=True, removed_reason=left_out[name], join_now=False, force=False)
        elif rec.removed and rec.removed_reason:
            out[name] = replace(rec, removed=False, removed_reason="")
    return out


def applied(record: HostRecord, slots: tuple[int, ...]) -> HostRecord:
    """The record once `SetDesired(slots)` was written: a new seq, the one-shot waivers used.
    A `scale --add` that waived a failure cooldown used it up (`failure_cleared`): kept,
    it hid under the host's workers and came back as a stale cooldown once they left
    (issue 50: after a cordon and uncordon)."""
    if slots and record.join_now:
        record = failure_cleared(record)
    return replace(record, desired=tuple(slots), seq=record.seq + 1,
                   join_now=False if slots else record.join_now,
                   force=False if slots else record.force)


# --------------------------------------------------------------------------- showing

def host_state(view: HostView | None, record: HostRecord, now: float,
               limit: Limit = NO_LIMIT) -> tuple[HostPhase, str]:
    """The host's state for `eltctl status`, with the reason a person wants."""
    if limit.phase is not None and not record.removed:
        leaving = len(view.workers) if view is not None else 0
        return limit.phase, limit.reason + (f"; {leaving} worker(s) leaving" if leaving else "")
    if record.removed and record.removed_reason:
        return HostPhase.REMOVED, record.removed_reason
    if record.removed:
        return HostPhase.REMOVED, "removed by `eltctl scale --remove`; `scale --add` brings it back"
    if view is None or view.reach is Reach.UNKNOWN:
        return HostPhase.STARTING, "not observed yet"
    if view.reach is Reach.UNREACHABLE:
        return HostPhase.UNREACHABLE, view.reason
    if record.benched_until > now:
        return HostPhase.BENCHED, (f"{record.last_problem} (for {record.benched_until - now:.0f} s more; "
                                   f"{next_step(view.name, record.last_problem)})")
    if view.workers:
        return HostPhase.RUNNING, f"{len(view.workers)} worker(s)"
    if record.desired:
        return HostPhase.STARTING, f"starting {len(record.desired)} worker(s)"
    if view.reach is Reach.UNHEALTHY:
        return HostPhase.UNHEALTHY, view.reason
    if record.cooldown_until > now:
        return HostPhase.COOLDOWN, (f"{record.last_problem} (usable again in {record.cooldown_until - now:.0f} s; "
                                    f"{next_step(view.name, record.last_problem)})")
    if record.owner_until > now:
        return HostPhase.COOLDOWN, f"{record.owner_note} (usable again in {record.owner_until - now:.0f} s)"
    if record.straggler_until > now:
        return HostPhase.COOLDOWN, f"{record.straggler_note} (usable again in {record.straggler_until - now:.0f} s)"
    if view.slots and all(s.use in (GpuUse.BUSY, GpuUse.TAKEN) for s in view.slots):
        return HostPhase.BUSY, "; ".join(f"GPU {s.index}: {s.reason}" for s in view.slots)
    return HostPhase.IDLE, view.reason or "usable, not used"


def survivor_holds_state(views: Mapping[str, HostView], runtime_status: Mapping | None, now: float,
                         fresh_for: float) -> bool:
    """Does some worker of the job still hold its state? (If not, a start must restore a
    checkpoint first.) Yes when a daemon reports a live worker, or when rank 0's status
    was written within `fresh_for` and names a worker on a host of `views` (the
    inventory) that is not known to be unreachable: workers outlive a dead daemon,
    while a status naming only lost or removed hosts is the last word of a dead run.
    A status its last members wrote as they all left (`paused`) counts only those
    members: a worker started since holds nothing."""
    rs = runtime_status or {}
    if rs.get("paused"):
        # Its last members paused the job (every one left, the newest checkpoint on their
        # host): a live worker now is one that started since, holding nothing, unless its
        # daemon does not name its workers (then it may be a member still).
        members = {str(m) for m in rs.get("members") or ()}
        return any(v.workers and (len(v.worker_ids) < len(v.workers) or members & set(v.worker_ids))
                   for v in views.values())
    if any(v.workers for v in views.values()):
        return True
    try:
        seen = float(rs.get("seen") or 0.0)  # when the controller saw it change (its own clock)
    except (TypeError, ValueError):
        return False
    if not seen or now - seen >= fresh_for:
        return False
    for member in rs.get("members") or []:
        view = views.get(str(member).split("/")[0])
        if view is not None and view.reach is not Reach.UNREACHABLE:
            return True
    return False


def ordered(names: Iterable[str], inventory: Inventory) -> list[str]:
    order = {h.name: i for i, h in enumerate(inventory.hosts)}
    return sorted(names, key=lambda n: order.get(n, 1 << 30))


__all__ = ["LIMIT_PHASES", "NO_LIMIT", "Action", "Crash", "DaemonSlots", "Decision", "GpuUse", "HostRecord",
           "HostPhase", "HostView", "Limit", "Reach", "SetDesired",
           "SlotView", "StartDaemon", "after_fix", "applied", "changed_hosts", "crash_problem", "decide",
           "cpu_host", "eligible_slots", "fingerprint", "fixed", "host_limits", "host_state", "idle_for", "leave_out",
           "maturing",
           "next_step", "pause_reason",
           "record_failure",
           "survivor_holds_state", "track", "track_stragglers", "worker_slot"]

"""Observing: store data and probe results turned into the views the policy decides on.

Every function here except `Observer.read_store` is a pure function of what was
observed and a clock, so tables of cases test them (tests/controller/test_observe.py):
whether a daemon is alive, whether rank 0's status is fresh, which slots crashed, how
a host looks (`policy.HostView`) from its probe report and its daemon's state, and
which checkpoint the mirror should copy. `Observer` holds what was seen so far (the
daemons' states, the event log read up to `events_read`, rank 0's status, the probe
reports); the controller's loop (`loop.py`) feeds it and asks it for views.

Everything read comes through the controller's signed store client (store.py): a
value not signed with the job's secret is never acted on. A forged event (a fake
crash that would bench a host) reads as missing; a forged status or daemon state
reads as its key's last verified value. `events/seq` is a counter (counters cannot
be signed: anyone can raise or lower it), so it is never read: the log's entries
form one run from 1 up (writers take the first free number, protocol.claim), and
each pass reads on from `events_read` while entries are there (a few missing ones
in a row end it, protocol.GAP_TOLERANCE), at most `EVENTS_WINDOW` per pass, so a
raised counter neither hides a real event nor wedges the controller.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

from eltctl.controller import policy as pol
from eltctl.inventory import Host, Policy
from eltctl.probe import GpuUse, HostReport, HostState
from eltctl_runtime.protocol import GAP_TOLERANCE, EventKind, Keys, state_key

log = logging.getLogger("eltctl.controller")

EVENTS_KEPT = 50
EVENTS_WINDOW = 256  # the most event log entries read in one pass
BIRTH_WINDOWS = 64
# A daemon's state key read as missing after it was there is watched this long for the
# daemon's next write (it writes about once a second), in all per pass at most.
STATE_PROBE_S = 1.5
CONTESTED_LIMIT = 3  # freshness windows a state may be rewritten-and-deleted without one read  # a new controller reads the log to its end, at most this many windows
# Worker states (runtime/daemon/logic.py WorkerState) of a worker that has ended.
FINISHED_WORKER_STATES = {"left", "finished", "crashed", "lost"}


@dataclass
class DaemonSeen:
    """A daemon's last state document as read from the store."""

    raw: bytes
    changed: float  # controller clock: when the state value last changed
    state: dict
    # controller clock: when a newer state value was last read (`changed` also counts a
    # contested one: rewritten and deleted again before it could be read); None: `changed`
    verified: float | None = None


# --------------------------------------------------------------------------- pure views


def seen_state(old: DaemonSeen | None, raw: bytes, now: float) -> DaemonSeen:
    """Fold a freshly read state value in: a value that did not change keeps its time,
    and so does an older one (its daemon's own `time` is not past the last one's: a
    validly signed old state written back by someone is no news of the daemon)."""
    if old is not None and old.raw == raw:
        return old
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = {}
    parsed = parsed if isinstance(parsed, dict) else {}
    if old is not None and not newer_state(parsed, old.state):
        return old
    return DaemonSeen(raw=raw, changed=now, state=parsed, verified=now)


def newer_state(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """Whether state document `new` (a value other than `old`'s) is news after `old`,
    judged on the writer's own clock inside the signed value (its `time`): an older
    document written back is not."""
    t_new, t_old = new.get("time"), old.get("time")
    if isinstance(t_new, (int, float)) and isinstance(t_old, (int, float)):
        return t_new >= t_old
    return True


def contested_state(old: DaemonSeen, now: float) -> DaemonSeen:
    """The daemon's state key was written again but deleted before it could be read:
    not silence (the daemon is writing), for CONTESTED_LIMIT freshness windows at most."""
    return replace(old, changed=now, verified=old.verified if old.verified is not None else old.changed)


def slot_of(worker_id: str) -> int | None:
    """The slot in a worker id `<host>/<slot>/<n>` (None if it has none)."""
    parts = str(worker_id).split("/")
    if len(parts) >= 2 and parts[-2].lstrip("-").isdigit():
        return int(parts[-2])
    return None


def crashed_slots(event: Mapping[str, Any], new: bool = True) -> list[tuple[str, int]]:
    """The (host, slot)s a crash event names. A crash logged before this controller
    first read the log (`new` False: its number was already taken then) was handled by
    the one before it (an adopted job): counting it again would drop a running slot, so
    it names none. Judged by the log's numbering, never by the host's clock."""
    if event.get("kind") != EventKind.CRASH.value or not new:
        return []
    host = event.get("host")
    out = []
    for w in event.get("workers") or ([event.get("worker")] if event.get("worker") else []):
        slot = slot_of(w)
        h = host or (str(w).split("/")[0] if w else None)
        if slot is not None and h:
            out.append((h, slot))
    return out


def crash_info(event: Mapping[str, Any], new: bool = True) -> list[tuple[str, pol.Crash]]:
    """(host, Crash) for each slot a crash event names (`crashed_slots`), with the cause
    and the at-start verdict its daemon gave (runtime/protocol.py, EventKind)."""
    cause = str(event.get("cause") or "")
    at_start = bool(event.get("at_start"))
    config = str(event.get("config") or "")
    return [(h, pol.Crash(slot, cause, at_start, config)) for h, slot in crashed_slots(event, new)]


def in_job(host: str, runtime_status: Mapping | None, now: float, policy: Policy) -> bool:
    """A worker of `host` is a member in rank 0's fresh status: the host reached a step."""
    if not runtime_fresh(runtime_status, now, policy):
        return False
    return any(str(m).split("/")[0] == host for m in (runtime_status or {}).get("members") or [])


def daemon_may_run(seen: DaemonSeen | None) -> bool:
    """The daemon may still run: it reported, and its last state is not its last word
    (phase stopped or failed). A state that merely went stale (a loaded host, a slow
    link) says nothing of whether the process is gone: unlike `daemon_alive`, this
    one does not count that as an exit."""
    return seen is not None and seen.state.get("phase") not in ("stopped", "failed")


def daemon_alive(seen: DaemonSeen | None, now: float, policy: Policy) -> bool:
    """The daemon's state changed recently (by the controller's clock: a daemon rewrites
    it every second) and is not a last word. The host's own timestamps are never
    compared with this clock: host clocks may be off by any amount."""
    if seen is None:
        return False
    fresh_for = max(5.0, 5 * policy.watch_interval)
    if now - seen.changed > fresh_for:
        return False
    if seen.verified is not None and now - seen.verified > CONTESTED_LIMIT * fresh_for:
        return False  # contested too long: judged on the values read
    return seen.state.get("phase") not in ("stopped", "failed")


def runtime_fresh_for(policy: Policy) -> float:
    """Rank 0 writes its status about every second; this long without one, it is gone."""
    return max(10.0, 2 * policy.hang_timeout)


# How long a status first seen at the controller's start may take to change before it
# counts as the last word of a dead run (rank 0 rewrites it every second).
STATUS_SETTLE_S = 3.0


def seen_at(runtime_status: Mapping | None) -> float:
    """When the controller last saw rank 0's status change (its own clock; 0: never)."""
    try:
        return float((runtime_status or {}).get("seen") or 0.0)
    except (TypeError, ValueError):
        return 0.0


def runtime_fresh(runtime_status: Mapping | None, now: float, policy: Policy) -> bool:
    """Rank 0's status changed within `runtime_fresh_for`, by the controller's clock
    (`seen`, set by `Observer`; rank 0's own `time` is its host's clock)."""
    seen = seen_at(runtime_status)
    return bool(seen) and now - seen < runtime_fresh_for(policy)


def checkpoint_to_mirror(runtime_status: Mapping | None, now: float, policy: Policy, restored_at: float,
                         job: str, host_names: Iterable[str]) -> tuple[str, int] | None:
    """(host, step) of rank 0's newest committed checkpoint, for the mirror worker. Only a
    fresh status of the current run counts: after a restore the old run's status (a step
    the new run will commit again) must not be taken for a new checkpoint."""
    from eltctl.mirror import checkpoint_host

    rs = runtime_status or {}
    ck = rs.get("checkpoint")
    if not isinstance(ck, dict) or not runtime_fresh(rs, now, policy):
        return None
    if seen_at(rs) < restored_at or not isinstance(ck.get("step"), int):
        return None
    host = checkpoint_host(str(ck.get("path") or ""), job)
    if host is None or host not in set(host_names):
        return None
    return host, ck["step"]


def member_alive(member: str, views: Mapping[str, pol.HostView]) -> bool:
    """A member of rank 0's status runs now: its host's live daemon lists it among its
    running workers (by worker id; by slot where the daemon names no ids). A worker id
    carries its start (`<host>/<slot>/<n>`), so the member of a crashed run never
    matches the worker started in its slot since. Where the host's daemon is silent (a
    loaded host, a lost link) nothing contradicts rank 0's status: the member counts."""
    view = views.get(str(member).split("/")[0])
    if view is None:
        return False
    if not view.daemon_alive:
        return True
    if view.worker_ids:
        return str(member) in view.worker_ids
    slot = slot_of(member)
    return slot is not None and slot in view.workers


def live_members(runtime_status: Mapping | None, views: Mapping[str, pol.HostView]) -> list[str]:
    """The members of rank 0's status that run now, in rank order (`member_alive`)."""
    members = (runtime_status or {}).get("members") or []
    return [str(m) for m in members if member_alive(m, views)]


def checkpoint_seen(runtime_status: Mapping | None, now: float, job: str) -> dict | None:
    """Rank 0's newest committed checkpoint as the controller keeps it: {step, time, path,
    host, age_s, seen} where `age_s` was its age when seen at `seen` (the controller's clock:
    rank 0's `time` and the checkpoint's are its host's clock, so only their difference
    counts). None when the status names none."""
    from eltctl.hosts.layout import checkpoint_host

    rs = runtime_status or {}
    ck = rs.get("checkpoint")
    if not isinstance(ck, dict) or not isinstance(ck.get("step"), int) or isinstance(ck.get("step"), bool):
        return None
    try:
        seen = float(rs["seen"])  # 0: a dead run's status, never seen to change: no basis for an age
        age: float | None = max(0.0, float(rs["time"]) - float(ck["time"]) + now - seen) if seen else None
    except (KeyError, TypeError, ValueError):
        age = None
    path = str(ck.get("path") or "")
    return {"step": ck["step"], "time": ck.get("time"), "path": path or None,
            "host": checkpoint_host(path, job) if path else None,
            "age_s": None if age is None else round(age, 1), "seen": now,
            **({"script_step": ck.get("script_step")} if "script_step" in ck else {})}


def newest_checkpoint(known: dict | None, runtime_status: Mapping | None, now: float, job: str) -> dict | None:
    """The job's last checkpoint: the one rank 0's status names, else the one the controller
    saw last (`known`, kept in hosts.json). A resize or a crash starts a rank 0 that has
    saved nothing yet: the checkpoints written before it are still there (`eltctl
    checkpoints` lists them), so status keeps showing the last one instead of none."""
    current = checkpoint_seen(runtime_status, now, job)
    if current is None:
        return known if isinstance(known, dict) and isinstance(known.get("step"), int) else None
    if isinstance(known, dict) and known.get("step") == current["step"] and known.get("path") == current["path"]:
        return known  # the same one, unchanged (its age counts from when it was first seen)
    return current


def final_checkpoint(runtime_status: Mapping | None) -> dict | None:
    """What `down` reports of rank 0's last checkpoint."""
    ck = (runtime_status or {}).get("checkpoint")
    if isinstance(ck, dict):
        out = {"step": ck.get("step"), "path": ck.get("path"), "time": ck.get("time")}
        if "snapshot" in ck:  # restart mode: `step` is the snapshot counter; the script's step beside it
            out["snapshot"], out["script_step"] = ck.get("snapshot"), ck.get("script_step")
        return out
    return None


_REACH = {HostState.OK: pol.Reach.OK, HostState.CPU_ONLY: pol.Reach.CPU_ONLY,
          HostState.UNHEALTHY: pol.Reach.UNHEALTHY, HostState.UNREACHABLE: pol.Reach.UNREACHABLE}


def cpu_slots(host: Host) -> tuple[pol.SlotView, ...]:
    return tuple(pol.SlotView(i, GpuUse.FREE, "CPU slot") for i in range(host.slots))


def probed(host: Host, report: HostReport | None) -> tuple[pol.Reach, str, tuple[pol.SlotView, ...]]:
    """How the probe saw a host: reach, reason, slots."""
    if report is None:
        return pol.Reach.UNKNOWN, "", ()
    if report.state is HostState.OK:
        slots = tuple(pol.SlotView(g.gpu.index, g.state, g.reason) for g in report.gpus)
    elif report.state is HostState.CPU_ONLY:
        slots = cpu_slots(host)
        if report.owner is not None:  # an owner signal holds the host (probe.with_owner)
            slots = tuple(pol.SlotView(s.index, GpuUse.BUSY, f"owner: {report.owner.get('detail', '')}")
                          for s in slots)
    else:
        slots = ()
    return _REACH[report.state], report.reason, slots


def _slots_in(entries: Any) -> set[int]:
    return {int(e["slot"]) for e in entries or [] if isinstance(e, dict) and e.get("slot") is not None}


def host_view(host: Host, report: HostReport | None, seen: DaemonSeen | None, alive: bool,
              crashed: Iterable[int] = (), crashes: Iterable[pol.Crash] = (), joined: bool = False) -> pol.HostView:
    """One host as the policy sees it: the probe's view, corrected by its live daemon's state."""
    reach, reason, slots = probed(host, report)
    workers: tuple[int, ...] = ()
    worker_ids: tuple[str, ...] = ()
    yielded: tuple[int, ...] = ()
    taken: tuple[int, ...] = ()
    seq_applied = -1
    watched = False
    if alive and seen is not None:
        st = seen.state
        if reach is pol.Reach.UNREACHABLE or reach is pol.Reach.UNKNOWN:
            # SSH is down (or not probed yet) but the daemon reports: the host works.
            reach, reason = pol.Reach.OK if st.get("gpus") else pol.Reach.CPU_ONLY, "daemon reporting"
            if reach is pol.Reach.CPU_ONLY:
                slots = cpu_slots(host)
        live = [w for w in st.get("workers", []) if isinstance(w, dict)
                and str(w.get("state", "running")) not in FINISHED_WORKER_STATES]
        workers = tuple(sorted(_slots_in(live)))
        worker_ids = tuple(sorted(str(w["worker_id"]) for w in live if w.get("worker_id")))
        yielded = tuple(sorted(_slots_in(st.get("yielded", []))))
        taken = taken_slots(st)
        seq_applied = int(st.get("seq_applied", -1) if st.get("seq_applied") is not None else -1)
        daemon_gpus = {int(g["index"]): g for g in st.get("gpus", []) if isinstance(g, dict) and "index" in g}
        watched = bool(daemon_gpus) and st.get("health") == "ok"
        if daemon_gpus and slots:
            merged = []
            for s in slots:
                g = daemon_gpus.get(s.index)
                if g is not None and str(g.get("state")) == "busy":
                    merged.append(pol.SlotView(s.index, GpuUse.BUSY, str(g.get("reason", ""))))
                elif g is not None and str(g.get("state")) == "taken" and s.use is not GpuUse.BUSY:
                    merged.append(pol.SlotView(s.index, GpuUse.TAKEN, str(g.get("reason", ""))))
                else:
                    merged.append(s)
            slots = tuple(merged)
        if taken:  # a CPU slot, or a GPU the daemon found claimed before its watch said so
            jobs = {str(k): str(v) for k, v in (st.get("taken") or {}).items()}
            slots = tuple(pol.SlotView(s.index, GpuUse.TAKEN, f"taken by job {jobs.get(str(s.index), '?')}")
                          if s.index in taken and s.use not in (GpuUse.BUSY, GpuUse.TAKEN) else s for s in slots)
    return pol.HostView(name=host.name, reach=reach, reason=reason, slots=slots, daemon_alive=alive,
                        workers=workers, worker_ids=worker_ids, yielded=yielded, taken=taken,
                        crashed=tuple(sorted(crashed)),
                        seq_applied=seq_applied, watched=watched, crash_info=tuple(crashes), in_job=joined,
                        owner=dict(report.owner) if report is not None and isinstance(report.owner, dict) else None)


def taken_slots(state: Mapping[str, Any]) -> tuple[int, ...]:
    """The slots a daemon's state reports taken by another eltctl job (`taken`: {"<slot>": job})."""
    taken = state.get("taken")
    if not isinstance(taken, dict):
        return ()
    return tuple(sorted(int(k) for k in taken if str(k).isdigit()))


def says_what_it_has(report: HostReport | None) -> bool:
    """The probe could tell what the host has: GPUs (OK) or none (CPU_ONLY). An
    unhealthy probe (nvidia-smi hung or failed, the probe timed out on a loaded host)
    or an unreachable host says nothing of it."""
    return report is not None and report.state in (HostState.OK, HostState.CPU_ONLY)


def daemon_slots(host: Host, report: HostReport | None, settled: HostReport | None = None) -> pol.DaemonSlots | None:
    """What the host's daemon is to be started with: the inventory's `gpus` (they win),
    else what the probe found, GPUs (OK) or CPU slots (CPU_ONLY). A probe that cannot
    tell (`says_what_it_has`) changes nothing: the last one that could (`settled`)
    stands. None when no probe ever could: the start waits for one. A daemon keeps its
    slots for life, so a GPU host whose latest probe failed must never be started as
    a CPU host (it would refuse every GPU asked of it until it is replaced)."""
    if host.gpus is not None:
        return pol.DaemonSlots(tuple(host.gpus), "the inventory's gpus")
    for r, source in ((report, "the probe"), (settled, "the last probe that could tell")):
        if r is None or not says_what_it_has(r):
            continue
        if r.state is HostState.CPU_ONLY:
            return pol.DaemonSlots(None, f"{source}: {r.reason}" if r.reason else source)
        return pol.DaemonSlots(tuple(sorted(g.gpu.index for g in r.gpus)), source)
    return None


def _slots_words(kind: str, slots: Iterable[int] | None) -> str:
    if kind == "cpu":
        return f"CPU slots {sorted(slots or ())}"
    return "any GPU" if slots is None else f"GPUs {sorted(slots)}"


def wrong_slots(expected: tuple[str, frozenset[int] | None], state: Mapping[str, Any]) -> str | None:
    """Why a running daemon's slots (its state's `slot_kind` and `valid_slots`) are not
    those of a daemon started now (`expected`: hosts/ops.py `daemon_slot_kind`), or None
    when they are: of the same kind, with every slot it would have. A daemon that does
    not say (an older runtime) is never judged; one that follows its GPUs (`follows_gpus`:
    it takes nvidia-smi's list at each watch round) by its kind alone (judged by the list,
    it would be replaced, its workers leaving, for a GPU it is about to take up)."""
    kind, valid = state.get("slot_kind"), state.get("valid_slots")
    if kind not in ("gpu", "cpu") or not (valid is None or isinstance(valid, list)):
        return None
    try:
        has = None if valid is None else frozenset(int(s) for s in valid)
    except (TypeError, ValueError):
        return None
    want_kind, want = expected
    fewer = want is not None and has is not None and not want <= has and state.get("follows_gpus") is not True
    if kind != want_kind or fewer:
        return f"its daemon runs {_slots_words(kind, has)} but the host has {_slots_words(want_kind, want)}"
    return None


def add_refusal(report: HostReport, force: bool) -> str | None:
    """Why `scale --add` refuses a probed host, or None when it may join."""
    if report.state is HostState.UNREACHABLE:
        return f"unreachable: {report.reason}"
    usable = (report.state is HostState.CPU_ONLY or bool(report.gpus_in(GpuUse.FREE))
              or bool(report.gpus_in(GpuUse.OURS)))
    if not usable and not force:
        why = "; ".join(f"GPU {g.gpu.index}: {g.reason}" for g in report.gpus) or report.reason
        return f"no free GPU ({why}); --force adds it anyway"
    return None


def added_message(report: HostReport, desired: Iterable[int] | None = None,
                  waiting: Mapping[str, Any] | None = None) -> str:
    """What `scale --add` says of a host it added, once the controller's pass after it
    decided (`desired`: the slots it asked of the host; `waiting`: the host's status entry's
    `waiting`, status.host_wait): the slots that join now, else what holds them back. It
    never promises what the policy then refuses (fair share, max_workers, hours, quota)."""
    what = "CPU slot" if report.state is HostState.CPU_ONLY else "GPU"
    n = len(tuple(desired or ()))
    if n:
        return f"added; {n} {what}{'' if n == 1 else 's'} join now"
    if isinstance(waiting, Mapping) and waiting.get("detail") and waiting.get("kind") != "joining":
        return (f"added, but its {what}s do not join now: {waiting.get('kind')}: {waiting['detail']} "
                "(`eltctl status` shows it)")
    return f"added; its {what}s join when the controller's next pass gives them (`eltctl status` shows it)"


def adopted(record: pol.HostRecord, desired: Any) -> pol.HostRecord:
    """A host's memory seeded from the desired document in the store (a controller that
    lost hosts.json continues exactly what the daemons were told)."""
    if not isinstance(desired, dict):
        return record
    seq = int(desired.get("seq", 0))
    if seq < record.seq:
        return record
    slots = () if desired.get("stop") else tuple(int(s) for s in desired.get("slots", ()))
    return replace(record, seq=seq, desired=slots)


# --------------------------------------------------------------------------- the job's pace

# The job's samples/s and steps/s are those committed over the last RATE_WINDOW_S of
# rank 0's commits: one figure for status, the metrics and the usage ledger. Rank 0's own
# figure covers the second since its last status (it swings with every pause and commit).
RATE_WINDOW_S = 30.0


def commit_point(status: Mapping[str, Any]) -> tuple[str, float, int | None, int | None] | None:
    """(rank 0's worker, its clock, samples committed, step) of a status document; None
    when it has no time. Rank 0's `time` is its host's clock: comparable only between two
    documents of one rank 0, hence the worker."""
    def whole(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    t = status.get("time")
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return None
    members = status.get("members") or []
    return (str(members[0]) if members else "", float(t), whole(status.get("samples")), whole(status.get("step")))


def pace(points: Iterable[tuple[str, float, int | None, int | None]],
         window: float = RATE_WINDOW_S) -> dict[str, float | None]:
    """{samples_per_s, steps_per_s, window_s}: what was committed between the oldest and
    the newest point of the last `window` seconds of rank 0's commits (the newest run of
    points of one rank 0 in which samples and steps never go back: a restore from an older
    checkpoint or a new rank 0 starts the count again). None where fewer than two points
    (or no time between them) tell."""
    run: list[tuple[str, float, int | None, int | None]] = []
    for p in points:
        if run and (p[0] != run[-1][0] or p[1] < run[-1][1]
                    or any(a is not None and b is not None and b < a for a, b in ((run[-1][2], p[2]),
                                                                                  (run[-1][3], p[3])))):
            run = []
        run.append(p)
    recent = [p for p in run if run and p[1] >= run[-1][1] - window]
    out: dict[str, float | None] = {"samples_per_s": None, "steps_per_s": None, "window_s": None}
    if len(recent) < 2 or recent[-1][1] <= recent[0][1]:
        return out
    first, last = recent[0], recent[-1]
    dt = last[1] - first[1]
    out["window_s"] = round(dt, 1)
    for key, i in (("samples_per_s", 2), ("steps_per_s", 3)):
        a, b = first[i], last[i]
        if a is not None and b is not None:
            out[key] = round((b - a) / dt, 3 if key == "steps_per_s" else 1)
    return out


# --------------------------------------------------------------------------- what was seen


@dataclass
class Observer:
    """What the controller has seen of the job so far; `read_store` adds to it."""

    seen: dict[str, DaemonSeen] = field(default_factory=dict)
    reports: dict[str, HostReport] = field(default_factory=dict)
    # each host's last report that said what it has (`says_what_it_has`): a daemon is
    # started with its slots when the latest probe could not tell (`daemon_slots`)
    settled: dict[str, HostReport] = field(default_factory=dict)
    crashed: dict[str, set[int]] = field(default_factory=dict)  # since the last decision
    crashes: dict[str, dict[int, pol.Crash]] = field(default_factory=dict)  # the same, with causes
    events: deque = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    events_read: int = 0  # the event log's sequence number read up to (kept in hosts.json)
    events_skipped: int = 0  # event numbers never read (0 since the log is read as a run; kept for status)
    runtime_status: dict | None = None  # rank 0's status document, with `seen` (see read_store)
    checkpoint: dict | None = None  # the job's last checkpoint (newest_checkpoint; kept in hosts.json)
    born: float | None = None  # when this controller first read the store
    born_seq: int = 0  # the event log's last number then: events up to it are the last controller's
    _in_store: set = field(default_factory=set)  # hosts whose state this store has held
    _status_raw: bytes | None = None
    _status_changed: float | None = None  # when the status value last changed, after the first sighting
    _status_first: float = 0.0
    # each host's digest as a daemon started now gets it (pol.host_config; the controller's
    # fingerprint): a crash of a daemon started with another (from before a fix) counts nothing
    config_of: Callable[[str], str] = lambda name: ""
    _stale_logged: set = field(default_factory=set)
    # rank 0's commits of the last RATE_WINDOW_S and more (`commit_point`): the job's pace
    _commits: deque = field(default_factory=lambda: deque(maxlen=600))

    async def read_store(self, store, host_names: Iterable[str], now: float) -> None:
        """The daemons' states, the new events and rank 0's status."""
        if self.born is None:
            self.born = now
        probe_left = STATE_PROBE_S
        for name in host_names:
            key = state_key(name)
            raw = await store.get_raw(key)
            old = self.seen.get(name)
            if raw is None and name in self._in_store and probe_left > 0 and hasattr(store, "watch_deleted"):
                # no daemon deletes its state: someone did; its next write is watched for
                started = time.monotonic()
                raw, contested = await store.watch_deleted(key, min(probe_left, STATE_PROBE_S))
                probe_left -= time.monotonic() - started
                if raw is None and contested:
                    self.seen[name] = contested_state(old, now)
            if raw is not None:
                new = seen_state(old, raw, now)
                if old is not None and new is old and raw != old.raw and getattr(store, "forgeries", None) is not None:
                    store.forgeries.note(key, "replayed")  # an older state written back
                self.seen[name] = new
                self._in_store.add(name)
        born = self.born == now
        if born and self.events_read > 0 and await store.get_raw(Keys.event(self.events_read)) is None:
            self.events_read = 0  # hosts.json's log is not in this store (a new `up`): its log starts again
        # The log is read as a run of entries, never through the unsigned events/seq.
        # At birth it is read to its end: what is there is the last controller's.
        for _ in range(BIRTH_WINDOWS if born else 1):
            if not await self._read_events(store, None if born else self.born_seq):
                break
        if born:
            self.born_seq = self.events_read
        raw = await store.get_raw(Keys.STATUS)
        if raw != self._status_raw:
            if self._status_raw is None and self._status_changed is None:
                self._status_first = now  # first sighting: written before we looked, or just now
            else:
                self._status_changed = now
            self._status_raw = raw
        try:
            status = json.loads(raw) if raw is not None else None
        except ValueError:
            status = None
        if isinstance(status, dict):
            # `seen`: when the controller saw it change (rank 0 rewrites it every second).
            # A status that has not changed since it was first seen gets the benefit of
            # the doubt for STATUS_SETTLE_S (`settling`), then counts as a dead run's.
            if self._status_changed is not None:
                status["seen"] = self._status_changed
            else:
                status["seen"] = self._status_first if now - self._status_first < STATUS_SETTLE_S else 0.0
            self._note_pace(status)
        self.runtime_status = status if isinstance(status, dict) else None

    def _note_pace(self, status: dict) -> None:
        """The job's pace into rank 0's status (`pace`): `samples_per_s` becomes the rate over
        the last RATE_WINDOW_S of commits where the runtime counts its committed `samples`
        (rank 0's own figure stays while fewer than two commits tell), `steps_per_s` beside it."""
        point = commit_point(status)
        if point is not None and (not self._commits or self._commits[-1] != point):
            self._commits.append(point)
        figures = pace(self._commits) if point is not None else {}
        if figures.get("samples_per_s") is not None and "samples" in status:
            status["samples_per_s"] = figures["samples_per_s"]
        for key, value in (("steps_per_s", figures.get("steps_per_s")), ("pace_window_s", figures.get("window_s"))):
            if value is not None:
                status[key] = value

    async def _read_events(self, store, born_seq: int | None) -> bool:
        """Read on from `events_read` while there are entries, at most EVENTS_WINDOW
        numbers; True when the window was full (there may be more). `born_seq` None:
        every event read is the last controller's (not acted on)."""
        n, misses = self.events_read, 0
        while n - self.events_read < EVENTS_WINDOW and misses < GAP_TOLERANCE:
            n += 1
            raw = await store.get_raw(Keys.event(n))
            if raw is None:
                misses += 1  # missing, or forged (counted by the client)
                continue
            misses = 0
            self.events_read = n
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            self.events.append(ev)
            for host, crash in crash_info(ev, born_seq is not None and n > born_seq):
                self.crashed.setdefault(host, set()).add(crash.slot)
                self.crashes.setdefault(host, {})[crash.slot] = crash
        return misses < GAP_TOLERANCE

    def store_restarted(self) -> None:
        """The store keeper was restarted: the new store's event log starts again at 0
        and every event in it is new. (Rank 0's status needs nothing: the new store's,
        absent or not, differs from the last one seen, so it counts as changed.)"""
        self.events_read = 0
        self.born_seq = 0
        self._in_store.clear()  # a state not yet in the new store was not deleted

    def settling(self, now: float) -> bool:
        """A status was there when this controller started and has not changed yet: whether
        a worker holds the job's state is not known for STATUS_SETTLE_S."""
        return (self._status_raw is not None and self._status_changed is None
                and now - self._status_first < STATUS_SETTLE_S)

    def clear_crashes(self) -> None:
        """The crashes seen were decided on."""
        self.crashed.clear()
        self.crashes.clear()

    def take_reports(self, reports: Iterable[HostReport]) -> list[str]:
        """Keep new probe reports; returns the names of the hosts found unreachable."""
        lost = []
        for r in reports:
            self.reports[r.name] = r
            if says_what_it_has(r):
                self.settled[r.name] = r
            if r.state is HostState.UNREACHABLE:
                lost.append(r.name)
        return lost

    def daemon_slots(self, host: Host) -> pol.DaemonSlots | None:
        """What the host's daemon would be started with now (`daemon_slots`)."""
        return daemon_slots(host, self.reports.get(host.name), self.settled.get(host.name))

    def forget_machine(self, name: str) -> None:
        """The host's entry now names another machine (address or port): what the
        probes said of the old one's GPUs no longer stands in for a failed probe."""
        self.settled.pop(name, None)

    def daemon_alive(self, name: str, now: float, policy: Policy) -> bool:
        return daemon_alive(self.seen.get(name), now, policy)

    def view(self, host: Host, now: float, policy: Policy) -> pol.HostView:
        crashes = self.crashes.get(host.name, {})
        current = self.config_of(host.name)
        stale = {slot for slot, c in crashes.items() if pol.stale_config(c.config, current)}
        keys = {slot: (host.name, slot, crashes[slot].config, crashes[slot].cause) for slot in stale}
        # Said once per such crash, and forgotten once the crash is no longer on record.
        self._stale_logged = {k for k in self._stale_logged if k[0] != host.name or k in keys.values()}
        for slot, key in keys.items():
            if key not in self._stale_logged:
                self._stale_logged.add(key)
                log.info("Host %s: the crash on slot %d (%s) is of a daemon started before the last change of "
                         "the job's code or settings: it counts no failure.", host.name, slot,
                         crashes[slot].cause or "no cause given")
        return host_view(host, self.reports.get(host.name), self.seen.get(host.name),
                         self.daemon_alive(host.name, now, policy),
                         [s for s in self.crashed.get(host.name, ()) if s not in stale],
                         tuple(c for slot, c in crashes.items() if slot not in stale),
                         in_job(host.name, self.runtime_status, now, policy))

    def views(self, hosts: Iterable[Host], now: float, policy: Policy) -> dict[str, pol.HostView]:
        return {h.name: self.view(h, now, policy) for h in hosts}

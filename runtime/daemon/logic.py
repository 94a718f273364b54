"""The host daemon's decisions, as pure functions of what it observes and a clock.

`decide(view)` takes what the daemon knows at one tick (the controller's desired
state, its own memory, its live workers, the foreign processes on its GPUs, the
clock) and returns its new memory plus the actions to carry out; `exit_outcome`
says what a worker's exit means. service.py observes and acts; nothing here does
I/O, so both are tested with tables (tests/runtime/test_daemon.py).

A slot is a GPU index (or a CPU slot number on a host without GPUs). The
controller writes `daemon/<host>/desired` = {seq, slots, stop} (`Desired`,
defined with the rest of the wire protocol in protocol.py). A new seq *arms*
each desired slot: an armed slot without a worker gets exactly one new worker.
Nothing re-arms a slot but a new seq that lists it: a crashed worker or a slot
whose GPU its owner took stays empty until the controller decides again (the
controller benches hosts whose workers keep failing; the daemon never restarts
in a loop).
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Mapping

from ..owner import OwnerSignal
from ..protocol import Desired


class WorkerState(str, Enum):
    """A worker's life as the daemon sees it::

        running --slot no longer desired, its GPU's owner came back, an owner signal fired,
                  daemon SIGTERM--> leaving
        running --desired stop (the controller wrote the job's stop key)--> stopping
        stopping --stop_timeout--> leaving --leave_timeout--> killed (SIGKILL to its group)
        leaving --a plan lists it as left, and it lingers (owner waiting: evict_grace)--> evicted (SIGKILL)
        running | stopping | leaving | killed | evicted --the process exits--> left | finished | crashed | lost

    The first five are live states, the last four end states:
    left: exited after being asked to go (leave or stop), or evicted: it had left
    the job but its process lingered (past evict_grace: normally it exits in ~0.3 s) while
    the GPU's owner waited, so we killed it. finished: exited 0 unasked (its
    training ended). crashed: a non-zero status or a signal (unasked, or while
    leaving), or killed after the grace. lost: an adopted worker (started by an
    earlier daemon, so not our child) ended unasked with an unknown status."""

    RUNNING = "running"
    STOPPING = "stopping"
    LEAVING = "leaving"
    KILLED = "killed"
    EVICTED = "evicted"
    LEFT = "left"
    FINISHED = "finished"
    CRASHED = "crashed"
    LOST = "lost"

    @property
    def live(self) -> bool:
        return self in (WorkerState.RUNNING, WorkerState.STOPPING, WorkerState.LEAVING, WorkerState.KILLED,
                        WorkerState.EVICTED)

    @property
    def asked_to_go(self) -> bool:
        return self in (WorkerState.STOPPING, WorkerState.LEAVING, WorkerState.KILLED, WorkerState.EVICTED)


@dataclass(frozen=True)
class Yield:
    """An owner took the GPU of a slot: its worker left and the slot stays empty
    until a new desired seq lists it again."""

    slot: int
    pid: int
    user: str
    time: float  # wall clock
    signal: str = ""  # "": a process on the GPU; else the owner signal (owner.SIGNALS) that fired

    def to_dict(self) -> dict:
        d = {"slot": self.slot, "pid": self.pid, "user": self.user, "time": self.time}
        if self.signal:
            d["signal"] = self.signal
        return d


@dataclass(frozen=True)
class Memory:
    """What the daemon remembers between ticks, and across its own restarts
    (persisted in `daemon.memory.json`, so a restarted daemon neither re-applies
    a seq it already applied nor reuses a worker id)."""

    seq_applied: int | None = None
    wanted: frozenset[int] = frozenset()  # the slots of the applied seq
    armed: frozenset[int] = frozenset()  # wanted slots still owed a new worker
    yielded: tuple[Yield, ...] = ()
    next_incarnation: int = 1
    leaving: frozenset[str] = frozenset()  # worker ids asked to leave or stop
    urgent: frozenset[str] = frozenset()  # leaving because an owner wants the GPU back

    def to_json(self) -> str:
        return json.dumps({"seq_applied": self.seq_applied, "wanted": sorted(self.wanted),
                           "armed": sorted(self.armed), "yielded": [y.to_dict() for y in self.yielded],
                           "next_incarnation": self.next_incarnation, "leaving": sorted(self.leaving),
                           "urgent": sorted(self.urgent)})

    @classmethod
    def from_json(cls, raw: str | bytes) -> "Memory":
        d = json.loads(raw)
        return cls(seq_applied=d.get("seq_applied"), wanted=frozenset(d.get("wanted", ())),
                   armed=frozenset(d.get("armed", ())),
                   yielded=tuple(Yield(int(y["slot"]), int(y["pid"]), str(y["user"]), float(y["time"]),
                                       str(y.get("signal", "")))
                                 for y in d.get("yielded", ())),
                   next_incarnation=int(d.get("next_incarnation", 1)), leaving=frozenset(d.get("leaving", ())),
                   urgent=frozenset(d.get("urgent", ())))


@dataclass(frozen=True)
class WorkerView:
    slot: int
    worker_id: str
    pid: int
    state: WorkerState
    since: float  # monotonic time the state was entered


@dataclass(frozen=True)
class Foreign:
    """A foreign process on the GPU of a slot."""

    pid: int
    user: str


@dataclass(frozen=True)
class View:
    now: float  # monotonic
    wall: float  # time.time(), for records
    host: str
    desired: Desired | None
    memory: Memory
    workers: tuple[WorkerView, ...] = ()  # live workers
    foreign: Mapping[int, Foreign] = field(default_factory=dict)  # slot -> an owner's process on its GPU
    terminating: bool = False  # SIGTERM: the daemon itself was told to stop
    valid_slots: frozenset[int] | None = None  # None: any non-negative slot
    departed: frozenset[str] = frozenset()  # worker ids a generation plan lists as left or lost
    leave_timeout: float = 120.0
    stop_timeout: float = 300.0
    evict_grace: float = 2.0  # how long a departed worker may linger while the GPU's owner waits
    # Owner signals beyond the GPU (owner.py): `owner_leave` fired (running workers leave,
    # in the planned way: not urgent); `owner_wait`: the start condition does not hold.
    owner_leave: OwnerSignal | None = None
    owner_wait: OwnerSignal | None = None
    owner_pending: bool = False  # signals are watched but not judged yet (a load rate needs two looks)


# ---- actions -----------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    slot: int
    worker_id: str


@dataclass(frozen=True)
class Leave:
    """A planned leave: the runtime's leave key and SIGTERM."""

    slot: int
    worker_id: str
    reason: str


@dataclass(frozen=True)
class MarkStopping:
    """The job is stopping (the controller wrote the stop key): wait for the exit."""

    slot: int
    worker_id: str


@dataclass(frozen=True)
class Kill:
    slot: int
    worker_id: str
    reason: str
    evict: bool = False  # it has already left the job: not a failure


@dataclass(frozen=True)
class RecordYield:
    record: Yield
    worker_id: str | None  # the worker that leaves, None if the slot had none yet


@dataclass(frozen=True)
class Note:
    """Something worth a log line, with no action."""

    message: str


@dataclass(frozen=True)
class Exit:
    reason: str


Action = Start | Leave | MarkStopping | Kill | RecordYield | Note | Exit


@dataclass(frozen=True)
class Decision:
    memory: Memory
    actions: tuple[Action, ...]


def worker_id(host: str, slot: int, incarnation: int) -> str:
    return f"{host}/{slot}/{incarnation}"


def first_incarnation(remembered: int, highest_adopted: int, started_wall: float) -> int:
    """The first worker incarnation a daemon started at `started_wall` may use.

    Worker ids must never repeat in a job: a stale `leave/<id>` or `dead/<id>`
    key of an earlier worker would act on a new one. The daemon's memory file
    is removed on a clean stop and may be lost otherwise, so the start time in
    milliseconds is a floor: a later daemon starts above any id an earlier one
    could have reached (that would take more than one worker start per
    millisecond of its life). The memory and the adopted workers still count,
    for a clock that went back."""
    return max(remembered, highest_adopted + 1, int(started_wall * 1000))


def incarnation_of(worker: str) -> int | None:
    tail = worker.rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else None


def late_slots(listed, wanted: frozenset[int], valid: frozenset[int] | None) -> frozenset[int]:
    """The slots of the applied desired document that were refused at its apply (not in
    `wanted`, which only a new seq changes) and that the host has now (`valid`)."""
    return frozenset(s for s in listed if s not in wanted and (valid is None or s in valid))


def followed_slots(current: frozenset[int] | None, listed) -> frozenset[int] | None:
    """A following daemon's GPU slots after a watch round that listed the GPUs `listed`
    (indices): what nvidia-smi lists now; an empty list says nothing (a glitch, or a
    driver mid-reset: the probe calls it unhealthy) and keeps `current`."""
    seen = frozenset(listed)
    return seen if seen else current


def decide(v: View) -> Decision:
    m = v.memory
    actions: list[Action] = []
    d = v.desired
    if d is not None and m.seq_applied is not None and d.seq < m.seq_applied:
        d = None  # an older document (a replay: StoreLink.floor never hands one on): nothing of it is acted on
    stopping = v.terminating or (d is not None and d.stop)

    # 1. A newer seq. Desired documents only move forward: the controller keeps its
    # seq counter across runs (hosts.json), and an older seq is a replay (the link
    # counts it and never hands it on; StoreLink.floor).
    if d is not None and (m.seq_applied is None or d.seq > m.seq_applied):
        if d.stop:
            m = replace(m, seq_applied=d.seq, wanted=frozenset(), armed=frozenset())
        else:
            valid = [s for s in d.slots if v.valid_slots is None or s in v.valid_slots]
            bad = [s for s in d.slots if s not in valid]
            if bad:
                actions.append(Note(f"desired seq {d.seq} lists slot(s) {bad} that host {v.host} does not have; "
                                    f"they are ignored"))
            wanted = frozenset(valid)
            m = replace(m, seq_applied=d.seq, wanted=wanted, armed=wanted,
                        yielded=tuple(y for y in m.yielded if y.slot not in wanted))
            actions.append(Note(f"host {v.host} applies desired seq {d.seq}: slots {sorted(wanted)}"))
    elif d is not None and not stopping and d.seq == m.seq_applied:
        # 1b. Slots the applied seq listed that the host did not have then and has now (a
        # daemon that follows its GPUs: nvidia-smi lists one it did not): taken up as at
        # the apply, armed once each; the controller need not write the same slots again.
        late = late_slots(d.slots, m.wanted, v.valid_slots)
        if late:
            m = replace(m, wanted=m.wanted | late, armed=m.armed | late,
                        yielded=tuple(y for y in m.yielded if y.slot not in late))
            actions.append(Note(f"host {v.host} now has slot(s) {sorted(late)} that desired seq {d.seq} lists: "
                                f"they are taken up"))

    # 2. Live workers.
    leaving = set(m.leaving)
    urgent = set(m.urgent)
    yielded = list(m.yielded)

    def record_yield(slot: int, wid: str | None, signal: OwnerSignal | None = None) -> None:
        """The owner (v.foreign[slot], else `signal`) has the GPU: remember it (the newest per slot) and say so."""
        if signal is not None:
            rec = Yield(slot, signal.pid, signal.user, v.wall, signal.name)
        else:
            f = v.foreign[slot]
            rec = Yield(slot, f.pid, f.user, v.wall)
        yielded[:] = [y for y in yielded if y.slot != slot] + [rec]
        actions.append(RecordYield(rec, wid))

    by_slot = {w.slot: w for w in v.workers}
    for w in v.workers:
        age = v.now - w.since
        if w.state is WorkerState.RUNNING:
            if v.terminating:
                actions.append(Leave(w.slot, w.worker_id, f"the daemon of host {v.host} was told to stop"))
                leaving.add(w.worker_id)
            elif stopping:
                actions.append(MarkStopping(w.slot, w.worker_id))
                leaving.add(w.worker_id)
            elif w.slot in v.foreign:
                f = v.foreign[w.slot]
                record_yield(w.slot, w.worker_id)
                actions.append(Leave(w.slot, w.worker_id, f"{f.user} (pid {f.pid}) took GPU {w.slot}"))
                leaving.add(w.worker_id)
                urgent.add(w.worker_id)
            elif v.owner_leave is not None:
                record_yield(w.slot, w.worker_id, v.owner_leave)
                actions.append(Leave(w.slot, w.worker_id, f"owner signal: {v.owner_leave.detail}"))
                leaving.add(w.worker_id)
            elif w.slot not in m.wanted and m.seq_applied is not None:
                actions.append(Leave(w.slot, w.worker_id, f"slot {w.slot} is not in desired seq {m.seq_applied}"))
                leaving.add(w.worker_id)
        elif w.state is WorkerState.STOPPING:
            if v.terminating:
                actions.append(Leave(w.slot, w.worker_id, f"the daemon of host {v.host} was told to stop"))
            elif age >= v.stop_timeout:
                actions.append(Leave(w.slot, w.worker_id, f"it did not stop within {v.stop_timeout:g} s"))
        elif w.state is WorkerState.LEAVING:
            if w.slot in v.foreign and not any(y.slot == w.slot for y in yielded):
                # Asked to leave before this daemon saw the owner (a scale-down at the
                # same moment): it is still a yield, and the owner waits.
                record_yield(w.slot, w.worker_id)
                urgent.add(w.worker_id)
            departed = w.worker_id in v.departed
            if departed and w.worker_id in urgent and age >= v.evict_grace:
                actions.append(Kill(w.slot, w.worker_id, "it has left the job and the GPU's owner is waiting",
                                    evict=True))
            elif departed and age >= v.leave_timeout:
                actions.append(Kill(w.slot, w.worker_id, f"it left the job but did not exit within "
                                                         f"{v.leave_timeout:g} s", evict=True))
            elif age >= v.leave_timeout:
                actions.append(Kill(w.slot, w.worker_id, f"it did not leave within {v.leave_timeout:g} s"))

    # 3. Armed slots: one new worker each, unless an owner holds the GPU.
    armed = set(m.armed)
    incarnation = m.next_incarnation
    if stopping:
        armed.clear()
    for slot in sorted(armed):
        w = by_slot.get(slot)
        if w is not None:
            if w.state is WorkerState.RUNNING:
                armed.discard(slot)  # served; a later crash must not restart it by itself
            continue  # the old worker is on its way out: start after it exits
        if v.owner_pending:
            continue  # stays armed until the owner signals are judged
        armed.discard(slot)
        if slot in v.foreign:
            record_yield(slot, None)
            continue
        if v.owner_wait is not None:
            record_yield(slot, None, v.owner_wait)
            continue
        wid = worker_id(v.host, slot, incarnation)
        incarnation += 1
        actions.append(Start(slot, wid))

    live_ids = {w.worker_id for w in v.workers}
    m = replace(m, armed=frozenset(armed), next_incarnation=incarnation, yielded=tuple(yielded),
                leaving=frozenset(w for w in leaving if w in live_ids),
                urgent=frozenset(w for w in urgent if w in live_ids))

    # 4. Done?
    if stopping and not v.workers:
        why = "it was told to stop (SIGTERM)" if v.terminating else "the job is stopping"
        actions.append(Exit(f"every worker of host {v.host} has exited and {why}"))
    return Decision(memory=m, actions=tuple(actions))


# ---- exits -------------------------------------------------------------------


@dataclass(frozen=True)
class ExitOutcome:
    state: WorkerState
    report_dead: bool  # dead/<worker_id> for the runtime (survivors abort at once)
    crash_event: bool  # an event of kind crash
    detail: str
    # A crash before its first step: it exited unasked with a non-zero status (or a
    # signal) before any generation plan the daemon read listed it as a member.
    at_start: bool = False


CAUSE_MAX = 300  # characters of a cause line kept in events and the state document
TAIL_BYTES = 64 * 1024  # how much of the end of a worker's log is read for its cause


def cause_line(output: str) -> str:
    """The line of a failed worker's output that says why: the exception line of
    the last Python traceback (`ModuleNotFoundError: No module named 'foo'`), else
    the last non-empty line (`python: can't open file '/x/trian.py': [Errno 2] No
    such file or directory`); "" for no output. Cut to CAUSE_MAX characters."""
    lines = [ln.rstrip() for ln in output.replace("\r", "\n").splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    if not lines:
        return ""
    found = ""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if starts:
        for ln in lines[starts[-1] + 1:]:
            if not ln[0].isspace():
                found = ln  # the first unindented line after the frames: the exception
                break
    line = (found or lines[-1]).strip()
    return line if len(line) <= CAUSE_MAX else line[:CAUSE_MAX - 1] + "…"


def describe_status(returncode: int | None) -> str:
    if returncode is None:
        return "exit status unknown (started by an earlier daemon)"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def exit_outcome(returncode: int | None, state: WorkerState, *, left_job: bool = False,
                 job_done: bool = False, joined: bool = True) -> ExitOutcome:
    """What the exit of a worker in `state` means. returncode None: unknown
    (an adopted worker is not our child). A death is reported whenever it might
    matter: a worker killed by SIGTERM before the runtime installed its handler
    may still sit in the join queue; an adopted worker that was asked to go and
    is gone is taken to have left (it was started long ago, well past that).
    For an adopted worker the store tells the rest: `left_job` (a generation
    plan lists it as left or lost) or `job_done` (the runtime's `done` key):
    then its exit is an end, not a loss (a finished worker exits in ~0.3 s,
    often before the daemon has seen a stop request). `joined`: a generation plan
    listed it as a member (it reached the job); an unasked crash of one that never
    did failed at start (`at_start`)."""
    status = describe_status(returncode)
    if returncode is None and state in (WorkerState.RUNNING, WorkerState.STOPPING) and (left_job or job_done):
        return ExitOutcome(WorkerState.LEFT if left_job else WorkerState.FINISHED, False, False,
                           f"{status}; it had " + ("left the job" if left_job else "seen the job end"))
    if state is WorkerState.EVICTED:
        return ExitOutcome(WorkerState.LEFT, False, False, f"{status} after it had left the job")
    if state is WorkerState.KILLED:
        return ExitOutcome(WorkerState.CRASHED, True, True, f"{status}: it did not leave in time")
    if state.asked_to_go:
        if returncode == 0:
            return ExitOutcome(WorkerState.LEFT, False, False, status)
        if returncode is None:  # adopted: long past start-up, so it left through the runtime
            return ExitOutcome(WorkerState.LEFT, False, False, status)
        if returncode == -signal.SIGTERM:
            return ExitOutcome(WorkerState.LEFT, True, False, status)
        return ExitOutcome(WorkerState.CRASHED, True, True, f"{status} while leaving")
    if returncode == 0:
        return ExitOutcome(WorkerState.FINISHED, False, False, status)
    if returncode is None:
        return ExitOutcome(WorkerState.LOST, True, True, status)
    if not joined:
        return ExitOutcome(WorkerState.CRASHED, True, True, f"failed at start ({status} before its first step)",
                           at_start=True)
    return ExitOutcome(WorkerState.CRASHED, True, True, status)

"""Membership by generations: the store keys, the plan of a generation, and the
pure decisions about who is in the next one.

A generation is an immutable plan, written once (compare_set, so exactly one
proposer wins) under `gen/<g>/plan`: the worker ids in rank order, who joined,
who left or died, and how far the join queue has been consumed. Each generation
gets its own process group on the fresh store prefix `gen/<g>/pg`. Everything
here is pure or a thin store helper; the executor lives in job.py.

Generation life::

    proposed (compare_set of gen/<g>/plan) -> running -> changing
        changing --planned boundary (join/leave)--> proposed(g+1)
        changing --abort key / dead key / stale heartbeat--> roll call -> proposed(g+1)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Iterable, Protocol


class Store(Protocol):
    """The part of c10d's Store the runtime uses (TCPStore, PrefixStore)."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...


class EventKind(str, Enum):
    """The kind of an entry of the job's event log (`events/<n>`).

    Written by the runtime's rank 0 at the first step of a new generation:
    START, JOIN, LEAVE, CRASH, HANG, RESTORE; and STOP when the job stops.
    Written by a host daemon: YIELD (a GPU's owner is back; the worker there
    leaves) and CRASH (a worker process exited without being asked). DONE is
    a plan kind only (never logged today)."""

    START = "start"
    JOIN = "join"
    LEAVE = "leave"
    CRASH = "crash"
    HANG = "hang"
    RESTORE = "restore"
    STOP = "stop"
    DONE = "done"
    YIELD = "yield"


class Keys:
    """Store keys, relative to the job's PrefixStore (documented in README.md)."""

    JOIN_SEQ = "join/seq"
    DEAD_SEQ = "dead/seq"
    STOP = "stop"
    DONE = "done"
    STATUS = "status"
    EVENTS_SEQ = "events/seq"

    @staticmethod
    def heartbeat(worker: str) -> str:
        return f"hb/{worker}"

    @staticmethod
    def join(seq: int) -> str:
        return f"join/{seq}"

    @staticmethod
    def leave(worker: str) -> str:
        return f"leave/{worker}"

    @staticmethod
    def dead(worker: str) -> str:
        return f"dead/{worker}"

    @staticmethod
    def plan(gen: int) -> str:
        return f"gen/{gen}/plan"

    @staticmethod
    def abort(gen: int) -> str:
        return f"gen/{gen}/abort"

    @staticmethod
    def alive(gen: int, worker: str) -> str:
        return f"gen/{gen}/alive/{worker}"

    @staticmethod
    def pg_prefix(gen: int) -> str:
        return f"gen/{gen}/pg"

    @staticmethod
    def event(n: int) -> str:
        return f"events/{n}"


@dataclass(frozen=True)
class Plan:
    generation: int
    members: tuple[str, ...]
    join_upto: int = 0
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    kind: EventKind = EventKind.START
    created: float = field(default=0.0, compare=False)

    def rank_of(self, worker: str) -> int | None:
        return self.members.index(worker) if worker in self.members else None

    @property
    def world_size(self) -> int:
        return len(self.members)

    def to_json(self) -> str:
        d = asdict(self)
        d["kind"] = self.kind.value
        return json.dumps(d)

    @classmethod
    def from_json(cls, raw: str | bytes) -> "Plan":
        d = json.loads(raw)
        return cls(
            generation=int(d["generation"]),
            members=tuple(d["members"]),
            join_upto=int(d["join_upto"]),
            joined=tuple(d["joined"]),
            left=tuple(d["left"]),
            lost=tuple(d["lost"]),
            kind=EventKind(d["kind"]),
            created=float(d["created"]),
        )


def propose(
    current: Plan | None,
    survivors: Iterable[str],
    queued_joiners: Iterable[tuple[int, str]],
    scanned_upto: int,
    max_workers: int | None,
    kind: EventKind,
    now: float,
) -> Plan:
    """The next generation: survivors keep their relative order, queued joiners
    (join sequence number, worker id) are appended in queue order up to the
    cap. join_upto records how far the join queue is consumed (scanned_upto,
    which also skips joiners reported dead); joiners beyond the cap stay queued."""
    survivors = tuple(survivors)
    members = list(survivors)
    join_upto = max(current.join_upto if current else 0, scanned_upto)
    joined = []
    for seq, worker in sorted(queued_joiners):
        if max_workers is not None and len(members) >= max_workers:
            join_upto = seq - 1
            break
        if worker not in members:
            members.append(worker)
            joined.append(worker)
    before = current.members if current else ()
    gone = tuple(w for w in before if w not in survivors)
    planned = kind in (EventKind.LEAVE, EventKind.JOIN, EventKind.STOP)
    if kind is EventKind.LEAVE and joined and not gone:
        kind = EventKind.JOIN
    return Plan(
        generation=(current.generation + 1) if current else 0,
        members=tuple(members),
        join_upto=join_upto,
        joined=tuple(joined),
        left=gone if planned else (),
        lost=() if planned else gone,
        kind=kind,
        created=now,
    )


class Verdict(str, Enum):
    SURVIVOR = "survivor"
    GONE = "gone"
    UNKNOWN = "unknown"


def roll_call(alive: bool, dead: bool, silent_for_s: float, hang_timeout_s: float) -> Verdict:
    """Whether a member of an aborted generation goes on. A reported death wins;
    then an answer to the roll call; a heartbeat silent past the hang timeout
    means hung or partitioned; otherwise wait a little longer."""
    if dead:
        return Verdict.GONE
    if alive:
        return Verdict.SURVIVOR
    if silent_for_s >= hang_timeout_s:
        return Verdict.GONE
    return Verdict.UNKNOWN


@dataclass(frozen=True)
class Transfer:
    source: int  # rank that holds (or loads) the state everyone adopts
    needed: bool  # False when every member already holds the same committed state
    restore: bool  # nobody holds state: the source loads the newest checkpoint


def choose_source(reports: list[tuple[bool, int]]) -> Transfer:
    """reports[rank] = (holds training state, committed step). The source is the
    lowest rank holding the highest committed step (after a crash some ranks may
    have committed a step the others did not)."""
    holders = [(step, -rank) for rank, (has, step) in enumerate(reports) if has]
    if not holders:
        return Transfer(source=0, needed=True, restore=True)
    step, neg_rank = max(holders)
    needed = any((not has) or s != step for has, s in reports)
    return Transfer(source=-neg_rank, needed=needed, restore=False)


# ---- thin helpers for launchers, daemons and the control plane -------------


def job_store(store, job: str):
    """The PrefixStore every key of `job` lives under."""
    import torch.distributed as dist

    return dist.PrefixStore(f"eltctl/{job}", store)


def report_dead(store, job: str, worker_id: str) -> None:
    """Tell the job that a worker process is gone (the launcher or host daemon
    saw it exit). Survivors abort the current generation at once instead of
    waiting for a collective timeout."""
    js = job_store(store, job)
    js.set(Keys.dead(worker_id), str(time.time()))
    js.add(Keys.DEAD_SEQ, 1)


def request_leave(store, job: str, worker_id: str) -> None:
    """Ask a worker to leave at the next step boundary (planned: no step lost)."""
    job_store(store, job).set(Keys.leave(worker_id), str(time.time()))


def request_stop(store, job: str) -> None:
    """Ask the whole job to checkpoint and exit cleanly at the next boundary."""
    job_store(store, job).set(Keys.STOP, str(time.time()))


def append_event(store, job: str, event: dict) -> int:
    """Append one event to the job's log (`events/seq` counter, `events/<n>`)
    and return its number. `event["kind"]` must be an EventKind value; `time`
    (wall clock) is added when missing. Used by the runtime and the host
    daemon alike, so the log has one numbering and one vocabulary."""
    doc = dict(event, kind=EventKind(event["kind"]).value)  # ValueError for an unknown kind
    doc.setdefault("time", time.time())
    js = job_store(store, job)
    n = js.add(Keys.EVENTS_SEQ, 1)
    js.set(Keys.event(n), json.dumps(doc))
    return n


def read_status(store, job: str) -> dict | None:
    js = job_store(store, job)
    return json.loads(js.get(Keys.STATUS)) if js.check([Keys.STATUS]) else None


def read_events(store, job: str, start: int = 1) -> list[dict]:
    """Membership events from number `start` on (numbers begin at 1)."""
    js = job_store(store, job)
    last = js.add(Keys.EVENTS_SEQ, 0)
    out = []
    for n in range(start, last + 1):
        if js.check([Keys.event(n)]):
            out.append(json.loads(js.get(Keys.event(n))))
    return out

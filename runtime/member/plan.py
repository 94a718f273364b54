"""Membership by generations: the plan of a generation, and the pure decisions
about who is in the next one.

A generation is an immutable plan, written once (compare_set, so exactly one
proposer wins) under `gen/<g>/plan`: the worker ids in rank order, who joined,
who left or died, and how far the join queue has been consumed. Each generation
gets its own process group on the fresh store prefix `gen/<g>/pg`. Everything
here is pure or a thin store helper; the executor lives in train/job.py.

The store keys themselves (`Keys`), the event kinds and the store helpers are
the wire protocol: protocol.py.

Generation life::

    proposed (compare_set of gen/<g>/plan) -> running -> changing
        changing --planned boundary (join/leave)--> proposed(g+1)
        changing --abort key / dead key / stale heartbeat--> roll call -> proposed(g+1)
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Callable, Iterable

from ..store.auth import ForgedValue, signed
from ..protocol import PLANNED, EventKind, Keys, claim, counter_hint, first_generation, job_prefix, peek, peek_many, scan, wait_written

log = logging.getLogger("eltctl_runtime")


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


def host_of(worker: str) -> str:
    """The host of a worker id: its first "/"-part (`host/slot/pid`, the daemon's ids),
    else the whole id."""
    return worker.split("/", 1)[0]


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
    planned = kind in PLANNED
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


def receivers(reports: list[tuple[bool, int]], transfer: Transfer) -> list[int]:
    """The ranks that must adopt the source's state (choose_source): every rank but the
    source after a restore; otherwise those without state or at another committed step.
    A rank that already holds the source's committed step holds the same state."""
    if not transfer.needed:
        return []
    best = None if transfer.restore else reports[transfer.source][1]
    return [r for r, (has, step) in enumerate(reports)
            if r != transfer.source and (transfer.restore or not has or step != best)]


# ---- store helpers shared by ElasticJob (train/job.py) and the restart supervisor (restart/supervisor.py)


def scan_joiners(store, after: int) -> tuple[list[tuple[int, str]], int]:
    """Live joiners queued after sequence number `after` (sequence number, worker
    id), and how far the scan got (the last number that held a joiner). `store` is
    scoped to the job.

    The join queue is a log of `join/<n>` entries that joiners write with
    protocol.claim (the first free number past the queue's end, by compare_set), so
    its entries form one run and the scan reads that run (protocol.scan) without
    looking at `join/seq`: that counter is unsigned, and anyone who reaches the store
    can move it (a joiner hidden by a counter raised by 10^6 is still found). Missing
    and forged entries are skipped (a few in a row end the queue), and so are
    joiners reported dead. At most protocol.READ_WINDOW numbers per scan."""
    queue: list[tuple[int, str]] = []
    found, upto = scan(store, Keys.join, after)
    workers = [raw.decode(errors="replace") for _seq, raw in found]
    # the death reports of every joiner found, in one request (protocol.peek_many)
    dead = peek_many(store, [Keys.dead(w) for w in dict.fromkeys(workers)]) if workers else []
    dead_of = dict(zip(dict.fromkeys(workers), dead))
    for (seq, _raw), worker in zip(found, workers):
        if dead_of[worker] is None and all(w != worker for _, w in queue):
            queue.append((seq, worker))
    return queue, upto


def read_verified(store, key: str) -> bytes | None:
    """The value of `key`, or None when it is absent or (signed store) forged
    (protocol.peek: one store call that never waits)."""
    return peek(store, key)


def _register(store, me: str, after: int = 0) -> int:
    """Queue `me` as a joiner past number `after` (the newest plan's join_upto): the
    first free `join/<n>` (protocol.claim; `join/seq` is only its first guess)."""
    seq = claim(store, Keys.join, after, me, hint=counter_hint(store, Keys.JOIN_SEQ))
    log.info("%s: waiting to be admitted (join #%d)", me, seq)
    return seq


REGISTERED_CHECK_S = 1.0  # how often a waiting joiner checks that its entry is still there


def _queue_consumed(store) -> int:
    """How far the newest plan consumed the join queue (its join_upto; 0 before any
    plan): a joiner registers past it."""
    g = first_generation(store)
    if not store.check([Keys.plan(g)]):
        return 0
    while store.check([Keys.plan(g + 1)]):
        g += 1
    try:
        return Plan.from_json(store.get(Keys.plan(g))).join_upto
    except (ForgedValue, ValueError, KeyError):
        return 0


def decide(store, proposal: Plan) -> Plan:
    """compare_set: the first proposal for a generation wins; everyone adopts it."""
    return Plan.from_json(store.compare_set(Keys.plan(proposal.generation), "", proposal.to_json()))


def await_admission(store, me: str, control, *, min_workers: int, max_workers: int | None,
                    hang_timeout_s: float, give_up: Callable[[], bool] = lambda: False,
                    poll_s: float = 0.02, restarted_wait_s: float = 120.0) -> "Plan | None":
    """Register `me` as a (warm) joiner and wait until a generation's plan names
    it; returns that plan, or None once the job is done or `give_up()` says so.

    While waiting it helps decide: the first joiners form generation 0 once
    `min_workers` are queued, and when every member of the newest plan is dead
    or silent (nobody is left to admit anyone) the queued joiners form the next
    one, restoring the job. `control` is the caller's ControlThread (its
    silence measures and who it watches). Shared by ElasticJob and the restart
    supervisor.

    In a store the controller restarted (store/loss.py), plans start at the
    generation the members re-published (`first_generation`), and before that no
    generation 0 is formed for `restarted_wait_s`: the members may be about to
    re-publish theirs."""
    from ..store.loss import restarted_store_waits

    seq = _register(store, me, _queue_consumed(store))
    first, known = 0, -1
    orphan_watch: tuple[str, ...] = ()
    waiting_since: float | None = None
    next_check = time.monotonic() + REGISTERED_CHECK_S
    while True:
        if store.check([Keys.DONE]):
            log.info("%s: the job is already finished; nothing to do", me)
            return None
        if give_up():
            return None
        if known < first:  # no plan seen yet: in a restarted store they start at gen/first
            first = first_generation(store)
            known = first - 1
        while store.check([Keys.plan(known + 1)]):
            known += 1
        if known >= first:
            plan = Plan.from_json(store.get(Keys.plan(known)))
            if me in plan.members:
                return plan
            if plan.join_upto >= seq:
                # The plan consumed our number without admitting us (the scan skipped
                # it: raised counter, or our id came after the scan): take a new one.
                log.info("%s: generation %d consumed join #%d without admitting it; registering again", me,
                         plan.generation, seq)
                seq = _register(store, me, plan.join_upto)
            elif time.monotonic() >= next_check:
                next_check = time.monotonic() + REGISTERED_CHECK_S
                if read_verified(store, Keys.join(seq)) != me.encode():
                    # deleted (or overwritten) by someone who reaches the store: queue again
                    log.warning("%s: its join entry #%d is gone; registering again", me, seq)
                    seq = _register(store, me, plan.join_upto)
            if plan.members != orphan_watch:
                orphan_watch = plan.members
                control.watch(None, others=plan.members)
            # Nobody left to admit us (every member died): restart the job.
            gone = all(store.check([Keys.dead(w)]) or control.silence(w) >= hang_timeout_s for w in plan.members)
            if gone:
                queue, upto = scan_joiners(store, plan.join_upto)
                if len(queue) >= min_workers:
                    decide(store, propose(plan, [], queue, upto, max_workers, EventKind.RESTORE, time.time()))
                    continue
        else:
            if restarted_store_waits(store):  # the members are about to re-publish their plan
                waiting_since = waiting_since or time.monotonic()
                if time.monotonic() - waiting_since < restarted_wait_s:
                    time.sleep(poll_s)
                    continue
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + REGISTERED_CHECK_S
                if read_verified(store, Keys.join(seq)) != me.encode():
                    log.warning("%s: its join entry #%d is gone; registering again", me, seq)
                    seq = _register(store, me)
            queue, upto = scan_joiners(store, 0)
            if len(queue) >= min_workers:
                decide(store, propose(None, [], queue, upto, max_workers, EventKind.START, time.time()))
                continue
        wait_written(store, Keys.plan(known + 1), poll_s)  # woken by the next plan at once


# ---- the job's PrefixStore -------------------------------------------------


def job_store(store, job: str, secret: bytes | None = None, forgeries=None, run: str = ""):
    """The PrefixStore every key of `job` lives under (the generations' process
    groups form on pgstore.pg_store(...) of it). With the job's `secret` it is signed
    (auth.SignedStore: every value written is signed, every value read is
    checked; forged ones are counted in `forgeries`, an auth.Forgeries shared by
    a process's connections) in the store's run `run` (auth.py: a value of another
    run reads as forged; callers read the run file at every connect). Every job store
    of the runtime and the daemon is built here. The protocol's helpers need no torch: protocol.scope."""
    from ..store.client import prefix_store  # keeps a SocketStore client alive with it

    return signed(prefix_store(job_prefix(job), store), job_prefix(job), secret, forgeries, run)

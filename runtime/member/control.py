"""The out-of-band control channel: a background thread per worker.

It has its own store connection, so it keeps working while the training thread
is blocked in a collective. Every poll (~30 ms) it writes this worker's
heartbeat and reads: the job-wide stop key, a leave request for this worker, the
current generation's abort key, the members' death reports, and (every ~150 ms)
the head of the join queue and the members' heartbeats; all of it in one round trip to the
keeper's store (one pipelined write, then one PEEK: protocol.set_and_peek).
Anything that makes the generation unusable (a member reported dead, a member silent past the hang
timeout, the abort key) sets the abort event that every collective wait
watches, and writes the abort key so that every other member leaves its wait
too. It decides nothing else: the training thread acts at the next boundary.

No unsigned counter decides anything here (anyone who reaches the store can move
one): a joiner is seen by reading the join queue's entries (membership.scan_joiners),
death reports are read at every poll (`dead/seq` is not looked at), and a
member's silence is judged on its beat numbers (an older beat written back is no news). A
heartbeat that was there and reads as missing was deleted by someone: it is counted
and watched for its writer's next write (protocol.watch_deleted), so a member that
keeps writing is not taken for silent; one that stopped is, at the hang timeout.

When the store goes away (its keeper died; store/loss.py) it reports no request
(nothing that needs the store starts), counts the failure in the shared
`StoreHealth` and connects again through its factory until the store is back.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from .plan import Plan, scan_joiners
from ..protocol import Keys, set_and_peek, watch_deleted
from ..store.loss import BACK_GRACE_S, RECONNECT_EVERY_S, StoreHealth

log = logging.getLogger("eltctl_runtime")

# One poll (a signed round trip to the keeper's store) costs a worker about 5 ms of CPU here,
# most of it outside the GIL (the socket, the wake-ups): at 30 ms a worker spent 0.17 of a core
# on it, 0.05 at 100 ms (5 workers of a job_env test, /proc per-thread ticks), and
# benchmarks/resize.py's steady step against DDP went from +6.6 % to -2.8 % (5 rounds each,
# side by side) with its leave, join and SIGKILL pauses still 0.05-0.11 s. A crash's report or
# a leave request is read at most 100 ms after it is written.
POLL_S = 0.1
MEMBER_POLL_S = 0.15
JOIN_RESCAN_S = 1.0
# per member pass: how long a deleted heartbeat is watched for its writer's next write (every POLL_S)
DELETED_PROBE_S = 2 * POLL_S
CONTESTED_LIMIT = 3  # hang timeouts a heartbeat may be rewritten-and-deleted without one verified beat read


@dataclass(frozen=True)
class Requests:
    """What is pending at the next step boundary, as seen by this worker."""

    leave: bool = False
    stop: bool = False
    join: bool = False

    @property
    def any(self) -> bool:
        return self.leave or self.stop or self.join


def newer_beat(value: bytes, old: bytes) -> bool:
    """Whether heartbeat `value` is news after `old`: the writer's beat number went up
    (an older signed beat written back by someone is not news of a live writer)."""
    try:
        return int(value) > int(old)
    except ValueError:
        return value != old


class ControlThread:
    def __init__(self, store_factory, worker_id: str, hang_timeout_s: float, max_workers: int | None,
                 health: StoreHealth | None = None) -> None:
        self._store_factory = store_factory
        self._health = health  # None: a store error is only logged (no reconnect)
        self._me = worker_id
        self._hang = hang_timeout_s
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._plan: Plan | None = None
        self._watch: tuple[str, ...] = ()
        self._abort = threading.Event()
        self._abort_reason = ""
        self._seen: dict[str, tuple[bytes, float]] = {}  # worker -> (last heartbeat value, when it changed)
        # worker -> when a newer verified beat of it was last read (`_seen` also counts a
        # contested heartbeat, one rewritten and deleted before it could be read)
        self._verified_at: dict[str, float] = {}
        self._dead: set[str] = set()
        self._local_leave = False
        self._requests = Requests()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = 0
        self._join_key: int | None = None  # the plan's join_upto of the last scan
        self._join_found = False
        self._join_next = self._join_scanned = 0.0
        self._had_beat: set[str] = set()  # members whose heartbeat this thread has read verified

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        self._store = self._store_factory()
        self._store.set(Keys.heartbeat(self._me), "0")
        self._thread = threading.Thread(target=self._run, name="eltctl-control", daemon=True)
        self._thread.start()

    def close(self, wait_s: float = 0.1) -> None:
        """Stop the thread. It is a daemon thread with nothing to hand over: one
        blocked in a store call (the store is slow or gone) is left behind
        rather than waited for, so a leaving worker exits at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=wait_s)

    # -- what the training thread tells it -----------------------------------
    def watch(self, plan: Plan | None, others: tuple[str, ...] = ()) -> threading.Event:
        """Follow generation `plan` (or, for a waiting joiner, just `others`):
        returns the fresh abort event for it."""
        with self._lock:
            self._plan = plan
            self._watch = tuple(w for w in (plan.members if plan else others) if w != self._me)
            self._abort = threading.Event()
            self._abort_reason = ""
            now = time.monotonic()
            for w in self._watch:  # silence is measured from when we start watching
                v = self._seen.get(w)
                self._seen[w] = (v[0] if v else b"", now)
                self._verified_at[w] = now
            return self._abort

    def request_local_leave(self) -> None:
        """SIGTERM: leave at the next boundary."""
        self._local_leave = True

    @property
    def requests(self) -> Requests:
        return self._requests

    def silence(self, worker: str) -> float:
        with self._lock:
            v = self._seen.get(worker)
            return time.monotonic() - v[1] if v else 0.0

    def is_dead(self, worker: str) -> bool:
        with self._lock:
            return worker in self._dead

    def abort_reason(self) -> str:
        return self._abort_reason

    # -- the loop -------------------------------------------------------------
    def _run(self) -> None:
        next_members = 0.0
        while not self._stop.is_set():
            try:
                if self._poll(next_members):
                    next_members = time.monotonic() + MEMBER_POLL_S
            except Exception as e:  # noqa: BLE001 - the store went away: the job is over or unreachable
                if self._health is None:
                    log.warning("worker %s: control channel error: %s", self._me, e)
                    self._stop.wait(0.5)
                else:
                    self._requests = Requests()  # nothing that needs the store starts while it is away
                    self._health.failed("control channel", e)
                    self._reconnect()
            self._stop.wait(POLL_S)

    def _poll(self, next_members: float) -> bool:
        """One poll: this worker's heartbeat written and everything it watches read in one
        round trip (protocol.set_and_peek: one pipelined write and one PEEK on the
        keeper's store), every value read verified as before. Returns whether it was a
        member pass (the members' heartbeats and death reports read)."""
        self._beat += 1
        st = self._store
        with self._lock:
            plan, watch, abort = self._plan, self._watch, self._abort
        now = time.monotonic()
        members = bool(watch) and now >= next_members  # the members' heartbeats, every MEMBER_POLL_S
        keys = [Keys.STOP, Keys.leave(self._me)]
        abort_key = Keys.abort(plan.generation) if plan is not None and not abort.is_set() else None
        if abort_key is not None:
            keys.append(abort_key)
        join_key = self._join_head_due(plan, now) if plan is not None else None
        if join_key is not None:
            keys.append(join_key)
        # the members' death reports, read whatever `dead/seq` says (it is unsigned), at every
        # poll: a crash aborts the generation within one poll of its report, so the survivors
        # drop the step in flight at once (at world 4 on 2 cores, every 150 ms left a crash's
        # step running on for 0.1-0.2 s more); the heartbeats wait for a member pass
        dead_keys = {Keys.dead(w): w for w in watch if w not in self._dead}
        beat_keys = [Keys.heartbeat(w) for w in watch] if members else []
        read = keys + list(dead_keys) + beat_keys
        values = dict(zip(read, set_and_peek(st, [(Keys.heartbeat(self._me), str(self._beat))], read)))
        stop = values[Keys.STOP] is not None
        leave = self._local_leave or values[Keys.leave(self._me)] is not None
        join = False
        if plan is not None:
            room = self._max_workers is None or plan.world_size < self._max_workers
            join = room and self._joiner_waiting(st, plan, values.get(join_key) if join_key else None,
                                                 join_key is not None, now)
            if abort_key is not None and values[abort_key] is not None:
                self._set_abort(abort, values[abort_key].decode(), write=None)
        self._requests = Requests(leave=leave, stop=stop, join=join)
        reported = [w for key, w in dead_keys.items() if values[key] is not None]
        if reported:
            with self._lock:
                self._dead.update(reported)
            if plan is not None and not abort.is_set():
                self._check_members(plan, watch, abort, now)
        if not members:
            return False
        probe_until = now + DELETED_PROBE_S
        for w in watch:
            value = values[Keys.heartbeat(w)]
            contested = False
            if value is None and w in self._had_beat:
                # no writer deletes a heartbeat: watch for its writer's next write
                value, contested = watch_deleted(st, Keys.heartbeat(w), probe_until - time.monotonic())
            if value is None:
                if contested:  # rewritten, then deleted before it was read: not silence
                    with self._lock:
                        self._seen[w] = (self._seen.get(w, (b"", now))[0], now)
                continue  # none yet, or forged: no news of w (its silence goes on)
            self._had_beat.add(w)
            with self._lock:
                old = self._seen.get(w)
                if old is None or newer_beat(value, old[0]):
                    self._seen[w] = (value, now)
                    self._verified_at[w] = now
        if plan is not None and not abort.is_set():
            self._check_members(plan, watch, abort, now)
        return True

    def _join_head_due(self, plan: Plan, now: float) -> str | None:
        """The join entry past the plan's join_upto when this poll reads it (every
        MEMBER_POLL_S until a joiner is found), else None."""
        if plan.join_upto != self._join_key:
            self._join_key, self._join_found, self._join_next = plan.join_upto, False, 0.0
        if self._join_found or now < self._join_next:
            return None
        self._join_next = now + MEMBER_POLL_S
        return Keys.join(plan.join_upto + 1)

    def _joiner_waiting(self, st, plan: Plan, head: bytes | None, read: bool, now: float) -> bool:
        """Whether a verified, live joiner is queued past the plan's join_upto. The queue
        is read as a run of entries (membership.scan_joiners), never through the unsigned
        `join/seq`: its head (`head`, read by this poll when `read`) every MEMBER_POLL_S,
        and the whole run when the head holds an entry, and every JOIN_RESCAN_S anyway (a
        deleted entry may stand in the way); once found, until the plan changes."""
        if self._join_found:
            return True
        if not read or (head is None and now < self._join_scanned + JOIN_RESCAN_S):
            return False
        self._join_scanned = now
        queue, _ = scan_joiners(st, plan.join_upto)
        self._join_found = any(w not in plan.members for _, w in queue)
        return self._join_found

    def _reconnect(self) -> None:
        """A fresh client through the job's own factory (the same wrapping as at
        the start), until it works or the thread stops."""
        while not self._stop.is_set():
            try:
                store = self._store_factory()
                store.set(Keys.heartbeat(self._me), str(self._beat))
            except Exception as e:  # noqa: BLE001 - not back yet
                self._health.failed("reconnecting", e)
                self._stop.wait(RECONNECT_EVERY_S)
                continue
            self._store = store
            later = time.monotonic() + BACK_GRACE_S
            with self._lock:  # the members' silence is measured again, from a little later
                self._seen = {w: (b"", later) for w in self._seen}
                self._verified_at = {w: later for w in self._seen}
            self._had_beat.clear()  # a new store: a heartbeat not yet in it was not deleted
            self._health.back()
            return

    def _check_members(self, plan: Plan, watch: tuple[str, ...], abort: threading.Event, now: float) -> None:
        for w in watch:
            if w in self._dead:
                self._set_abort(abort, json.dumps({"reason": "crash", "worker": w}), write=plan.generation)
                return
            silent = now - self._seen[w][1]
            if now - self._verified_at.get(w, now) >= CONTESTED_LIMIT * self._hang:
                silent = max(silent, now - self._verified_at[w])  # contested too long: judged on verified beats
            if silent >= self._hang:
                self._set_abort(abort, json.dumps({"reason": "hang", "worker": w, "silent_s": round(silent, 2)}),
                                write=plan.generation)
                return

    def _set_abort(self, abort: threading.Event, reason: str, write: int | None) -> None:
        if write is not None:
            self._store.compare_set(Keys.abort(write), "", reason)
            log.warning("worker %s: aborting generation %d: %s", self._me, write, reason)
        self._abort_reason = reason
        abort.set()

"""The host daemon's link to the job's store (served by the store keeper; eltctl_runtime.store.client).

One background thread owns the connection, so a store that has gone away (the
control machine rebooted, the store keeper was killed) never blocks the
daemon's loop, which goes on watching GPUs and reaping workers. The thread:

* connects as a client (the job's PrefixStore, `membership.job_store`, signed in
  the store's run: the run file is read at every connect, so a restarted keeper's
  new run id is picked up, auth.py), and on
  any error drops the connection and retries with back-off (0.5 s doubling to
  10 s), logging once per outage; each retry first reads the store address file
  beside the run file (the direct mode: a keeper restarted on a new port wrote it;
  `storeloss.StoreAddress`), and the workers it starts from then on are given that
  address (`address`);
* reads `daemon/<host>/desired` about every `poll_s` and hands the newest
  verified value to the loop (`desired()`; with the job's secret a forged
  document is counted and ignored: the last verified one stands; so is one whose seq
  is below the newest seen or the daemon applied, `floor`: desired documents only
  move forward), and follows the runtime's generation plans
  and its `done` key to learn which of this host's workers are out of the job
  (`departed()`, `job_done`) and which reached it (`joined()`: listed as members);
  after a reconnect it follows the new store's plans from its first one (a
  restarted keeper's store starts at the generation the workers re-published,
  `protocol.first_generation`), keeping what it learned before;
* writes the newest state document the loop published (`publish_state`; the
  loop publishes about once a second), stamping its `time` and `store`
  (`{connected, reconnects, last_error}`);
* delivers queued messages (`send`: leave and death reports, events) in order;
  while the store is away they wait (bounded), and are delivered on reconnect.

The daemon never kills a worker because this link is down.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from typing import Callable

from ..store.auth import ForgedValue, Forgeries, read_run_id
from ..member.plan import Plan, job_store
from ..protocol import Desired, Keys, first_generation, get_desired, state_key
from ..store.loss import StoreAddress

log = logging.getLogger("eltctl_runtime.daemon")

MAX_OUTBOX = 1000
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0


# An outbox message: (what, function(the job's PrefixStore)), e.g. protocol.put_dead.
Message = tuple[str, Callable[[object], None]]


class StoreLink:
    def __init__(self, address: str, job: str, host: str, *, poll_s: float = 0.25,
                 connect_timeout_s: float = 5.0, secret: bytes | None = None,
                 forgeries: Forgeries | None = None, run_file=None) -> None:
        # unix:/path, tcp:host:port or host:port (eltctl_runtime.store.server); a tcp: one follows its keeper
        self._address = StoreAddress(address, run_file)
        self._job = job
        self._host = host
        self._secret = secret  # the job's: every value read is checked, every value written signed
        self._forgeries = forgeries
        self._run_file = run_file  # the store's run id (auth.py), read at every connect
        self._poll_s = poll_s
        self._connect_timeout = connect_timeout_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._desired: Desired | None = None
        self._floor: int | None = None  # the seq the daemon applied last (its memory)
        self._replayed: int | None = None  # the last replayed seq counted
        self._state: dict | None = None
        self._state_dirty = False
        self._outbox: collections.deque[Message] = collections.deque()
        self._connected = False
        self._last_ok: float | None = None  # wall time of the last successful exchange
        self._error = ""
        self._last_error = ""  # the cause of the last outage, kept after reconnecting
        self._reconnects = 0
        self._generation = -1  # the newest generation plan read from this store
        self._departed: frozenset[str] = frozenset()  # this host's workers that a plan lists as left or lost
        self._joined: frozenset[str] = frozenset()  # this host's workers that a plan lists as members
        self._job_done = False  # the runtime wrote `done` (the job finished or stopped)
        self._done_reason = ""  # its reason: "finished", "stop", ...
        self._thread: threading.Thread | None = None

    # -- the loop's side ---------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="eltctl-daemon-store", daemon=True)
        self._thread.start()

    def close(self, flush_s: float = 5.0) -> None:
        """Deliver what is queued (waiting at most flush_s while connected), then stop."""
        deadline = time.monotonic() + flush_s
        while time.monotonic() < deadline:
            with self._lock:
                idle = not self._outbox and not self._state_dirty
                connected = self._connected
            if idle or not connected:
                break
            self._wake.set()
            time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)  # a daemon thread: a connect attempt in flight dies with us

    def desired(self) -> Desired | None:
        """The newest desired document read: its seq never goes down (`floor`)."""
        with self._lock:
            return self._desired

    def floor(self, seq: int | None) -> None:
        """The daemon has applied `seq` (its memory, kept across its own restarts): a
        document with a lower seq is a replay and is never handed to the loop."""
        with self._lock:
            if seq is not None and (self._floor is None or seq > self._floor):
                self._floor = seq

    def _take_desired(self, desired: Desired) -> None:
        """Desired documents only move forward: one whose seq is below the newest seen or
        applied (a validly signed old document written back by someone who reaches the
        store, e.g. `{seq: 40, stop: true}` after seq 41) is counted and ignored; one
        with the same seq as the newest stands as first read."""
        with self._lock:
            cur = self._desired.seq if self._desired is not None else None
            newest = max(x for x in (cur, self._floor, -1) if x is not None)
            if desired.seq > newest or (desired.seq == newest and self._desired is None):
                self._desired = desired
                return
            if desired.seq == cur or desired.seq == self._replayed:
                return  # the same document again, or a replay already counted
            self._replayed = desired.seq
        log.warning("host %s: ignoring desired seq %d: seq %d is newer (an old document written back)",
                    self._host, desired.seq, newest)
        if self._forgeries is not None:
            self._forgeries.note(Keys.desired(self._host), "replayed")

    def departed(self) -> frozenset[str]:
        """Worker ids of this host that a generation plan lists as left or lost:
        they are out of the job, whatever their process still does."""
        return self._departed

    def joined(self) -> frozenset[str]:
        """Worker ids of this host that a generation plan lists as members: they
        reached the job (a worker that exits before is one that failed at start)."""
        return self._joined

    @property
    def job_done(self) -> bool:
        """The runtime's `done` key is set: every worker of the job ends."""
        return self._job_done

    @property
    def done_reason(self) -> str:
        """Why the job ended, as the runtime's `done` key says ("stop": `eltctl down`
        or the controller's pause; "finished": the last step was reached); "" unknown."""
        return self._done_reason

    @property
    def address(self) -> str:
        """The store's address now: the one given, or where its keeper moved to."""
        return self._address.spec

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def last_ok(self) -> float | None:
        return self._last_ok

    @property
    def error(self) -> str:
        return self._error

    def publish_state(self, doc: dict, urgent: bool = False) -> None:
        with self._lock:
            self._state = doc
            self._state_dirty = True
        if urgent:
            self._wake.set()

    def send(self, what: str, fn: Callable[[object], None]) -> None:
        with self._lock:
            if len(self._outbox) >= MAX_OUTBOX:
                dropped = self._outbox.popleft()
                log.warning("host %s: the store has been away long enough that %s was dropped", self._host,
                            dropped[0])
            self._outbox.append((what, fn))
        self._wake.set()

    # -- the thread --------------------------------------------------------------
    def _connect(self, retry: bool = False):
        from ..store.client import connect

        if retry:  # the direct mode's keeper may serve on a new port now (never on the hot path)
            self._address.follow()
        # plain: no torch (the daemon forms no process group), so the first desired
        # document is read within moments of the daemon's start, not after torch's import
        raw = connect(self._address.spec, self._connect_timeout, plain=True)
        run = read_run_id(self._run_file) if self._secret is not None else ""
        return job_store(raw, self._job, self._secret, self._forgeries, run)  # it keeps the client alive

    def _run(self) -> None:
        backoff = BACKOFF_START_S
        conn = None
        outage_logged = False
        next_poll = 0.0
        tried = False  # a connection failed before: each try reads where the store is now
        answered = False  # the last connection answered a request (a port's squatter only accepts)
        while not self._stop.is_set():
            if conn is None:
                try:
                    conn = self._connect(retry=tried)
                except Exception as e:  # noqa: BLE001 - any failure to connect means: try again later
                    tried = True
                    self._error = str(e).splitlines()[0] if str(e) else type(e).__name__
                    if not outage_logged:
                        log.warning("host %s: the store at %s is unreachable (%s); the workers keep running "
                                    "and the daemon retries", self._host, self._address.spec, self._error)
                        outage_logged = True
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                    continue
                self._connected = True
                self._generation = -1  # a restarted store has its own history
                self._job_done, self._done_reason = False, ""
                if self._error:
                    self._last_error = self._error
                self._error = ""
                answered = False  # the back-off is reset by an exchange, not by a connect
                if outage_logged:
                    self._reconnects += 1
                    log.info("host %s: connected to the store at %s again", self._host, self._address.spec)
                else:
                    log.info("host %s: connected to the store at %s", self._host, self._address.spec)
                outage_logged = False
            js = conn
            try:
                self._flush(js)
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + self._poll_s
                    try:
                        desired = get_desired(js, self._host)
                    except ForgedValue:
                        pass  # counted and logged once (auth.Forgeries); the last verified one stands
                    except ValueError as e:
                        log.error("host %s: ignoring a malformed desired state: %s", self._host, e)
                    else:
                        if desired is not None:
                            self._take_desired(desired)
                    self._follow_plans(js)
                with self._lock:
                    doc = self._state if self._state_dirty else None
                    self._state_dirty = False
                if doc is not None:
                    link = {"connected": True, "reconnects": self._reconnects, "last_error": self._last_error}
                    js.set(state_key(self._host), json.dumps(dict(doc, time=time.time(), store=link)))
                self._last_ok = time.time()
                if not answered:
                    answered, backoff = True, BACKOFF_START_S
            except Exception as e:  # noqa: BLE001 - the store went away: reconnect with back-off
                self._error = str(e).splitlines()[0] if str(e) else type(e).__name__
                log.warning("host %s: lost the store at %s (%s); the workers keep running and the daemon "
                            "reconnects", self._host, self._address.spec, self._error)
                outage_logged = True
                self._connected = False
                conn = None
                tried = True
                if not answered:  # it accepted and never answered: not a store (or not yet), back off
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            self._wake.wait(min(self._poll_s, 0.25))
            self._wake.clear()
        self._connected = False

    def _follow_plans(self, js) -> None:
        if not self._job_done and js.check([Keys.DONE]):
            self._job_done = True
            try:
                self._done_reason = str(json.loads(js.get(Keys.DONE)).get("reason", ""))
            except (ValueError, AttributeError, TypeError):
                self._done_reason = ""
        mine = f"{self._host}/"
        if self._generation < 0:  # nothing read from this store yet: a restarted one starts later
            self._generation = first_generation(js) - 1
        while js.check([Keys.plan(self._generation + 1)]):
            self._generation += 1
            plan = Plan.from_json(js.get(Keys.plan(self._generation)))
            gone = {w for w in plan.left + plan.lost if w.startswith(mine)}
            if gone:
                self._departed = self._departed | gone
            members = {w for w in plan.members if w.startswith(mine)}
            if not members <= self._joined:
                self._joined = self._joined | members

    def _flush(self, js) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    return
                what, fn = self._outbox[0]
            try:
                fn(js)
            except RuntimeError:
                raise  # c10d's store errors (DistError): the store is away; the message stays queued
            except Exception as e:  # noqa: BLE001 - a message that can never be delivered must not block the rest
                log.error("host %s: dropping %s that cannot be delivered: %r", self._host, what, e)
            with self._lock:
                if self._outbox and self._outbox[0][1] is fn:
                    self._outbox.popleft()

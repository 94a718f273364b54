"""Riding through a lost store: the workers train on while the store keeper is away.

The job's store (the controller's TCPStore) carries only control: heartbeats,
leave and join requests, generation plans, rank 0's status and the event log.
The gradients travel over each generation's own process group, which needs the
store only while it forms. So when the store keeper dies, the workers keep
training, and the controller restarts the keeper on the same address and port
(eltctl/controller/store.py). A c10d TCPStore client does not reconnect by
itself, so:

* `StoreHealth`, shared by a worker's control thread and its training thread,
  says whether the store is away, since when (this process's monotonic clock),
  how many store calls failed (counted, logged once per outage) and how many
  times the store came back (`reconnects`, the "store epoch");
* the control thread (member/control.py) reconnects through the same factory the
  member's session uses (`MemberSession.connect_store`, member/session.py), and
  while the store is away reports no request: no membership change starts
  without the store;
* the training thread (ElasticJob, through its session: `reconnect_if_back`,
  `await_store`) opens a fresh client of its own when the epoch moved, and rank
  0 re-publishes what the runtime owns in a store that came back
  empty (`republish`): the current generation's plan, `gen/first` (so that the
  daemons and the joiners, which count plans from 0, find it: protocol's
  `first_generation`), and the joiners queued in the empty store moved past the
  plan's `join_upto`;
  the events that could not be written are appended then (`StoreHealth.hold`);
* a change that needs the store (a leave, a join, a recovery, the end) waits for
  it (`wait_until_back`) at most until the store has been away for
  `store_loss_timeout` (ELTCTL_STORE_LOSS_TIMEOUT, default 120 s);
* in the direct mode (a `tcp:` store) a keeper restarted while another process holds
  its port serves on a new one; every keeper of that mode writes its address to the
  file `store.address` beside the run file in each host's job directory
  (`STORE_ADDRESS_FILE`, eltctl/storeforward.py); a reconnect reads it (`StoreAddress.follow`: only then,
  never on the hot path) and goes there. It is believed only when it is this
  account's regular file that no one else can write, like the run file;
* past that timeout every rank ends at the same step (the stop flag rides in the
  gradients' control tail): rank 0 writes a checkpoint with the ordinary
  checkpoint path, which needs no store, and the workers exit cleanly
  (`StoreLost`). The next start restores it.

Stdlib only (the plan type comes from member/plan.py). Restart mode's
supervisor does not ride out the store's loss (its session has no health).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from ..protocol import READ_WINDOW, Keys, add_event, claim, scan
from .address import parse_spec

log = logging.getLogger("eltctl_runtime")

DEFAULT_STORE_LOSS_TIMEOUT_S = 120.0
RECONNECT_EVERY_S = 0.5  # how often a worker tries the store again while it is away
# Once the store is back, the members' silence counts from this much later: each of
# them reconnects on its own (a loaded host takes seconds), and a heartbeat missing
# from the new store only means that one has not yet.
BACK_GRACE_S = 10.0


STORE_ADDRESS_FILE = "store.address"  # beside the run file: the direct-mode store's address now


class StoreLost(RuntimeError):
    """The store has been away longer than the store-loss timeout."""


class StoreHealth:
    """Whether this worker's store is away; shared by its threads (thread-safe)."""

    def __init__(self, worker_id: str, timeout_s: float = DEFAULT_STORE_LOSS_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._lost_since: float | None = None
        self._failures = 0
        self._reconnects = 0
        self._held: list[dict] = []

    @property
    def lost(self) -> bool:
        return self._lost_since is not None

    @property
    def failures(self) -> int:
        """Store calls that failed, over the worker's life."""
        return self._failures

    @property
    def reconnects(self) -> int:
        """How many times the store came back (the store epoch)."""
        return self._reconnects

    def lost_for(self) -> float:
        since = self._lost_since
        return 0.0 if since is None else self._clock() - since

    def expired(self) -> bool:
        """Away longer than the timeout: the worker checkpoints and exits."""
        return self.lost and self.lost_for() >= self.timeout_s

    def failed(self, what: str, error: BaseException | str, epoch: int | None = None) -> None:
        """A store call failed: counted; the first of an outage is logged. `epoch`:
        the `reconnects` the failing client was opened at; a client older than the
        last reconnect failing says nothing about the store now (only counted)."""
        with self._lock:
            self._failures += 1
            if epoch is not None and epoch != self._reconnects:
                return
            first = self._lost_since is None
            if first:
                self._lost_since = self._clock()
        if first:
            why = str(error).splitlines()[0] if str(error) else type(error).__name__
            log.warning("worker %s: the store is away (%s: %s); training goes on, no membership change starts "
                        "until it is back, and the worker checkpoints and exits if it stays away %.0f s",
                        self.worker_id, what, why, self.timeout_s)

    def back(self) -> None:
        """A new connection to the store works."""
        with self._lock:
            since, self._lost_since = self._lost_since, None
            self._reconnects += 1
        away = self._clock() - since if since is not None else 0.0
        log.info("worker %s: the store is back after %.1f s (%d failed store calls so far)", self.worker_id,
                 away, self._failures)

    def hold(self, event: dict) -> None:
        """An event that could not be written: appended once the store is back."""
        with self._lock:
            self._held.append(event)

    def take_held(self) -> list[dict]:
        with self._lock:
            held, self._held = self._held, []
        return held


def wait_until_back(health: StoreHealth, poll_s: float = 0.05) -> None:
    """Block while the store is away (another thread reconnects); raises StoreLost
    once it has been away `timeout_s`."""
    while health.lost:
        if health.expired():
            raise StoreLost(f"the store has been away {health.lost_for():.0f} s (store_loss_timeout "
                            f"{health.timeout_s:g} s)")
        time.sleep(poll_s)


def republish(js, plan, worker_id: str) -> bool:
    """Re-publish `plan` (a `membership.Plan`, the current generation) into a store
    that lost it; returns True if this call did. A store that holds the plan is left
    alone, so this is cheap to call after every reconnect.

    `gen/first` is taken first (compare_set: one member re-publishes); joiners that
    registered in the empty store before that (numbers not above `join_upto`, which
    the plan counts as consumed) are queued again past it (protocol.claim), and the
    join counter, the joiners' first guess, moves past it too."""
    g = plan.generation
    if js.check([Keys.plan(g)]):
        return False
    mine = json.dumps({"generation": g, "by": worker_id})
    if js.compare_set(Keys.FIRST_GEN, "", mine) != mine.encode():
        return False
    js.add(Keys.JOIN_SEQ, plan.join_upto)  # the joiners' first guess (protocol.claim) lands past join_upto
    early, _ = scan(js, Keys.join, 0, window=min(plan.join_upto, READ_WINDOW))
    for _k, worker in early:  # the queue is read, never counted (join/seq is unsigned)
        claim(js, Keys.join, plan.join_upto, worker.decode(), hint=js.add(Keys.JOIN_SEQ, 1))
    js.compare_set(Keys.plan(g), "", plan.to_json())
    log.info("worker %s: re-published generation %d's plan (%s) in the store that came back empty", worker_id, g,
             ", ".join(plan.members))
    return True


def flush_held(js, health: StoreHealth) -> None:
    """Append the events held while the store was away."""
    for ev in health.take_held():
        add_event(js, ev)


def restarted_store_waits(js) -> bool:
    """A joiner in a store the controller restarted, before any plan is in it: the
    members (if any) re-publish theirs soon, so it must not start a generation 0."""
    return js.check([Keys.STORE_RESTARTED]) and not js.check([Keys.FIRST_GEN])


# --------------------------------------------------------------------------- a store that moved

def read_store_address(path: Path | str) -> str | None:
    """The `tcp:` address in the store address file `path` (written by the keeper, 0600),
    or None when it is missing, is not this account's regular file that only it can
    write (anyone else could send the job's clients to a store of theirs), or holds no
    `tcp:` address. Never raises: the caller keeps the address it has."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            log.warning("ignoring the store address file %s: it must be a regular file of this account that only "
                        "it can write (0600)", path)
            return None
        text = os.read(fd, 4096).decode("utf-8", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        spec = parse_spec(text)
    except ValueError:
        return None
    return str(spec) if spec.kind == "tcp" else None


class StoreAddress:
    """Where this process reaches the job's store: the address it was given, until a
    reconnect finds that the keeper moved (the direct mode only: a `tcp:` address; the
    ssh mode's socket never moves). The file is `STORE_ADDRESS_FILE` beside `run_file`
    (None: a job without run ids, nothing moves). No I/O until `follow`."""

    def __init__(self, spec: str, run_file: Path | str | None) -> None:
        self.spec = spec
        tcp = run_file is not None and str(run_file) != "" and _is_tcp(spec)
        self.file = Path(run_file).parent / STORE_ADDRESS_FILE if tcp else None

    def follow(self) -> str:
        """At a reconnect: the keeper's published address when it differs from ours
        (taken from now on), else ours."""
        if self.file is None:
            return self.spec
        new = read_store_address(self.file)
        if new is not None and new != self.spec:
            log.warning("the store moved from %s to %s (its keeper was restarted on a new port; %s)", self.spec, new,
                        self.file)
            self.spec = new
        return self.spec


def _is_tcp(spec: str) -> bool:
    try:
        return parse_spec(spec).kind == "tcp"
    except ValueError:
        return False

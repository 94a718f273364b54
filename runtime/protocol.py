"""The wire protocol between the controller, the host daemons and the workers.

Every key of the job's store, every document that crosses a process boundary
through it, and the vocabulary of the job's event log live here, and nowhere
else: the controller (eltctl/controller), the host daemon (daemon/) and the
training runtime (train/job.py, member/control.py, member/plan.py) all import this module.
It needs only the standard library (the control side imports it without torch).

The store is the job's c10d TCPStore, hosted by the store keeper on the control
machine. Every key of a job lives under `eltctl/<job>/` (`job_prefix`); the
helpers here take either the raw store and the job (`append_event(store, job,
event)`, the public API of `eltctl_runtime`) or a store already scoped to the
job (`add_event(js, event)`: a `torch.distributed.PrefixStore`, the
controller's client, or `scope(store, job)`). A store is anything with
`set`, `get`, `add` and `check` (`Store`), so tests can use a dict-backed fake.

Who writes what (the keys relative to `eltctl/<job>/`; runtime/README.md has
the full table)::

    join/seq, join/<n>          worker (registers when warm: `claim`; join/seq is only a hint)
    hb/<worker>                 worker's control thread
    leave/<worker>              anyone (request_leave), the host daemon
    dead/<worker>, dead/seq     host daemon, launcher, a worker leaving abruptly (report_dead)
    stop                        controller (request_stop)
    done                        rank 0: {step, reason}
    gen/<g>/plan, abort, alive  workers (member/plan.py)
    gen/<g>/catchup/<r>/pg      local steps: a joiner's background state transfer (train/catchup.py)
    gen/<g>/master              restart mode: rank 0's supervisor, `addr:port` of the script's
                                MASTER_ADDR/MASTER_PORT for generation g (restart/supervisor.py)
    gen/first                   rank 0, in a store that came back empty (a restarted keeper):
                                `{generation, by}`, the first generation whose plan this store
                                holds (store/loss.py; absent: 0)
    store/restarted             the store keeper, when the controller restarted it: the time
                                (a joiner then waits for the members' plan, store/loss.py)
    status                      rank 0, about once a second (`status_document`; its `forged`
                                counts the forged values rank 0 read, per key family)
    events/seq, events/<n>      rank 0, host daemons, controller (`append_event`, `EventKind`)
    daemon/<host>/desired       controller: `Desired` {seq, slots, stop}
    daemon/<host>/state         host daemon, about once a second (daemon/service.py); its
                                `forged: {family: n}` counts the forged values the daemon read
                                ({} when none), e.g. `{"daemon/desired": 3}`

With a job secret (runtime/auth.py) every value above is signed and checked
before it is parsed or acted on; the counters (`join/seq`, `dead/seq`,
`events/seq`) cannot be signed, so no reader depends on one: the join queue and
the event log are read as runs of verified entries (`claim`, `scan`), and death
reports are looked at on a timer too. A forged value reads as absent (`check`)
or as the key's last verified value (`get`).

and, outside any job's prefix, `eltctl/storekeeper` (`KEEPER_KEY`): the store
keeper's pid, written on the raw store when it starts serving.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, Iterable, Protocol

from .store.auth import ForgedValue, raw_store
from .store.ops import peek_one

log = logging.getLogger("eltctl_runtime")

ROOT = "eltctl"
KEEPER_KEY = f"{ROOT}/storekeeper"


class Store(Protocol):
    """The part of c10d's Store the protocol uses (TCPStore, PrefixStore, a test's fake)."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...


def job_prefix(job: str) -> str:
    """The prefix every key of `job` lives under (c10d's PrefixStore adds the `/`)."""
    return f"{ROOT}/{job}"


class Keys:
    """Store keys, relative to the job's prefix (the module docstring says who writes each)."""

    JOIN_SEQ = "join/seq"
    DEAD_SEQ = "dead/seq"
    STOP = "stop"
    DONE = "done"
    STATUS = "status"
    EVENTS_SEQ = "events/seq"
    FIRST_GEN = "gen/first"
    STORE_RESTARTED = "store/restarted"
    # The controller, after each restore before a start with no survivor (controller/act.py):
    # {"step": the checkpoint delivered (null: none found), "targets": [hosts], "ready": [hosts]}
    RESTORED = "restore/delivered"
    SCRIPT_FAILURES = "restart/failures"  # restart mode, rank 0: times the script failed (JSON list, the window's)

    @staticmethod
    def script_failure(worker: str) -> str:
        """Restart mode: {time, rc, line} of the worker's script's last failure."""
        return f"restart/failed/{worker}"

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
    def master(gen: int) -> str:
        """Restart mode: `addr:port` the scripts of generation `gen` rendezvous at (env://)."""
        return f"gen/{gen}/master"

    @staticmethod
    def pg_prefix(gen: int) -> str:
        return f"gen/{gen}/pg"

    @staticmethod
    def catchup_prefix(gen: int, joiner: int) -> str:
        """Where the 2-rank group that carries the state to generation `gen`'s joiner at
        rank `joiner`, catching up in the background, forms (train/catchup.py)."""
        return f"gen/{gen}/catchup/{joiner}/pg"

    @staticmethod
    def pair(gen: int, sender: int, receiver: int) -> str:
        """Never stored: the key that collectives.verify_pairs's handshake message from rank
        `sender` to rank `receiver` of generation `gen`'s group is signed under (family gen/pair)."""
        return f"gen/{gen}/pair/{sender}/{receiver}"

    @staticmethod
    def event(n: int) -> str:
        return f"events/{n}"

    @staticmethod
    def desired(host: str) -> str:
        return f"daemon/{host}/desired"

    @staticmethod
    def daemon_state(host: str) -> str:
        return f"daemon/{host}/state"


def desired_key(host: str) -> str:
    """`daemon/<host>/desired`: the controller's `Desired` document for one host's daemon."""
    return Keys.desired(host)


def state_key(host: str) -> str:
    """`daemon/<host>/state`: the host daemon's state document."""
    return Keys.daemon_state(host)


# ---------------------------------------------------------------------------- the event log


class EventKind(str, Enum):
    """The kind of an entry of the job's event log (`events/<n>`). Who writes which:

    * the runtime's rank 0, at the first step committed in a new generation:
      START, JOIN, LEAVE, CRASH, HANG, RESTORE; and STOP when a stop request
      ends the job (`{kind, generation, world_size, members, joined, left,
      lost, from_step, step, pause_s, time}`; STOP: `{kind, generation, step, time}`);
    * a host daemon: YIELD (a GPU's owner is back; the worker there leaves) and
      CRASH (a worker process exited without being asked, or could not start);
    * the controller: STORE (it restarted the store keeper on the same address
      and port after losing it; `restarts`: how many times so far),
      BENCH (a host whose workers keep failing is benched),
      ADD and REMOVE (`eltctl scale --add/--remove`), RESTORE (it chose and
      delivered a checkpoint before the job starts, or failed to), WINDOW (a host's
      working-hours window closed, `state: "off-hours"`, or opened, `state: "open"`),
      QUOTA (a host reached a gpu-hours quota, `state: "quota"`, or it lifted,
      `state: "open"`) and CORDON (`eltctl cordon`/`uncordon`, `state: "cordoned"`
      or `"uncordoned"`).

    Daemon and controller entries share one shape (`event_document`):
    `{time, kind, host, workers, pause_s: null, detail, ...extra}`. A daemon's
    CRASH adds `cause` (the line of the worker's output that says why: a
    traceback's exception line, else its last line; "" if none), `at_start`
    (it exited before any generation plan listed it: it failed at start, before
    its first step), `exit_code` (null: unknown or never started) and `ran_s`
    (seconds it ran, when at_start). DONE is a plan kind only (never logged today)."""

    START = "start"
    JOIN = "join"
    LEAVE = "leave"
    CRASH = "crash"
    HANG = "hang"
    RESTORE = "restore"
    STOP = "stop"
    DONE = "done"
    YIELD = "yield"
    BENCH = "bench"
    WINDOW = "window"
    QUOTA = "quota"
    CORDON = "cordon"
    ADD = "add"
    REMOVE = "remove"
    STORE = "store"
    FAIRSHARE = "fairshare"  # the controller released GPUs to another job's fair share


# What a generation change's kind means, declared beside the kinds (a new membership
# event is a kind above and, where it applies, a line here; the code that proposes it
# passes it to `Generations.change`). PLANNED: its leavers are `left` (they went on
# purpose; nothing they held is lost), any other kind's are `lost`. MEMBERSHIP: the
# kinds the job's membership changes under (the demo's resizes; a daemon's YIELD is
# where a planned LEAVE starts).
PLANNED = frozenset({EventKind.LEAVE, EventKind.JOIN, EventKind.STOP})
MEMBERSHIP = (EventKind.START, EventKind.JOIN, EventKind.LEAVE, EventKind.YIELD, EventKind.CRASH, EventKind.HANG,
              EventKind.RESTORE)


def event_document(kind: EventKind | str, *, host: str | None, detail: str, workers: Iterable[str] = (),
                   time: float | None = None, **extra: Any) -> dict:
    """An event as the host daemon and the controller write it:
    `{time, kind, host, workers, pause_s: null, detail, **extra}` (in that order).
    `time` defaults to now (wall clock); an unknown kind raises ValueError."""
    return {"time": _now() if time is None else time, "kind": EventKind(kind).value, "host": host,
            "workers": list(workers), "pause_s": None, "detail": detail, **extra}


def _now() -> float:
    return time.time()


# ---------------------------------------------------------------------------- documents


@dataclass(frozen=True)
class Desired:
    """`daemon/<host>/desired`, written by the controller, read by the host daemon.

    A new `seq` arms each listed slot (a GPU index, or a CPU slot number): the
    daemon starts one worker per armed slot; `stop`: the job is stopping, the
    daemon waits for its workers and exits (daemon/logic.py)."""

    seq: int
    slots: tuple[int, ...] = ()
    stop: bool = False

    @classmethod
    def from_json(cls, raw: str | bytes) -> "Desired":
        d = json.loads(raw)
        if not isinstance(d, dict) or not isinstance(d.get("seq"), int):
            raise ValueError(f"desired state needs an integer seq: {raw!r}")
        slots = d.get("slots") or []
        if not isinstance(slots, list) or not all(isinstance(s, int) and s >= 0 for s in slots):
            raise ValueError(f"desired slots must be a list of non-negative integers: {slots!r}")
        return cls(seq=d["seq"], slots=tuple(sorted(set(slots))), stop=bool(d.get("stop", False)))

    def to_dict(self) -> dict:
        return {"seq": self.seq, "slots": list(self.slots), "stop": self.stop}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def status_document(*, generation: int, world_size: int, members: Iterable[str], step: int | None, epoch: int | float | None,
                    position: int, samples_per_s: float | None, loss: float | None, checkpoint: dict | None,
                    time: float | None = None, workers: dict | None = None, mode: str | None = None,
                    restarts: int | None = None, forged: dict[str, int] | None = None,
                    extra: dict | None = None) -> dict:
    """The runtime's `status` document, written by rank 0 about once a second:
    `{generation, world_size, members, step, epoch, position, samples_per_s,
    loss, checkpoint: {step, time, path} | null, time}`, and, once a step of
    the generation has committed, `workers`: per member, as of that step,
    `{worker: {share, samples_per_s, relative_speed, speedup_without,
    straggler}}` (WORKER_FIELDS; eltctl_runtime.train.balance.worker_report says
    what each means). Restart mode (restart/supervisor.py) adds `mode: "restart"` and
    `restarts` (how many times the script's processes were restarted); its
    `step` is the script's own step where known (report() or the `[job]
    progress` pattern; null otherwise) and `extra` adds `snapshot` (the counter
    of snapshots of the script's checkpoint directory), `script: {step,
    step_from, loss, samples, samples_per_s, steps_per_s, epoch, updated,
    running, running_since, ever_running, metrics}` (running: every member's script ran past
    the settle time or reported a step) and, once the job stopped on its
    restart limit, `failed` (why). An
    elastic job's document has neither key (mode "elastic"). The runtime adds
    `forged: {family: n}`: store values that failed their signature check,
    as rank 0's process counted them, per key family (auth.family: "leave",
    "dead", "gen/plan", "join", "hb", ...; {} when none, or when the job runs
    without a secret). ElasticJob's replicated path adds, once a step committed,
    `network: {wait_s, compute_s, share, bytes_per_step}` (NETWORK_FIELDS): where rank
    0's steps' time goes, smoothed (train/records.py NetworkFigures: its compute, its
    wait for the gradients' all-reduces after backward, share = wait / (compute +
    wait), the bytes it all-reduces per step; with local steps also `mode: "local"` and
    `sync_every`, train/local.py); absent in restart mode and sharded."""
    doc = {"generation": generation, "world_size": world_size, "members": list(members), "step": step,
           "epoch": epoch, "position": position, "samples_per_s": samples_per_s, "loss": loss,
           "checkpoint": checkpoint, "time": _now() if time is None else time}
    if workers is not None:
        doc["workers"] = workers
    if mode is not None:
        doc["mode"] = mode
        doc["restarts"] = restarts or 0
    if forged is not None:
        doc["forged"] = dict(forged)
    if extra:
        doc.update(extra)
    return doc


# The fields of each entry of the status document's `workers`.
WORKER_FIELDS = ("share", "samples_per_s", "relative_speed", "speedup_without", "straggler")
# The fields of the status document's `network` (status_document).
NETWORK_FIELDS = ("wait_s", "compute_s", "share", "bytes_per_step")


# ---------------------------------------------------------------------------- on a job-scoped store


class JobScope:
    """A store seen through one job's prefix, with no torch: the same keys a
    `torch.distributed.PrefixStore(job_prefix(job), store)` reads and writes
    (`<prefix>/<key>`). For helpers only; process groups need the real PrefixStore."""

    def __init__(self, store: Store, prefix: str) -> None:
        self._store = store
        self._prefix = prefix

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self._store.get(self._key(key))

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._key(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self._store.check([self._key(k) for k in keys])

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._store.compare_set(self._key(key), expected, desired)  # type: ignore[attr-defined]


def scope(store: Store, job: str) -> JobScope:
    """`store` (the raw TCPStore) seen through `job`'s prefix."""
    return JobScope(store, job_prefix(job))


def add_event(js: Store, event: dict) -> int:
    """Append one event to the log of the job `js` is scoped to (`events/<n>`, at
    the first free number: `claim`) and return its number. `event["kind"]` must be
    an EventKind value (ValueError otherwise); `time` (wall clock) is added when
    missing; the rest is written as given, in its order."""
    doc = dict(event, kind=EventKind(event["kind"]).value)
    doc.setdefault("time", _now())
    return claim(js, Keys.event, 0, json.dumps(doc), hint=counter_hint(js, Keys.EVENTS_SEQ))


def counter_hint(js: Store, key: str) -> int | None:
    """A tick of the counter `key` (`add(key, 1)`): a writer's first guess, or None when
    the store refuses it (someone wrote a value that is not an integer there before any
    ADD: sockstore refuses ADD on it), so the writer still finds its number (`claim`)."""
    from .store.server import StoreRefused

    try:
        return js.add(key, 1)
    except StoreRefused as exc:
        log.warning("The store's counter %s is spoiled (%s); the log is found without it.", key, exc)
        return None


# Counters (`events/seq`, `join/seq`, `dead/seq`) are store `add`s: they cannot be
# signed, and anyone who reaches the store can raise or lower them. So no reader
# depends on one. The join queue and the event log are numbered logs written with
# `claim`: a writer takes the first number past the log's end that holds no verified
# entry, by compare_set (one writer wins each number; on a signed store a forged value
# there is replaced), so the verified entries form one run from 1 up, and readers read
# that run (`scan`) without looking at the counter. The counter is only the writer's
# first guess (it is right unless someone moved it) and a count for humans. A reader
# reads at most READ_WINDOW entries per call and looks GAP_TOLERANCE numbers past a
# missing entry (one deleted by someone who reaches the store) before it stops.
READ_WINDOW = 512
GAP_TOLERANCE = 8


def _present(js: Store, key: str) -> bool:
    """A verified entry is there (on a signed store `check` verifies: a forged one is not)."""
    return js.check([key])


def first_free(js: Store, key_of, after: int, hint: int | None = None) -> int:
    """The first number past `after` whose key (`key_of(n)`) holds no verified entry,
    the entries past `after` being one run (`claim` writes them so): the hint when it is
    right (its predecessor is there, it is not), else galloping then bisecting, about
    2 log2(length) checks, whatever a counter says."""
    if hint is not None and hint > after and (hint - 1 == after or _present(js, key_of(hint - 1))) \
            and not _present(js, key_of(hint)):
        return hint
    lo, step = after, 1  # lo: `after`, or a number known to hold an entry
    hi = after + 1
    while _present(js, key_of(hi)):
        lo, step = hi, step * 2
        hi = after + step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _present(js, key_of(mid)):
            lo = mid
        else:
            hi = mid
    return hi


def claim(js: Store, key_of, after: int, value: str, hint: int | None = None) -> int:
    """Write `value` at the first free number past `after` of the log `key_of` names
    (compare_set: when another writer took that number first, the next one) and return
    the number. `hint`: the writer's guess (a counter's value; checked, never trusted)."""
    n = first_free(js, key_of, after, hint)
    want = value.encode()
    while True:
        got = js.compare_set(key_of(n), "", value)  # type: ignore[attr-defined]
        if got == want:
            return n
        n = first_free(js, key_of, n)


def scan(js: Store, key_of, after: int, window: int = READ_WINDOW,
         gap: int = GAP_TOLERANCE) -> tuple[list[tuple[int, bytes]], int]:
    """The verified entries of the log `key_of` names past `after` (number, value), at
    most `window` numbers read, and the last number that held one (`after` if none). A
    missing or forged entry is skipped; `gap` of them in a row end the log."""
    out: list[tuple[int, bytes]] = []
    upto, n, misses = after, after, 0
    while n - after < window and misses < gap:
        # Read as many numbers at once as the loop surely visits (`gap - misses` more
        # misses end it): one request per chunk, and no entry read that it would not read.
        chunk = min(gap - misses, window - (n - after))
        for value in peek_many(js, [key_of(n + 1 + i) for i in range(chunk)]):
            n += 1
            if value is None:
                misses += 1
                continue
            misses = 0
            upto = n
            out.append((n, value))
    return out, upto


def get_events(js: Store, start: int = 1, window: int = READ_WINDOW) -> list[dict]:
    """The job's events from number `start` on (numbers begin at 1), at most
    `window` numbers read (`scan`: the `events/seq` counter is not looked at).
    Missing entries, and on a signed store (auth.SignedStore) forged ones (counted
    there), are left out."""
    out = []
    for _n, raw in scan(js, Keys.event, max(0, start - 1), window)[0]:
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out


def peek(js: Store, key: str) -> bytes | None:
    """The verified value of `key` or None, in one store call that never waits for a
    missing key (auth.SignedStore.peek); on a store without it, check then get."""
    fn = getattr(js, "peek", None)
    if fn is not None:
        return fn(key)
    if getattr(js, "compare_set", None) is not None:  # c10d: a missing key answers the expected value
        return peek_one(js, key)
    if not js.check([key]):
        return None
    try:
        return js.get(key)
    except (ForgedValue, KeyError):
        return None


def peek_many(js: Store, keys: list[str]) -> list[bytes | None]:
    """`peek` of several keys: one store request that never waits where the store has one
    (auth.SignedStore / storeclient.KeptPrefixStore over a SocketStore), else one each."""
    fn = getattr(js, "peek_many", None)
    if fn is not None:
        return fn(keys)
    return [peek(js, k) for k in keys]


def set_and_peek(js: Store, sets: list[tuple[str, str]], keys: list[str]) -> list[bytes | None]:
    """Write `sets`, then `peek_many(keys)`: one round trip where the store allows it (the
    control thread's poll)."""
    fn = getattr(js, "set_and_peek", None)
    if fn is not None:
        return fn(sets, keys)
    for k, v in sets:
        js.set(k, v)
    return peek_many(js, keys)


def watch_deleted(js: Store, key: str, timeout_s: float) -> tuple[bytes | None, bool]:
    """`key` read as missing after it was there: no writer of a heartbeat or a state
    document deletes it, so someone who reaches the store did (counted on a signed
    store as "<family> deleted"). Missing is not silence by itself: the key is watched
    for `timeout_s` for its writer's next write (the store's `wait`, then `peek`, an
    atomic read that never waits). Returns (the verified value then read, or None;
    whether the key was written again meanwhile, "contested" when no verified value
    could be read: written and deleted again at once). A writer that keeps writing is
    seen, or at least seen rewriting; one that stopped leaves the key missing. A forged
    value there (counted by the store) is no news of the writer."""
    raw = raw_store(js)
    rewritten = False
    if raw.check([key]):  # written again since the caller's read
        value, there = _read_there(js, raw, key)
        if value is not None or there:
            return value, False  # the writer's value, or a forged one there (None)
        rewritten = True  # and deleted again between the two reads: watched as below
    forgeries = getattr(js, "forgeries", None)
    if forgeries is not None:
        forgeries.note(key, "deleted")
    has_wait = hasattr(raw, "wait")
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, rewritten
        if has_wait:
            try:
                raw.wait([key], timedelta(seconds=left))
            except Exception:  # noqa: BLE001 - c10d's wait times out with an error: not written again
                return None, rewritten
        else:
            time.sleep(min(left, 0.002))
        value = peek(js, key)
        if value is not None:
            return value, True
        if raw.check([key]):  # there again after a missing read: the writer's next write, or forged
            value, there = _read_there(js, raw, key)
            if value is not None:
                return value, True
            if there:
                return None, rewritten  # a forged value there now: no news of the writer
        rewritten = rewritten or has_wait


def _read_there(js: Store, raw: Store, key: str) -> tuple[bytes | None, bool]:
    """`key`, which `raw.check` just found: (its verified value or None, whether a value
    is still there). A value that verifies is the writer's; none that stays there is a
    forged one; none and gone was deleted again between the reads (with someone deleting
    each write at once, such a race is common: it is a rewrite, never silence)."""
    value = peek(js, key)
    if value is not None:
        return value, True
    return None, raw.check([key])


def wait_written(js: Store, key: str, timeout_s: float) -> None:
    """Sleep up to `timeout_s`, waking as soon as `key` is written (the store's `wait`, on
    the unsigned store: whoever wakes it, the caller's next read verifies what is there).
    A key already there (a forged value the caller refused) does not wake it: it sleeps
    the whole `timeout_s`, never spins. A store without `wait`: a plain sleep."""
    raw = raw_store(js)
    if not hasattr(raw, "wait") or raw.check([key]):
        time.sleep(timeout_s)
        return
    try:
        raw.wait([key], timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - c10d's wait times out with an error: nothing was written
        pass


def first_generation(js: Store) -> int:
    """The first generation whose plan this store holds: 0, or in a store that came
    back empty after its keeper was restarted, the generation the members
    re-published (`gen/first`, store/loss.py). Plans before it are not there."""
    if not js.check([Keys.FIRST_GEN]):
        return 0
    try:
        return int(json.loads(js.get(Keys.FIRST_GEN))["generation"])
    except (ValueError, KeyError, TypeError):
        return 0


def get_status(js: Store) -> dict | None:
    """Rank 0's newest `status` document, or None before the first."""
    return json.loads(js.get(Keys.STATUS)) if js.check([Keys.STATUS]) else None


def get_restored(js: Store) -> dict | None:
    """The controller's word on its last restore (`restore/delivered`), or None before the first."""
    return json.loads(js.get(Keys.RESTORED)) if js.check([Keys.RESTORED]) else None


def put_dead(js: Store, worker_id: str) -> None:
    """`dead/<worker>` and a tick of `dead/seq`: survivors abort at once."""
    js.set(Keys.dead(worker_id), str(_now()))
    counter_hint(js, Keys.DEAD_SEQ)


def put_leave(js: Store, worker_id: str) -> None:
    """`leave/<worker>`: that worker leaves at the next step boundary."""
    js.set(Keys.leave(worker_id), str(_now()))


def put_stop(js: Store) -> None:
    """`stop`: the job checkpoints and exits at the next step boundary."""
    js.set(Keys.STOP, str(_now()))


def get_desired(js: Store, host: str) -> Desired | None:
    """The controller's desired document for `host`; None when none was written.
    A malformed one raises ValueError."""
    key = Keys.desired(host)
    return Desired.from_json(js.get(key)) if js.check([key]) else None


def put_desired(js: Store, host: str, desired: Desired) -> None:
    js.set(Keys.desired(host), desired.to_json())


# ---------------------------------------------------------------------------- the public helpers
# For launchers and the control plane: the raw store and the job id.


def report_dead(store: Store, job: str, worker_id: str) -> None:
    """Tell the job that a worker process is gone (the launcher or host daemon
    saw it exit). Survivors abort the current generation at once instead of
    waiting for a collective timeout."""
    put_dead(scope(store, job), worker_id)


def request_leave(store: Store, job: str, worker_id: str) -> None:
    """Ask a worker to leave at the next step boundary (planned: no step lost)."""
    put_leave(scope(store, job), worker_id)


def request_stop(store: Store, job: str) -> None:
    """Ask the whole job to checkpoint and exit cleanly at the next boundary."""
    put_stop(scope(store, job))


def append_event(store: Store, job: str, event: dict) -> int:
    """Append one event to the job's log and return its number (`add_event`).
    Used by the runtime, the host daemon and the controller alike, so the log
    has one numbering and one vocabulary."""
    return add_event(scope(store, job), event)


def read_status(store: Store, job: str) -> dict | None:
    return get_status(scope(store, job))


def read_events(store: Store, job: str, start: int = 1) -> list[dict]:
    """Membership events from number `start` on (numbers begin at 1)."""
    return get_events(scope(store, job), start)


# ---- names -------------------------------------------------------------------

# Job and host names become file and directory names on every host and store keys:
# letters, digits, '.', '_' and '-', never starting with '.' or '-' (so never "." or
# "..", a hidden file, or an option). Checked by the inventory and again by the daemon.
NAME_RULE = "letters, digits, '.', '_' and '-' only, starting with a letter, digit or '_'"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def valid_name(name: str) -> bool:
    """Whether `name` is usable as a job or host name (NAME_RULE)."""
    return isinstance(name, str) and len(name) <= 128 and _NAME.fullmatch(name) is not None


# ---- the daemon's history of ended workers -------------------------------------

# `daemon/<host>/state` carries `"history"`: the newest DAEMON_HISTORY_KEPT workers
# that ended on the host, oldest first (daemon/history.py), each made by
# `history_entry`. `start` and `end` are the host's wall clock; `state` an end state
# of daemon/logic.py's WorkerState; `why` one of HISTORY_WHY (what asked it to go).
# The controller's usage ledger (eltctl/ledger) reads it.
DAEMON_HISTORY_KEPT = 200
HISTORY_WHY = ("", "yield", "signal", "planned", "down")


def history_entry(*, worker_id: str, slot: int, start: float, end: float, state: str, why: str = "") -> dict:
    """One ended worker in a daemon state document's `history`."""
    return {"worker_id": worker_id, "slot": slot, "start": round(start, 3), "end": round(end, 3),
            "state": state, "why": why}

"""Recording the job's usage: the controller folds each observation into usage.db.

`UsageRecorder.record(...)` is called once per observation of the store (the
controller's `observe_store`). From each host daemon's state document it keeps:

- one `intervals` row per worker, keyed by its worker id: opened when the worker is
  first seen live (its `start`), closed from the daemon's `history` (exact host
  times, how it ended). Re-reading the same document, or a new controller reading it
  after a restart, changes nothing: the key is the worker id and an exact end is final.
  A row left open by a controller that died is continued when its worker is still
  live, closed exactly when the daemon's history names it, and closed at the last
  time it was seen (`last_seen`, inferred, `exact` 0) when its daemon reports without
  it or the host stays silent for `GONE_AFTER_S`; a later exact sighting corrects it;
- `holders`: who held each GPU (this job, its owner, another job, nobody; unknown
  while the host is not observed), one row per run of the same holder;
- `samples`: world size and samples/s from rank 0's status every `SAMPLE_EVERY_S`.

Host clocks: a daemon's `start`/`end` are its host's wall clock. The recorder
estimates each host's offset from the daemon's state documents (their `time` minus
the controller's clock when it saw them change; the largest of the recent estimates,
since a document is seen at most a poll after it was written) and subtracts it when
it is at least `OFFSET_MIN_S`: smaller offsets are the poll's own delay, and hosts
synchronised by NTP are taken as they are. One offset is fixed per interval when it
is opened, so an interval's length is exactly the host's end minus its start.

How a worker ended (`how_ended`): the daemon's `why` (yield, signal, planned, down)
and end state (finished, crashed, lost); a planned leave takes the controller's
reason for its host at that moment (`planned_how`: window, quota, cordon, disabled,
scale, removed, straggler), else "planned".
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from eltctl.controller import observe
from eltctl.controller import policy as pol
from eltctl.ledger import db

log = logging.getLogger("eltctl.ledger")

SAMPLE_EVERY_S = 10.0
HEARTBEAT_S = 10.0  # how often last_seen of open rows is written
GONE_AFTER_S = 120.0  # a host silent this long: its open intervals close at their last sighting
OFFSET_MIN_S = 2.0
OFFSET_ESTIMATES = 20

LIVE_STATES = {"running", "stopping", "leaving", "killed", "evicted"}

# A host phase (policy.host_state, with A's phases) -> how a planned leave there ended.
PLANNED_BY_PHASE = {"off-hours": "window", "quota": "quota", "cordoned": "cordon", "disabled": "disabled"}


def how_ended(state: str, why: str, planned: str = "", signal: bool = False) -> str:
    """How a worker ended, from its daemon's end state and `why`, the controller's reason
    for a planned leave on its host (`planned`), and whether an owner signal held its
    host (a yield while a signal holds is the signal's)."""
    if why in ("yield", "signal"):
        return "signal" if (signal or why == "signal") else "yield"
    if why == "down":
        return "down"
    if why == "failed":  # restart mode: the job stopped when its script hit [job] max_restarts
        return "failed"
    if why == "planned":
        return planned or "planned"
    if state == "finished":
        return "finished"
    if state in ("crashed", "killed"):
        return "crash"
    if state == "evicted":
        return "yield"
    if state == "lost":
        return "lost"
    return planned or "planned" if state == "left" else state or "lost"


def planned_how(record: pol.HostRecord, view: pol.HostView | None, now: float,
                limit: pol.Limit = pol.NO_LIMIT) -> str:
    """The controller's reason to drop a host's slots now ("" when it has none): its
    limit at the last pass (off-hours, quota, cordoned, disabled: policy.host_limits),
    `scale --remove`, a straggler's drop."""
    if record.removed:
        return "removed" if record.removed_reason else "scale"
    if record.straggler_until > now:
        return "straggler"
    if view is None:
        return ""
    phase, _ = pol.host_state(replace(view, workers=()), record, now, limit)
    return PLANNED_BY_PHASE.get(str(phase.value), "")


def holder_of(view: pol.HostView, index: int) -> tuple[str, str]:
    """Who holds a slot in one observation: (holder, detail)."""
    if index in view.workers:
        return "job", ""
    if view.reach in (pol.Reach.UNREACHABLE, pol.Reach.UNKNOWN):
        return "unknown", view.reason
    s = view.slot(index)
    if s is None:
        return "none", ""
    use = str(getattr(s.use, "value", s.use))
    if use == "busy":
        return "owner", s.reason
    if use == "taken":
        return "taken", s.reason
    if use == "ours":
        return "job", s.reason
    return "none", ""


@dataclass
class _Open:
    host: str
    offset: float
    last_seen: float


class UsageRecorder:
    """The ledger's only writer. `open()` before the first `record`, `close()` at the end."""

    def __init__(self, path: Path, job: str) -> None:
        self.path = path
        self.job = job
        self._conn: sqlite3.Connection | None = None
        self._open: dict[str, _Open] = {}  # worker id -> its open interval
        self._exact: set[str] = set()  # worker ids whose end is known exactly
        self._holding: dict[tuple[str, int], tuple[int, str]] = {}  # (host, slot) -> (row id, holder)
        self._estimates: dict[str, deque] = {}
        self._last_raw: dict[str, bytes] = {}
        self._history_key: dict[str, tuple] = {}  # host -> (length, newest entry) of the history last folded
        self._history_ids: dict[str, set[str]] = {}
        self._born: float | None = None
        self._last_sample = 0.0
        self._last_beat = 0.0
        self._failed = False

    # ----------------------------------------------------------------- life

    def open(self) -> "UsageRecorder":
        self._conn = db.open_writer(self.path, self.job)
        self._load()
        return self

    def _load(self) -> None:
        """The in-memory view of the rows from the file (at start, and after a failed pass)."""
        c = self._conn
        self._holding.clear()
        self._history_key.clear()
        self._open = {w: _Open(h, off, seen) for w, h, off, seen in
                      c.execute("SELECT worker_id, host, offset, last_seen FROM intervals WHERE end IS NULL")}
        self._exact = {w for (w,) in c.execute("SELECT worker_id FROM intervals WHERE exact = 1")}
        # The last controller's holder runs end where it last saw them: what came after is unknown.
        c.execute("UPDATE holders SET end = last_seen WHERE end IS NULL")

    def close(self, now: float | None = None, *, job_down: bool = False) -> None:
        """`job_down`: the job was taken down, so every interval still open ends at its
        last sighting (inferred: a later exact sighting still corrects it)."""
        if self._conn is None:
            return
        try:
            with self._tx():
                if now is not None:
                    self._heartbeat(now)
                    self._conn.execute("UPDATE holders SET end = ? WHERE end IS NULL", (now,))
                if job_down:
                    for wid, o in list(self._open.items()):
                        self._close_inferred(wid, o, "down")
        except sqlite3.Error as exc:
            log.warning("The usage ledger %s could not be closed cleanly: %s", self.path, exc)
        self._conn.close()
        self._conn = None

    # ----------------------------------------------------------------- recording

    def record(self, now: float, inventory, observed: observe.Observer,
               records: Mapping[str, pol.HostRecord], limits: Mapping[str, pol.Limit] | None = None) -> None:
        """Fold one observation in (the controller's loop calls this once per store read).
        A failure is logged (once) and never stops the controller."""
        if self._conn is None:
            return
        try:
            with self._tx():
                self._record(now, inventory, observed, records, limits)
            self._failed = False
        except Exception as exc:  # noqa: BLE001 - the account must never stop the job's controller
            if not self._failed:
                log.warning("The usage ledger %s could not be written (%s); it is tried again at the next pass.",
                            self.path, exc, exc_info=not isinstance(exc, sqlite3.Error))
            self._failed = True
            try:
                self._load()
            except sqlite3.Error:
                pass

    def _record(self, now: float, inventory, observed: observe.Observer,
                records: Mapping[str, pol.HostRecord], limits: Mapping[str, pol.Limit] | None) -> None:
        if self._born is None:
            self._born = now
        policy = inventory.policy
        for host in inventory.hosts:
            seen = observed.seen.get(host.name)
            view = observed.view(host, now, policy)
            alive = view.daemon_alive
            if seen is not None:
                self._estimate_offset(host.name, seen, now)
                planned = planned_how(records.get(host.name, pol.HostRecord()), view, now,
                                      (limits or {}).get(host.name, pol.NO_LIMIT))
                cpu = view.reach is pol.Reach.CPU_ONLY or (view.reach is not pol.Reach.OK
                                                            and not seen.state.get("gpus"))
                self._fold_state(host.name, "cpu" if cpu else "gpu", seen, alive, planned, now)
            elif now - self._born >= GONE_AFTER_S:
                self._host_gone(host.name)
            self._holders(host.name, view, now)
        self._sample(now, observed.runtime_status, policy)
        if now - self._last_beat >= HEARTBEAT_S:
            self._heartbeat(now)

    def _fold_state(self, host: str, kind: str, seen: observe.DaemonSeen, alive: bool, planned: str,
                    now: float) -> None:
        st = seen.state
        live = {str(w["worker_id"]): w for w in st.get("workers") or []
                if isinstance(w, dict) and w.get("worker_id") and str(w.get("state", "running")) in LIVE_STATES}
        history = st.get("history") or []
        key = (len(history), json.dumps(history[-1], sort_keys=True) if history else "")
        if self._history_key.get(host) == key:
            ended: dict[str, dict] = {}  # folded already: nothing new in it
            ended_ids = self._history_ids[host]
        else:
            ended = {str(e["worker_id"]): e for e in history
                     if isinstance(e, dict) and e.get("worker_id") and e.get("end") is not None}
            ended_ids = set(ended)
        offset = self.offset(host)
        for wid, w in live.items():
            if wid in self._exact:
                continue
            o = self._open.get(wid)
            if o is None:
                start = _num(w.get("start"), _num(w.get("since"), _num(st.get("time"), now)))
                # A stale document (its daemon silent) saw the worker when it was written.
                last = now if alive else min(now, _num(st.get("time"), now) - offset)
                o = self._open[wid] = _Open(host, offset, last)
                # A row closed by inference (its host was silent) is open again: the worker lives.
                self._conn.execute(
                    "INSERT INTO intervals (worker_id, job, host, slot, kind, start, last_seen, offset) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (worker_id) DO UPDATE SET end = NULL, "
                    "how = '', state = '' WHERE exact = 0",
                    (wid, self.job, host, int(w.get("slot", -1)), kind, start - offset, last, offset))
                # A reopened row keeps the offset it was opened with (its length stays exact).
                o.offset = self._conn.execute("SELECT offset FROM intervals WHERE worker_id = ?",
                                              (wid,)).fetchone()[0]
            elif alive:
                o.last_seen = now
        signal = bool(st.get("signal"))
        for wid, e in ended.items():
            if wid in self._exact or wid in live:
                continue
            o = self._open.pop(wid, None)
            off = o.offset if o is not None else offset
            how = how_ended(str(e.get("state", "")), str(e.get("why", "")), planned, signal)
            start, end = _num(e.get("start"), 0.0), _num(e.get("end"), 0.0)
            self._conn.execute(
                "INSERT INTO intervals (worker_id, job, host, slot, kind, start, end, last_seen, offset, state, "
                "how, exact) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1) ON CONFLICT (worker_id) DO UPDATE SET "
                # the host's end placed with the row's own offset (the one its start was placed with)
                "end = MAX(start, excluded.end + excluded.offset - offset), state = excluded.state, "
                "how = excluded.how, exact = 1, last_seen = MAX(last_seen, excluded.end + excluded.offset - offset)",
                (wid, self.job, host, int(e.get("slot", -1)), kind, start - off, max(start, end) - off,
                 end - off, off, str(e.get("state", "")), how))
            self._exact.add(wid)
        self._history_key[host], self._history_ids[host] = key, ended_ids
        authoritative = alive or st.get("phase") in ("stopped", "failed")
        if authoritative:
            for wid, o in list(self._open.items()):
                if o.host == host and wid not in live and wid not in ended_ids:
                    self._close_inferred(wid, o, "down" if st.get("phase") == "stopped" else "lost")
        elif now - seen.changed >= GONE_AFTER_S:
            self._host_gone(host)

    def _host_gone(self, host: str) -> None:
        for wid, o in list(self._open.items()):
            if o.host == host:
                self._close_inferred(wid, o, "lost")

    def _close_inferred(self, wid: str, o: _Open, how: str) -> None:
        self._open.pop(wid, None)
        self._conn.execute("UPDATE intervals SET end = MAX(start, ?), last_seen = MAX(last_seen, ?), how = ?, "
                           "exact = 0 WHERE worker_id = ? AND end IS NULL", (o.last_seen, o.last_seen, how, wid))

    def _holders(self, host: str, view: pol.HostView, now: float) -> None:
        indices = sorted({s.index for s in view.slots} | set(view.workers))
        for i in indices:
            holder, detail = holder_of(view, i)
            cur = self._holding.get((host, i))
            if cur is not None and cur[1] == holder:
                continue
            if cur is not None:
                self._conn.execute("UPDATE holders SET end = ?, last_seen = ? WHERE id = ?", (now, now, cur[0]))
            row = self._conn.execute("INSERT INTO holders (host, slot, holder, detail, start, last_seen) "
                                     "VALUES (?, ?, ?, ?, ?, ?)", (host, i, holder, detail, now, now)).lastrowid
            self._holding[(host, i)] = (row, holder)

    def _sample(self, now: float, rs: Mapping | None, policy) -> None:
        if now - self._last_sample < SAMPLE_EVERY_S or not observe.runtime_fresh(rs, now, policy):
            return
        ws = int((rs or {}).get("world_size") or 0)
        if ws <= 0:
            return
        self._last_sample = now
        sps = (rs or {}).get("samples_per_s")
        self._conn.execute("INSERT OR REPLACE INTO samples VALUES (?, ?, ?, ?)",
                           (now, ws, float(sps) if isinstance(sps, (int, float)) else None,
                            rs.get("step") if isinstance(rs.get("step"), int) else None))

    def _heartbeat(self, now: float) -> None:
        self._last_beat = now
        self._conn.executemany("UPDATE intervals SET last_seen = ? WHERE worker_id = ? AND end IS NULL",
                               [(o.last_seen, w) for w, o in self._open.items()])
        self._conn.execute("UPDATE holders SET last_seen = ? WHERE end IS NULL", (now,))

    # ----------------------------------------------------------------- host clocks

    def _estimate_offset(self, host: str, seen: observe.DaemonSeen, now: float) -> None:
        """A document that changed in this read (not the first one seen: it may be old)
        was written at most a poll ago: its time minus now is the offset, less that delay."""
        before = self._last_raw.get(host)
        self._last_raw[host] = seen.raw
        t = seen.state.get("time")
        if before is None or before == seen.raw or seen.changed != now or not isinstance(t, (int, float)):
            return
        self._estimates.setdefault(host, deque(maxlen=OFFSET_ESTIMATES)).append(float(t) - now)

    def offset(self, host: str) -> float:
        """The host clock's offset (host minus controller) used for new intervals."""
        est = self._estimates.get(host)
        if not est:
            return 0.0
        best = max(est)
        return round(best, 3) if abs(best) >= OFFSET_MIN_S else 0.0

    # ----------------------------------------------------------------- figures for quotas

    def gpu_seconds(self, now: float, since: float | Mapping[str, float] = 0.0) -> tuple[dict[str, float], float]:
        """GPU-seconds per host since `since` (one time, or one per host: e.g. each host's
        midnight in its time zone) and the job's total since then, open intervals counted
        up to `now`. What the quotas need (eltctl/controller/quotas.py)."""
        from eltctl.ledger.figures import gpu_seconds

        if self._conn is None:
            return {}, 0.0
        return gpu_seconds(self._conn, now, since, live=True)

    def quota_figures(self, now: float, day_start: Mapping[str, float]) -> tuple[dict[str, float], float]:
        """What the quotas need: GPU-seconds per host since its day began (`day_start`:
        each host's midnight in its time zone) and the job's GPU-seconds in all."""
        per_day, _ = self.gpu_seconds(now, day_start)
        _, total = self.gpu_seconds(now, 0.0)
        return per_day, total

    def recent_gpu_hours(self, now: float, half_life: float) -> float:
        """The job's GPU-hours decayed with `half_life` (what fair share publishes)."""
        from eltctl.ledger.figures import decayed_gpu_seconds

        if self._conn is None:
            return 0.0
        return decayed_gpu_seconds(self._conn, now, half_life) / 3600.0

    # ----------------------------------------------------------------- internals

    def _tx(self):
        return _Transaction(self._conn)


class _Transaction:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN")

    def __exit__(self, exc_type, exc, tb) -> None:
        self.conn.execute("ROLLBACK" if exc_type else "COMMIT")


def _num(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float(default)


__all__ = ["GONE_AFTER_S", "HEARTBEAT_S", "OFFSET_MIN_S", "SAMPLE_EVERY_S", "UsageRecorder", "holder_of",
           "how_ended", "planned_how"]

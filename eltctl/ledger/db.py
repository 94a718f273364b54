"""The usage ledger's database file: `<controller state dir>/usage.db` (SQLite, WAL).

One writer, the job's controller (`recorder.UsageRecorder`); any number of readers
(`eltctl usage`, `eltctl status --watch`), which open it read-only and see the last
committed pass, also while the controller writes and after it is gone.

Tables (times are the controller's clock, seconds since the epoch)::

    intervals  one row per worker: the time it held a GPU (or a CPU slot)
               worker_id PRIMARY KEY (a worker is never counted twice), job, host,
               slot, kind ("gpu" | "cpu"), start, end (NULL: still open), last_seen
               (when the controller last saw it alive), offset (the host clock's
               offset subtracted from the daemon's times), state (its end state),
               how (how it ended: yield, signal, window, quota, cordon, scale,
               removed, straggler, planned, crash, down, finished, lost),
               exact (1: the end came from the daemon's history; 0: inferred)
    holders    who held each GPU when, as the controller observed it: host, slot,
               holder ("job" | "owner" | "taken" | "none" | "unknown"), detail,
               start, end (NULL: open), last_seen
    samples    every ~10 s while rank 0 reports: t, world_size, samples_per_s, step
    meta       key, value (schema version, job name)
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from eltctl.errors import EltctlError

SCHEMA_VERSION = 1
DB_NAME = "usage.db"

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS intervals (
    worker_id TEXT PRIMARY KEY, job TEXT NOT NULL, host TEXT NOT NULL, slot INTEGER NOT NULL,
    kind TEXT NOT NULL DEFAULT 'gpu', start REAL NOT NULL, end REAL, last_seen REAL NOT NULL,
    offset REAL NOT NULL DEFAULT 0, state TEXT NOT NULL DEFAULT '', how TEXT NOT NULL DEFAULT '',
    exact INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS intervals_host_start ON intervals (host, start);
CREATE INDEX IF NOT EXISTS intervals_open ON intervals (end);
CREATE TABLE IF NOT EXISTS holders (
    id INTEGER PRIMARY KEY, host TEXT NOT NULL, slot INTEGER NOT NULL, holder TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '', start REAL NOT NULL, end REAL, last_seen REAL NOT NULL);
CREATE INDEX IF NOT EXISTS holders_host_start ON holders (host, start);
CREATE TABLE IF NOT EXISTS samples (
    t REAL PRIMARY KEY, world_size INTEGER NOT NULL, samples_per_s REAL, step INTEGER);
"""


class LedgerError(EltctlError):
    """The usage ledger cannot be read."""


def open_writer(path: Path, job: str) -> sqlite3.Connection:
    """The controller's connection: creates the file and tables, WAL, autocommit
    (the recorder commits one transaction per pass)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), isolation_level=None, timeout=10.0)
    conn.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL: a commit survives a crash of the process (not of the machine's power).
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.executescript(SCHEMA)
    conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
    conn.execute("INSERT OR IGNORE INTO meta VALUES ('job', ?)", (job,))
    return conn


def open_reader(path: Path) -> sqlite3.Connection:
    """A read-only connection (it never blocks the writer nor changes the file)."""
    if not path.exists():
        raise LedgerError(f"no usage ledger at {path}",
                          hint="the controller writes it once the job runs (`eltctl up`)")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
        conn.execute("SELECT 1 FROM intervals LIMIT 1")
    except sqlite3.Error as exc:
        raise LedgerError(f"cannot read the usage ledger {path}: {exc}",
                          hint="check the file's permissions; a damaged file can be moved away "
                               "(the controller starts a new one)") from None
    return conn

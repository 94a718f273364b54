"""Reading the usage ledger: GPU-hours, how intervals ended, pauses, the GPU timeline.

Pure functions of a connection (read-only for the CLI, the recorder's own for the
quotas) and the times asked about. An interval still open counts up to `until` while
its controller runs (`live`), else up to the last time it was seen: nobody knows
more. Figures are clipped to the window [since, until].
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Mapping

BY_CHOICES = ("host", "gpu", "day")
HOLDERS = ("job", "owner", "taken", "none", "unknown")
PAUSE_MIN_S = 1.0  # a gap shorter than this between intervals is a hand-over, not a pause
YIELD_HOWS = ("yield", "signal")


@dataclass(frozen=True)
class Interval:
    worker_id: str
    host: str
    slot: int
    kind: str
    start: float
    end: float  # open ones: up to `until` (live) or their last sighting
    open: bool
    how: str
    exact: bool

    def within(self, since: float, until: float) -> float:
        return max(0.0, min(self.end, until) - max(self.start, since))


def intervals(conn: sqlite3.Connection, since: float, until: float, live: bool) -> list[Interval]:
    rows = conn.execute(
        "SELECT worker_id, host, slot, kind, start, end, last_seen, how, exact FROM intervals "
        "WHERE start < ? AND (end IS NULL OR end > ?) ORDER BY start", (until, since)).fetchall()
    out = []
    for wid, host, slot, kind, start, end, last_seen, how, exact in rows:
        is_open = end is None
        stop = (until if live else max(start, last_seen)) if is_open else end
        out.append(Interval(wid, host, slot, kind, start, max(start, stop), is_open, how or "", bool(exact)))
    return out


def gpu_seconds(conn: sqlite3.Connection, now: float, since: float | Mapping[str, float] = 0.0,
                live: bool = True) -> tuple[dict[str, float], float]:
    """GPU-seconds per host and in all since `since` (one time, or one per host: a host
    not named counts nothing), up to `now`. One aggregate query per distinct time, so
    the quotas can ask at every pass."""
    open_end = "?" if live else "MAX(start, last_seen)"
    query = (f"SELECT host, SUM(MAX(0, MIN(COALESCE(end, {open_end}), ?) - MAX(start, ?))) FROM intervals "
             "WHERE kind = 'gpu' AND start < ? AND (end IS NULL OR end > ?) GROUP BY host")
    groups: dict[float, set[str] | None] = {}
    if isinstance(since, Mapping):
        for host, t in since.items():
            groups.setdefault(float(t), set()).add(host)  # type: ignore[union-attr]
    else:
        groups[float(since)] = None
    per: dict[str, float] = {}
    for t, hosts in groups.items():
        args = ((now,) if live else ()) + (now, t, now, t)
        for host, secs in conn.execute(query, args):
            if hosts is None or host in hosts:
                per[host] = float(secs or 0.0)
    return per, sum(per.values())


def decayed(start: float, end: float, now: float, half_life: float) -> float:
    """The seconds of [start, end] each weighted by 2 ** -((now - t) / half_life): the
    integral of the decay over the interval (a second used one half-life ago counts half)."""
    import math

    end = min(end, now)
    if end <= start or half_life <= 0:
        return 0.0
    k = math.log(2) / half_life
    return (math.exp(-k * (now - end)) - math.exp(-k * (now - start))) / k


def decayed_gpu_seconds(conn: sqlite3.Connection, now: float, half_life: float) -> float:
    """The job's GPU-seconds, exponentially decayed with `half_life` (fair share's recent
    usage: controller/fairshare.py); open intervals count up to `now`."""
    rows = conn.execute("SELECT start, COALESCE(end, ?) FROM intervals WHERE kind = 'gpu' AND start < ?",
                        (now, now)).fetchall()
    return sum(decayed(float(a), float(b), now, half_life) for a, b in rows)


def _key(iv: Interval, by: str) -> str:
    return iv.host if by == "host" else f"{iv.host}:{iv.slot}"


def _days(start: float, end: float):
    """(day, seconds) pieces of [start, end) split at local midnights."""
    t = start
    while t < end:
        d = datetime.fromtimestamp(t).date()
        nxt = datetime(d.year, d.month, d.day) + timedelta(days=1)
        stop = min(end, nxt.timestamp())
        yield d.isoformat(), stop - t
        t = stop


def pauses(ivs: list[Interval], since: float, until: float) -> list[tuple[float, float]]:
    """The gaps (at least PAUSE_MIN_S) in which the job held no slot, from its first
    interval in the window on."""
    spans = sorted((max(iv.start, since), min(iv.end, until)) for iv in ivs if iv.within(since, until) > 0)
    out = []
    if not spans:
        return out
    reach = spans[0][1]
    for s, e in spans[1:]:
        if s - reach >= PAUSE_MIN_S:
            out.append((reach, s))
        reach = max(reach, e)
    return out


def usage(conn: sqlite3.Connection, *, since: float, until: float, live: bool, by: str = "host") -> dict:
    """The `eltctl usage --json` document (docs/commands.md)."""
    if by not in BY_CHOICES:
        raise ValueError(f"by must be one of {', '.join(BY_CHOICES)}, not {by!r}")
    ivs = intervals(conn, since, until, live)
    rows: dict[str, dict] = {}

    def row(key: str) -> dict:
        return rows.setdefault(key, {"key": key, "gpu_seconds": 0.0, "gpu_hours": 0.0, "cpu_slot_hours": 0.0,
                                     "workers": 0,
                                     "yields": 0, "ended": {}})

    for iv in ivs:
        pieces = list(_days(max(iv.start, since), min(iv.end, until))) if by == "day" else \
            [(_key(iv, by), iv.within(since, until))]
        for key, secs in pieces:
            r = row(key)
            if iv.kind == "gpu":
                r["gpu_seconds"] += secs
            else:
                r["cpu_slot_hours"] += secs / 3600.0
        r = row(pieces[-1][0] if pieces else _key(iv, by))
        r["workers"] += 1
        if not iv.open and since <= iv.end <= until:
            r["ended"][iv.how] = r["ended"].get(iv.how, 0) + 1
            r["yields"] += iv.how in YIELD_HOWS
    gaps = pauses(ivs, since, until)
    ended: dict[str, int] = {}
    for r in rows.values():
        r["gpu_hours"] = round(r["gpu_seconds"] / 3600.0, 6)
        r["gpu_seconds"] = round(r["gpu_seconds"], 3)
        r["cpu_slot_hours"] = round(r["cpu_slot_hours"], 6)
        for how, n in r["ended"].items():
            ended[how] = ended.get(how, 0) + n
    job = conn.execute("SELECT value FROM meta WHERE key = 'job'").fetchone()
    gpu = sum(iv.within(since, until) for iv in ivs if iv.kind == "gpu")
    return {
        "job": job[0] if job else None, "since": since, "until": until, "live": live, "by": by,
        "total": {"gpu_seconds": round(gpu, 3), "gpu_hours": round(gpu / 3600, 6),
                  "cpu_slot_hours": round(sum(iv.within(since, until) for iv in ivs if iv.kind != "gpu") / 3600, 6),
                  "workers": len(ivs), "open": sum(iv.open for iv in ivs),
                  "yields": sum(n for how, n in ended.items() if how in YIELD_HOWS),
                  "pauses": len(gaps), "paused_s": round(sum(e - s for s, e in gaps), 3), "ended": ended},
        "rows": sorted(rows.values(), key=lambda r: r["key"]),
    }


def timeline(conn: sqlite3.Connection, *, since: float, until: float, live: bool,
             buckets: int) -> dict[str, dict[int, list[str]]]:
    """host -> slot -> the holder of each of `buckets` equal time buckets across
    [since, until]: the one that held it longest in the bucket ("unknown" where nothing
    was observed). The job's own intervals count as "job" too: they cover the times no
    controller watched (a restart), from the daemons' history."""
    buckets = max(1, buckets)
    width = (until - since) / buckets
    share: dict[tuple[str, int], list[dict[str, float]]] = {}

    def add(host: str, slot: int, holder: str, start: float, end: float) -> None:
        cells = share.setdefault((host, slot), [dict() for _ in range(buckets)])
        s, e = max(start, since), min(end, until)
        if e <= s or width <= 0:
            return
        first, last = int((s - since) // width), min(buckets - 1, int((e - since) // width))
        for b in range(first, last + 1):
            lo, hi = since + b * width, since + (b + 1) * width
            part = min(e, hi) - max(s, lo)
            if part > 0:
                cells[b][holder] = cells[b].get(holder, 0.0) + part

    for host, slot, holder, start, end, last_seen in conn.execute(
            "SELECT host, slot, holder, start, end, last_seen FROM holders WHERE start < ? AND "
            "(end IS NULL OR end > ?)", (until, since)):
        add(host, slot, holder, start, end if end is not None else (until if live else last_seen))
    for iv in intervals(conn, since, until, live):
        add(iv.host, iv.slot, "job", iv.start, iv.end)
    out: dict[str, dict[int, list[str]]] = {}
    for (host, slot), cells in sorted(share.items()):
        out.setdefault(host, {})[slot] = [max(c, key=c.get) if c else "unknown" for c in cells]
    return out


def slot_kinds(conn: sqlite3.Connection) -> dict[str, str]:
    """host -> "gpu" or "cpu": what its slots are, as its newest worker interval says
    (a host the job never ran on is not named)."""
    return {host: kind for host, kind in conn.execute("SELECT host, kind FROM intervals ORDER BY start")}


def first_seen(conn: sqlite3.Connection) -> float | None:
    """When the ledger's first observation was made (None: an empty ledger)."""
    firsts = [row[0] for row in conn.execute(
        "SELECT MIN(start) FROM intervals UNION ALL SELECT MIN(start) FROM holders UNION ALL "
        "SELECT MIN(t) FROM samples") if row[0] is not None]
    return min(firsts) if firsts else None


def samples(conn: sqlite3.Connection, since: float) -> list[tuple[float, int, float | None]]:
    """(t, world_size, samples_per_s) from `since` on, oldest first."""
    return [(t, ws, sps) for t, ws, sps in
            conn.execute("SELECT t, world_size, samples_per_s FROM samples WHERE t >= ? ORDER BY t", (since,))]


def ended_counts(conn: sqlite3.Connection) -> dict[tuple[str, str], int]:
    """(host, how) -> how many of the job's workers ended that way there, ever (one
    aggregate query: the metrics ask about once a second)."""
    return {(str(host), str(how or "unknown")): int(n) for host, how, n in conn.execute(
        "SELECT host, how, COUNT(*) FROM intervals WHERE end IS NOT NULL GROUP BY host, how")}


__all__ = ["BY_CHOICES", "HOLDERS", "Interval", "ended_counts", "first_seen", "gpu_seconds", "intervals", "pauses",
           "samples", "slot_kinds", "timeline", "usage"]

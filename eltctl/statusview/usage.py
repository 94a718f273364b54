"""Drawing the usage ledger: `eltctl usage` (figures and a per-host GPU timeline) and
the small charts of `eltctl status --watch` (world size and samples/s of the last hour).

Pure functions of the documents `eltctl.ledger.figures` returns and a clock, so tests
compare exact output. The timeline is one row per GPU, one character per time bucket,
the holder that held the GPU longest in it (`TIMELINE_CHARS`, shown in a legend).
"""

from __future__ import annotations

from datetime import datetime, tzinfo
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from eltctl.durations import format_duration

TIMELINE_CHARS = {"job": "█", "owner": "▒", "taken": "▓", "none": "·", "unknown": " "}
TIMELINE_STYLES = {"job": "green", "owner": "yellow", "taken": "magenta", "none": "dim", "unknown": ""}
LEGEND = (("job", "this job"), ("owner", "its owner (GPU busy)"), ("taken", "another eltctl job"),
          ("none", "nobody"), ("unknown", "not observed"))
SPARK = "▁▂▃▄▅▆▇█"
CHART_WINDOW_S = 3600.0


def _span(seconds: float) -> str:
    return format_duration(round(seconds) if seconds >= 1 else round(seconds, 3))


def _clock(t: float, tz: tzinfo | None, with_date: bool = True) -> str:
    d = datetime.fromtimestamp(t, tz)
    return d.strftime("%Y-%m-%d %H:%M" if with_date else "%H:%M")


def _hours(h: float) -> str:
    return f"{h:.2f}"


def _ended(ended: Mapping[str, int]) -> str:
    return ", ".join(f"{how or '?'} {n}" for how, n in sorted(ended.items(), key=lambda x: (-x[1], x[0]))) or "-"


def usage_table(doc: Mapping):
    """The figures grouped as asked (`--by`): GPU-hours, workers, yields, how they ended."""
    from rich.table import Table

    t = Table(box=None, pad_edge=False, header_style="bold")
    t.add_column({"host": "host", "gpu": "host:GPU", "day": "day"}[doc["by"]])
    t.add_column("GPU-h", justify="right")
    cpu = any(r["cpu_slot_hours"] for r in doc["rows"])
    if cpu:
        t.add_column("CPU-slot-h", justify="right")
    t.add_column("workers", justify="right")
    t.add_column("yields", justify="right")
    t.add_column("ended")
    for r in doc["rows"]:
        cells = [r["key"], _hours(r["gpu_hours"])] + ([_hours(r["cpu_slot_hours"])] if cpu else [])
        t.add_row(*cells, str(r["workers"]), str(r["yields"]), _ended(r["ended"]))
    return t


def summary_lines(doc: Mapping, tz: tzinfo | None = None) -> list[str]:
    tot = doc["total"]
    lines = [f"[bold]{doc.get('job') or '?'}[/]: usage from {_clock(doc['since'], tz)} to {_clock(doc['until'], tz)}",
             f"  {_hours(tot['gpu_hours'])} GPU-hours"
             + (f", {_hours(tot['cpu_slot_hours'])} CPU-slot-hours" if tot["cpu_slot_hours"] else "")
             + f" by {tot['workers']} worker(s) ({tot['open']} still open); {tot['yields']} owner yield(s); "
             f"{tot['pauses']} pause(s)"
             + (f" ({_span(tot['paused_s'])} with no worker)" if tot["pauses"] else "")]
    if tot["ended"]:
        lines.append(f"  ended: {_ended(tot['ended'])}")
    if not doc["live"] and tot["open"]:
        lines.append("  [dim]the controller is not running: open intervals are counted up to when they were "
                     "last seen[/]")
    return lines


def timeline_rows(timeline: Mapping[str, Mapping[int, Sequence[str]]], kinds: Mapping[str, str] | None = None):
    """(label, rich text) per GPU or CPU slot: `host GPU n │cells│`, `host slot n │cells│`
    (`kinds`: host -> "gpu" or "cpu"; a host not named is taken for a GPU host)."""
    from rich.text import Text

    rows = []
    for host, slots in timeline.items():
        for slot, cells in sorted(slots.items()):
            label = f"{host} {'slot' if (kinds or {}).get(host) == 'cpu' else 'GPU'} {slot}"
            text = Text()
            for holder in cells:
                text.append(TIMELINE_CHARS.get(holder, "?"), style=TIMELINE_STYLES.get(holder, ""))
            rows.append((label, text))
    return rows


def render_timeline(timeline: Mapping[str, Mapping[int, Sequence[str]]], since: float, until: float,
                    tz: tzinfo | None = None, kinds: Mapping[str, str] | None = None):
    """The per-host timeline with its time axis and legend (`kinds`: timeline_rows)."""
    from rich.console import Group
    from rich.text import Text

    rows = timeline_rows(timeline, kinds)
    if not rows:
        return Text("no GPU or CPU slot was observed in this window", style="dim")
    width = max(len(label) for label, _ in rows)
    cells = max(len(t.plain) for _, t in rows)
    out = [Text("timeline (one character per " + _span((until - since) / max(1, cells)) + ")",
                style="bold")]
    for label, text in rows:
        line = Text(label.ljust(width) + " │")
        line.append_text(text)
        line.append("│")
        out.append(line)
    left, right = _clock(since, tz), _clock(until, tz)
    out.append(Text(" " * (width + 2) + left + right.rjust(max(1, cells - len(left))), style="dim"))
    legend = Text("  ".join(f"{TIMELINE_CHARS[k] if TIMELINE_CHARS[k] != ' ' else '␣'} {name}"
                            for k, name in LEGEND), style="dim")
    out.append(legend)
    return Group(*out)


def render_usage(doc: Mapping, timeline: Mapping[str, Mapping[int, Sequence[str]]] | None,
                 tz: tzinfo | None = None, kinds: Mapping[str, str] | None = None):
    """The whole `eltctl usage` view."""
    from rich.console import Group
    from rich.text import Text

    parts: list = [Text.from_markup(line) for line in summary_lines(doc, tz)]
    if doc["rows"]:
        parts += [Text(""), usage_table(doc)]
    if timeline is not None:
        parts += [Text(""), render_timeline(timeline, doc["since"], doc["until"], tz, kinds)]
    return Group(*parts)


# --------------------------------------------------------------------------- charts


def sparkline(points: Iterable[tuple[float, float | None]], since: float, until: float, width: int,
              top: float | None = None) -> str:
    """One character per time bucket across [since, until]: the bucket's last value,
    scaled to `top` (default: the largest); a space where there is none."""
    width = max(1, width)
    step = (until - since) / width
    cells: list[float | None] = [None] * width
    for t, v in points:
        if v is None or not since <= t <= until or step <= 0:
            continue
        cells[min(width - 1, int((t - since) // step))] = float(v)
    known = [c for c in cells if c is not None]
    hi = top if top is not None else max(known, default=0.0)
    out = []
    for c in cells:
        if c is None:
            out.append(" ")
        elif hi <= 0:
            out.append(SPARK[0])
        else:
            out.append(SPARK[max(0, min(len(SPARK) - 1, round(c / hi * (len(SPARK) - 1))))])
    return "".join(out)


def render_charts(samples: Sequence[tuple[float, int, float | None]], now: float, width: int = 60,
                  current: tuple[int, float | None] | None = None):
    """`status --watch`'s charts: world size and samples/s over the last hour. `current`:
    (world size, samples/s) of the status document shown above them, the charts' last
    point and the figures beside them (the ledger samples every ~10 s: without it the
    charts lag the view)."""
    from rich.text import Text

    since = now - CHART_WINDOW_S
    recent = [s for s in samples if s[0] >= since]
    if current is not None:
        recent.append((now, int(current[0]), current[1]))
    if not recent:
        return Text("last hour: no samples in the usage ledger yet", style="dim")
    ws = [(t, float(w)) for t, w, _ in recent]
    sps = [(t, s) for t, _, s in recent]
    ws_top = max(w for _, w in ws)
    sps_known = [s for _, s in sps if s is not None]
    sps_top = max(sps_known, default=0.0)
    last_ws, last_sps = recent[-1][1], recent[-1][2]
    lines = Text("last hour ", style="bold")
    lines.append(f"(one character per {_span(CHART_WINDOW_S / width)})\n", style="dim")
    lines.append("world size ")
    lines.append(sparkline(ws, since, now, width, ws_top), style="cyan")
    lines.append(f" {last_ws} (max {int(ws_top)})\n")
    lines.append("samples/s  ")
    lines.append(sparkline(sps, since, now, width, sps_top), style="green")
    lines.append(f" {last_sps:.1f} (max {sps_top:.1f})" if isinstance(last_sps, (int, float)) else " -")
    return lines


def ledger_charts(state_dir: Path, now: float, width: int = 60, current: tuple[int, float | None] | None = None):
    """The charts from the job's usage ledger, or None when it has none (yet); `current`:
    as `render_charts`."""
    import sqlite3

    from eltctl.ledger import DB_NAME, LedgerError, open_reader, samples

    try:
        conn = open_reader(state_dir / DB_NAME)
    except LedgerError:
        return None
    try:
        got = samples(conn, now - CHART_WINDOW_S)
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    return render_charts(got, now, width, current)


__all__ = ["CHART_WINDOW_S", "LEGEND", "TIMELINE_CHARS", "ledger_charts", "render_charts", "render_timeline",
           "render_usage",
           "sparkline", "summary_lines", "timeline_rows", "usage_table"]

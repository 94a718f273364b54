"""How values are written in the status view: ages, pauses, clocks, styles, and the view's options."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone, tzinfo
from typing import Any



# --------------------------------------------------------------------------- drawing

EVENTS_SHOWN = 8

JOB_STATE_STYLE = {"starting": "cyan", "waiting": "yellow", "paused": "blue", "training": "bold green",
                   "stopping": "yellow", "stopped": "dim", "finished": "bold blue"}
HOST_STATE_STYLE = {"running": "green", "starting": "cyan", "idle": "white", "busy": "red",
                    "cooldown": "yellow", "benched": "magenta", "removed": "dim",
                    "unreachable": "red", "unhealthy": "yellow", "cordoned": "dim", "off-hours": "blue",
                    "quota": "magenta", "disabled": "dim"}
GPU_STATE_STYLE = {"ours": "blue", "free": "green", "busy": "red", "taken": "magenta"}
EVENT_STYLE = {"yield": "bold yellow", "crash": "bold red", "hang": "red", "join": "green",
               "leave": "cyan", "bench": "magenta", "stop": "dim", "remove": "dim", "add": "green",
               "window": "blue", "quota": "magenta", "cordon": "dim"}


def format_age(seconds: float | None) -> str:
    """A short human duration: 0.4 s, 12 s, 3 min 05 s, 2 h 03 min."""
    if seconds is None:
        return "?"
    s = max(0.0, float(seconds))
    if s < 10:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        m, r = divmod(int(s), 60)
        return f"{m} min {r:02d} s"
    h, r = divmod(int(s) // 60, 60)
    return f"{h} h {r:02d} min"


def format_pause(seconds: float | None) -> str:
    """A pause of the job: milliseconds matter below a second."""
    if seconds is None:
        return ""
    s = float(seconds)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.2f} s"
    return format_age(s)


def format_clock(t: float | None, tz: tzinfo | None) -> str:
    if t is None:
        return "?"
    return datetime.fromtimestamp(float(t), tz).strftime("%H:%M:%S")


def show(value: Any) -> str:
    """A field of the document as text; `-` where it is unknown (null or missing)."""
    return "-" if value is None else str(value)


def num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class ViewOptions:
    """How to draw: the clock and the time zone are parameters so tests are exact."""

    now: float
    tz: tzinfo | None = None  # None: local time
    events: int = EVENTS_SHOWN
    title: str = ""  # e.g. the demo's narration above the job
    extra: tuple[str, ...] = field(default_factory=tuple)  # lines (rich markup) after the title
    layout: str = "auto"  # "wide", "compact", or "auto": wide from WIDE_MIN_WIDTH columns on



def utc() -> tzinfo:
    return timezone.utc

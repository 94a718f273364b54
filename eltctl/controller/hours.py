"""Working hours: when a host may be used, as pure functions of a spec, a zone and a time.

A spec (`HoursSpec`) is a list of windows in a host's wall-clock time, written in the
inventory as `hours = ["Mon-Fri 19:00-08:00", "Sat-Sun"]` (`parse_hours`):

- `DAYS` alone is the whole of those days (`"Sat-Sun"`, `"Mon,Wed"`, `"Fri"`);
- `DAYS HH:MM-HH:MM` is that stretch of each of those days (`HH:MM:SS` where seconds
  matter); a window whose end is not
  after its start runs past midnight and belongs to the day it starts on
  (`"Fri 19:00-08:00"` is Friday 19:00 to Saturday 08:00); `24:00` ends at midnight;
- `HH:MM-HH:MM` alone is every day; `"always"` (the default) is every moment.

Windows are wall-clock stretches: on the spring-forward day the skipped hour is in no
window (a `02:00-03:00` window is empty that day) and a window around the gap is that
much shorter; in autumn both runs of the repeated hour are in a window that covers it
(a `02:00-03:00` window lasts two hours that night). `in_window` answers for a moment,
`next_change` says when that answer next flips (for "usable again at Sat 00:00"), and
`usable` leaves `margin` seconds before a window closes.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone, tzinfo
from typing import Iterable

DAY_NAMES = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
ALL_DAYS = frozenset(range(7))
DAY_S = 24 * 3600
HORIZON_DAYS = 9  # a weekly spec flips within a week; a spec that never flips answers None

_TIME = r"(\d{1,2}):(\d{2})(?::(\d{2}))?"
_WINDOW = re.compile(rf"\s*(?P<days>[A-Za-z][A-Za-z,\s-]*?)?\s*(?:(?P<range>{_TIME}\s*-\s*{_TIME}))?\s*")


class HoursError(ValueError):
    """A window that cannot be read; the message says what to write instead."""


@dataclass(frozen=True)
class Window:
    """One window: the weekdays it starts on (0 = Monday) and its wall-clock start and
    end in seconds after midnight; end <= start runs past midnight into the next day."""

    days: frozenset[int]
    start: int = 0
    end: int = DAY_S

    @property
    def overnight(self) -> bool:
        return self.end <= self.start


@dataclass(frozen=True)
class HoursSpec:
    windows: tuple[Window, ...]
    text: tuple[str, ...] = ("always",)  # as written, for messages

    @property
    def always(self) -> bool:
        return any(w.days == ALL_DAYS and w.start == 0 and w.end == DAY_S for w in self.windows)


ALWAYS = HoursSpec(windows=(Window(ALL_DAYS),), text=("always",))


# --------------------------------------------------------------------------- reading

_FULL = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


def _day(name: str) -> int:
    word = name.strip().lower()
    for i, full in enumerate(_FULL):
        if len(word) >= 3 and full.startswith(word):
            return i
    raise HoursError(f"unknown day {name.strip()!r}; write days as Mon, Tue, Wed, Thu, Fri, Sat, Sun")


def _days(text: str) -> frozenset[int]:
    out: set[int] = set()
    for part in text.split(","):
        if not part.strip():
            raise HoursError(f"empty day in {text!r}; write e.g. Mon-Fri or Mon,Wed")
        if "-" in part:
            a, b = part.split("-", 1)
            i, j = _day(a), _day(b)
            k = i
            out.add(k)
            while k != j:  # Fri-Mon wraps over the weekend
                k = (k + 1) % 7
                out.add(k)
        else:
            out.add(_day(part))
    return frozenset(out)


def _seconds(h: str, m: str, sec: str | None, text: str) -> int:
    hh, mm, ss = int(h), int(m), int(sec or 0)
    if mm >= 60 or ss >= 60 or hh > 24 or (hh == 24 and (mm or ss)):
        raise HoursError(f"{text!r}: {h}:{m}{':' + sec if sec else ''} is not a time of day (00:00 to 24:00)")
    return hh * 3600 + mm * 60 + ss


def parse_window(text: str) -> Window:
    """One window as written: "Mon-Fri 19:00-08:00", "Sat-Sun", "22:00-06:00", "always"."""
    if text.strip().lower() in ("always", "any", "all"):
        return Window(ALL_DAYS)
    m = _WINDOW.fullmatch(text)
    if not m or not (m.group("days") or m.group("range")):
        raise HoursError(f"{text!r} is not a window; write e.g. \"Mon-Fri 19:00-08:00\", \"Sat-Sun\" "
                         "or \"always\"")
    days = _days(m.group("days")) if m.group("days") else ALL_DAYS
    if not m.group("range"):
        return Window(days)
    g = m.groups()
    start = _seconds(g[2], g[3], g[4], text)
    end = _seconds(g[5], g[6], g[7], text)
    if start == DAY_S:
        raise HoursError(f"{text!r}: a window cannot start at 24:00; start it at 00:00 of the next day")
    if start == end:
        raise HoursError(f"{text!r}: the window starts and ends at the same time; leave the times out for "
                         "the whole day")
    return Window(days, start, end)


def parse_hours(value: str | Iterable[str]) -> HoursSpec:
    """A spec from the inventory's value: "always", one window, or a list of windows."""
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise HoursError("an empty list of windows never allows the host; write \"always\" or a window")
    return HoursSpec(windows=tuple(parse_window(t) for t in items), text=tuple(items))


# --------------------------------------------------------------------------- zones

def zone(name: str | None) -> tzinfo:
    """The zone named (IANA, e.g. "Europe/Berlin"), or this machine's (`local_zone`)."""
    if name is None:
        return local_zone()
    from zoneinfo import ZoneInfo

    return ZoneInfo(name)


@functools.lru_cache(maxsize=1)
def local_zone() -> tzinfo:
    """This machine's zone with its DST rules: $TZ when it names a zone, else
    /etc/localtime, else UTC (a fixed offset would get the DST change wrong). Read once."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    name = os.environ.get("TZ", "").lstrip(":")
    if name:
        try:
            return ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            pass
    try:
        with open("/etc/localtime", "rb") as f:
            return ZoneInfo.from_file(f, key="localtime")
    except (OSError, ValueError):
        return timezone.utc


def valid_zone(name: str) -> bool:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return False
    return True


# --------------------------------------------------------------------------- answering

def in_window(spec: HoursSpec, tz: tzinfo, t: float) -> bool:
    """Is the wall-clock time in `tz` at POSIX time `t` inside one of the windows?"""
    local = datetime.fromtimestamp(t, tz)
    second = local.hour * 3600 + local.minute * 60 + local.second + local.microsecond / 1e6
    today = local.weekday()
    yesterday = (today - 1) % 7
    for w in spec.windows:
        if w.overnight:
            if (today in w.days and second >= w.start) or (yesterday in w.days and second < w.end):
                return True
        elif today in w.days and w.start <= second < w.end:
            return True
    return False


def _wall(d: date, second: int, tz: tzinfo, fold: int) -> float:
    """The POSIX time of wall-clock `second` of day `d` in `tz` (24:00: the next midnight)."""
    if second >= DAY_S:
        d, second = d + timedelta(days=1), second - DAY_S
    return datetime(d.year, d.month, d.day, second // 3600, second // 60 % 60, second % 60, tzinfo=tz,
                    fold=fold).timestamp()


def _offset_changes(d: date, tz: tzinfo) -> list[float]:
    """The instants on local day `d` where `tz`'s UTC offset changes (a DST change)."""
    lo = datetime(d.year, d.month, d.day, tzinfo=tz).timestamp()
    hi = lo + 26 * 3600.0

    def off(t: float) -> timedelta | None:
        return datetime.fromtimestamp(t, tz).utcoffset()

    if off(lo) == off(hi):
        return []
    while hi - lo > 1.0:  # the change lies in (lo, hi]: halve to the second
        mid = (lo + hi) / 2.0
        if off(mid) == off(lo):
            lo = mid
        else:
            hi = mid
    return [float(int(hi))]


def next_change(spec: HoursSpec, tz: tzinfo, t: float) -> float | None:
    """When `in_window` next gives another answer than now (None: never, e.g. "always").

    The answer can flip only at a window's wall-clock start or end (either run of a
    repeated hour) or at a DST change (a window ending in the skipped hour ends there),
    so these instants are the candidates, in order."""
    now = in_window(spec, tz, t)
    first = datetime.fromtimestamp(t, tz).date() - timedelta(days=1)
    candidates: set[float] = set()
    for k in range(HORIZON_DAYS):
        d = first + timedelta(days=k)
        candidates.update(_offset_changes(d, tz))
        for w in spec.windows:
            for second in (w.start, w.end):
                for fold in (0, 1):
                    candidates.add(_wall(d, second, tz, fold))
    for c in sorted(c for c in candidates if c > t):
        if in_window(spec, tz, c) != now:
            return c
    return None


def usable(spec: HoursSpec, tz: tzinfo, t: float, margin: float = 0.0) -> bool:
    """In a window that stays open for more than `margin` seconds from `t`."""
    if not in_window(spec, tz, t):
        return False
    if margin <= 0:
        return True
    closes = next_change(spec, tz, t)
    return closes is None or closes - t > margin


def usable_again(spec: HoursSpec, tz: tzinfo, t: float, margin: float = 0.0) -> float | None:
    """When a host that is not `usable` now becomes so (None: never, within a week)."""
    at = t
    for _ in range(16):  # windows too short for the margin are passed over
        if in_window(spec, tz, at):
            at = next_change(spec, tz, at)  # it closes (within the margin): the next one
            if at is None:
                return None
        at = next_change(spec, tz, at)
        if at is None:
            return None
        if usable(spec, tz, at, margin):
            return at
    return None


def show_time(t: float, tz: tzinfo, now: float | None = None) -> str:
    """"Sat 00:00" (within a week of `now`), else "2026-03-29 02:00"; in `tz`."""
    local = datetime.fromtimestamp(t, tz)
    if now is not None and t - now >= 6.5 * 86400:
        return local.strftime("%Y-%m-%d %H:%M")
    return f"{DAY_NAMES[local.weekday()]} {local:%H:%M:%S}" if local.second else \
        f"{DAY_NAMES[local.weekday()]} {local:%H:%M}"


__all__ = ["ALWAYS", "HoursError", "HoursSpec", "Window", "in_window", "local_zone", "next_change",
           "parse_hours", "parse_window", "show_time", "usable", "usable_again", "valid_zone", "zone"]

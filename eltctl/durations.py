"""Durations as people write them in hosts.toml: "90s", "10m", "1h30m", "500ms", or seconds.

Parsing is strict (the whole text must match) so that a typo such as "10 mins" is
an error that names the accepted forms, not a silently wrong value.
"""

from __future__ import annotations

import math
import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
FORMS = '"90s", "10m", "1h30m", "500ms" or a number of seconds'


def parse_duration(value: object) -> float:
    """Seconds in `value` (a str like "1h30m" or an int/float of seconds).

    Raises ValueError with a message that names the accepted forms.
    """
    if isinstance(value, bool):  # bool is an int to Python, never a duration to a person
        raise ValueError(f"expected a duration like {FORMS}, got {value}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_text(value)
    else:
        raise ValueError(f"expected a duration like {FORMS}, got {value}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be a finite number of seconds >= 0, got {value}")
    return seconds


def _parse_text(text: str) -> float:
    s = text.strip().lower()
    try:
        return float(s)  # "90" and "1.5" are seconds, as a bare number would be
    except ValueError:
        pass
    pos, total = 0, 0.0
    while pos < len(s):
        m = _PART.match(s, pos)
        if m is None:
            raise ValueError(f'"{text}" is not a duration: write it like {FORMS}')
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not s:
        raise ValueError(f"an empty string is not a duration: write it like {FORMS}")
    return total


def format_duration(seconds: float) -> str:
    """The shortest of the accepted forms that reads back as `seconds` (for messages)."""
    if seconds < 1 and seconds != 0:
        return f"{round(seconds * 1000)}ms"
    whole = int(seconds)
    if whole != seconds:
        return f"{seconds:g}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        n, whole = divmod(whole, size)
        if n:
            parts.append(f"{n}{unit}")
    return "".join(parts) or "0s"


def format_left(seconds: float) -> str:
    """A countdown as a person reads it: `42 s`, `9 min 12 s`, `1 h 05 min` (whole seconds, rounded up)."""
    s = max(0, math.ceil(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        m, r = divmod(s, 60)
        return f"{m} min {r} s" if r else f"{m} min"
    h, m = divmod(s // 60, 60)
    return f"{h} h {m:02d} min"

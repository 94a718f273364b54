"""Text that came from elsewhere (a host, the job's store), made safe for a terminal.

Rich escapes its markup, not control characters: a process name, a reason or an event
detail holding ESC sequences (written by anyone who could reach the store, or any user
on a host) would move the cursor, retitle the window or hide lines of `eltctl status`.
`printable` shows every control character as a visible `\\xNN` escape instead.
"""

from __future__ import annotations

import re
from typing import Any

# C0 controls except tab and newline, DEL, and the C1 controls (CSI is U+009B).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with each control character (other than tab and newline) as `\\xNN`."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def printable_tree(value: Any) -> Any:
    """A JSON-like value with `printable` applied to every string in it, keys included."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_tree(v) for v in value]
    return value

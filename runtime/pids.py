"""Process ids: whether one is alive, and the pid files that name them.

`pid_alive` has one meaning everywhere (the host daemon, checkpoint writers,
the controller, the demo): the process exists and is not a zombie. A zombie
has exited (its memory, files and GPU are released); only its parent has not
collected its status yet, so for every question we ask it is gone. Stdlib only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _state(pid: int) -> bytes | None:
    """The state letter in /proc/<pid>/stat (R, S, D, Z, X, ...), or None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int | None) -> bool:
    """The process exists (in our pid namespace) and is not a zombie.

    Another user's process counts as alive (signal 0 is refused, but it
    exists). Without /proc (not Linux) a process that exists is alive."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return _state(pid) not in (b"Z", b"X")


def read_pid_file(path: Path | str) -> int | None:
    """The pid a pid file names: its first word as a number, or the "pid" of a
    JSON object; None when missing, unreadable or malformed."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text.startswith("{"):
        try:
            value = json.loads(text).get("pid")
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    head = text.split()[0] if text else ""
    return int(head) if head.isdigit() else None

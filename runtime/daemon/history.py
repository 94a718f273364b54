"""The daemon's history of ended workers: the `"history"` of its state document.

Each entry is one worker that has ended, with its host wall-clock start and end:
`{"worker_id", "slot", "start", "end", "state", "why"}` (runtime/protocol.py,
`DAEMON_HISTORY_KEPT`). `state` is the worker's end state (left, finished, crashed,
evicted, killed, lost); `why` is what asked it to go, as this daemon knows it:
"yield" (the GPU's owner came back), "down" (the job or the daemon was told to stop),
"planned" (its slot left the desired slots: the controller knows the reason), or ""
(it ended unasked). The controller's usage ledger (eltctl/ledger) closes its
intervals from here with exact host times, also those that ended while no controller
watched. The newest `DAEMON_HISTORY_KEPT` entries are kept, also in `history.json` in
the job directory, so a daemon that restarts still reports the workers its
predecessor saw end.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

from .. import files
from ..protocol import DAEMON_HISTORY_KEPT, history_entry


class History:
    """The ended workers, newest last; the reasons workers were asked to go."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: deque[dict] = deque(maxlen=DAEMON_HISTORY_KEPT)
        self._why: dict[str, str] = {}

    def load(self) -> None:
        raw = files.read_json(self.path)
        if isinstance(raw, list):
            self._entries.extend(e for e in raw if isinstance(e, dict) and e.get("worker_id"))

    def note_why(self, worker_id: str, why: str) -> None:
        """What asked a worker to go. The first reason given stands, but an owner's
        return outranks a planned leave already under way (the owner waits for it)."""
        if why == "yield":
            self._why[worker_id] = why
        else:
            self._why.setdefault(worker_id, why)

    def ended(self, worker_id: str, slot: int, start: float, end: float, state: str) -> None:
        self._entries.append(history_entry(worker_id=worker_id, slot=slot, start=start, end=end, state=state,
                                           why=self._why.pop(worker_id, "")))
        try:
            files.write_json_atomic(self.path, list(self._entries), indent=None, sync=False)
        except OSError:
            pass  # the state document still carries it

    def entries(self) -> list[dict]:
        return list(self._entries)


def process_start(pid: int) -> float | None:
    """When a process started, by this host's wall clock, or None. /proc gives it in
    clock ticks since boot; the boot time in /proc/stat is whole seconds, so the
    clock since boot (CLOCK_BOOTTIME) is used to place it instead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, IndexError, ValueError, AttributeError):
        return None

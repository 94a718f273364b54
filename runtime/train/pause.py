"""A membership change's pause as one worker sees it: from its last commit in the old
generation to its first commit in the new one.

The job marks each phase as it ends (`mark`: the boundary, the plan, the roll call,
the group, the state, the reshard, the new generation's first forward and backward,
its first reduce, ...). At the new generation's first commit every rank logs where
the pause went, phase by phase (benchmarks/_eltctl_side.py reads the line), and the
generation's event (member/report.py's `generation_event`, noted in on_group and held
here until then) is handed back with the pause's length for rank 0 to write.
"""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("eltctl_runtime")


class Pause:
    """The marks since the last commit and the held event (module docstring)."""

    __slots__ = ("marks", "old_t", "last_commit_t", "event")

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []  # (phase, monotonic time it ended) since the last commit
        self.old_t = 0.0  # the last commit's time before the generation being formed (its event's pause)
        self.last_commit_t = 0.0
        self.event: dict | None = None  # the new generation's event, until its first commit

    def mark(self, phase: str) -> None:
        """A phase of a membership change's pause ended now."""
        self.marks.append((phase, time.monotonic()))

    def committed(self, now: float, *, had_state: bool, worker_id: str, generation: int) -> dict | None:
        """A step committed at `now`: at a generation's first commit, log where the pause
        went and return the held event with its pause (`pause_s`); None otherwise. The
        marks start over. `had_state`: this rank held the state before the generation
        formed (a joiner's pause starts at its join request)."""
        ev = None
        if self.event is not None:
            marks, start = self.marks + [("commit", now)], self.old_t if had_state else 0.0
            phases, t = [], start or marks[0][1]
            for name, at in marks:
                phases.append((name, round(at - t, 4)))
                t = at
            log.debug("worker %s: generation %d pause phases %s", worker_id, generation,
                      json.dumps({"total": round(now - (start or marks[0][1]), 4), "phases": phases}))
            ev, self.event = self.event, None
            old_t = ev.pop("old_t")
            ev["pause_s"] = round(now - old_t, 4) if old_t else None
        self.marks = []
        self.last_commit_t = now
        return ev

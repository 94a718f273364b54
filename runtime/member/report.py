"""What a member tells eltctl through the job's store: the status document, the
event log, the end of the job and the checkpoint it last announced.

Rank 0 of a generation reports, ElasticJob and restart mode's supervisor alike,
each through its session's `Reporter` (session.py). The reporter fills in what
every report of a member has (the generation's plan, the forged store values
this process counted, the last checkpoint committed, restart mode's `mode`); the
caller adds its own fields (the training's step and speed, the script's
progress). `generation_event` is the one shape of a generation's event. A write
that fails while the store is away is counted by the session's store health
(store/loss.py) and an event is held until the store is back; a member that does
not ride out the store's loss logs a failed status and lets a failed event raise.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..protocol import EventKind, Keys, add_event, status_document
from .plan import Plan

log = logging.getLogger("eltctl_runtime")


def generation_event(kind: EventKind, plan: Plan, **fields: Any) -> dict:
    """The event of a generation's start: its kind, size, members and who joined,
    left or was lost; then `fields` (the step it starts from, the pause, ...)."""
    return {"kind": kind.value, "generation": plan.generation, "world_size": plan.world_size,
            "members": list(plan.members), "joined": list(plan.joined), "left": list(plan.left),
            "lost": list(plan.lost), **fields}


class Reporter:
    """A member's reports (module docstring) through its `session` (a MemberSession: its
    store, plan, store health and forgeries). `mode` ("restart"): every event and the
    status say so. No I/O until a report is written."""

    def __init__(self, session: Any, mode: str | None = None) -> None:
        self._session = session
        self._mode = mode
        self.last_status_t = 0.0  # monotonic time the status was last written
        self.checkpoint: dict | None = None  # the last checkpoint committed, as the status shows it

    def checkpointed(self, info: Any, **fields: Any) -> None:
        """A checkpoint was committed (the writer's thread, or a restore took it up):
        the status names it from now on."""
        self.checkpoint = {"step": info.step, "time": info.created, "path": str(info.path), **fields}

    def status(self, now: float, *, paused: bool = False, **fields: Any) -> None:
        """Write the status document (protocol.status_document with `fields`: step,
        epoch, position, samples_per_s, loss, and workers, restarts, extra where
        known). `paused`: every member left, the members named hold nothing any more."""
        s = self._session
        plan = s.plan
        self.last_status_t = now
        doc = status_document(generation=plan.generation, world_size=plan.world_size, members=plan.members,
                              checkpoint=self.checkpoint, mode=self._mode, forged=s.forgeries.counts(), **fields)
        if paused:
            doc["paused"] = True
        try:
            s.store.set(Keys.STATUS, json.dumps(doc))
        except Exception as e:  # noqa: BLE001 - status is advisory (counted and logged once: store/loss.py)
            s.store_failed("status", e)

    def event(self, ev: dict) -> None:
        """Append `ev` (its kind first; `time` added when missing) to the job's event log."""
        if self._mode is not None:
            ev = {"kind": ev["kind"], "mode": self._mode, **ev}
        ev.setdefault("time", time.time())
        s = self._session
        try:
            add_event(s.store, ev)
        except Exception as e:  # noqa: BLE001 - the store is away: appended when it is back (store/loss.py)
            if s.health is None:
                raise
            s.store_failed("event", e)
            s.health.hold(ev)
        log.info("%s %s: event %s", s.label, s.me, json.dumps(ev))

    def stopped(self, step: int, **fields: Any) -> None:
        """The job stops (a stop request, or restart mode's restart limit): its event."""
        self.event({"kind": EventKind.STOP.value, "generation": self._session.plan.generation, "step": step,
                    **fields})

    def done(self, step: int, reason: str, **fields: Any) -> None:
        """The job is over (`reason`: finished, stop, failed): the done key every member
        and the controller watch."""
        self._session.store.set(Keys.DONE, json.dumps({"step": step, "reason": reason, **fields}))

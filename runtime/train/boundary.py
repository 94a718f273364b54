"""Where ElasticJob is between two steps: what the next step boundary owes.

A step ends in a commit or is dropped. What a commit asks for (a checkpoint, a
stop, a membership change) is not done in `job.step()` but at the boundary, when
the loop asks for the next batch: after the script's own code that follows
`job.step()` (a scheduler step) has run, so the state saved or handed over
includes it. A dropped step (a peer crashed or hung, a reduction broke), a
checkpoint whose transfer broke, or a generation that broke while forming owes
the roll call instead (generation.py's RECOVERING). The states and their
transitions are written once::

    STEPPING  --a step committed (its control tail read)-----------> COMMITTED
    STEPPING  --a step dropped, a generation broke while forming---> DROPPED
    COMMITTED --the boundary took what the commit asks for---------> STEPPING
    COMMITTED --a step dropped (before the boundary)---------------> DROPPED
    DROPPED   --the roll call begins-------------------------------> STEPPING
    any live  --the job ended for this rank (done, stop, the store
                lost, not admitted)--------------------------------> FINISHED
    any live  --this worker left the job (planned, or a pause)-----> LEFT

Beside the phase, what the boundaries carry from one to the next: a leave the last
commit asked for and held back while the ranks prepare for it (`leave_seen`), and
a checkpoint the control tail said is due (`checkpoint_due`, rank 0's clock) or
one owed by a boundary that had a membership change (`checkpoint_owed`: asked for
in the next step's control tail, tail.py).

Pure: no I/O; ElasticJob holds one `Boundary` and carries out what it says.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class StepPhase(str, Enum):
    """Where the job is between steps (the graph: module docstring)."""

    STEPPING = "stepping"
    COMMITTED = "committed"
    DROPPED = "dropped"
    FINISHED = "finished"
    LEFT = "left"


TRANSITIONS: dict[StepPhase, frozenset[StepPhase]] = {
    StepPhase.STEPPING: frozenset({StepPhase.COMMITTED, StepPhase.DROPPED, StepPhase.FINISHED, StepPhase.LEFT}),
    StepPhase.COMMITTED: frozenset({StepPhase.STEPPING, StepPhase.DROPPED, StepPhase.FINISHED, StepPhase.LEFT}),
    StepPhase.DROPPED: frozenset({StepPhase.STEPPING, StepPhase.FINISHED, StepPhase.LEFT}),
    StepPhase.FINISHED: frozenset(),
    StepPhase.LEFT: frozenset(),
}


class Ask(NamedTuple):
    """What a commit asks its boundary for, beside a checkpoint: a stop, and the
    leavers of a membership change (an empty set: a join; None: no change)."""

    stop: bool
    leavers: set[str] | None


class Boundary:
    """The job's step-boundary state (module docstring)."""

    __slots__ = ("phase", "_ask", "peer_gone", "leave_seen", "checkpoint_due", "checkpoint_owed")

    def __init__(self) -> None:
        self.phase = StepPhase.STEPPING
        self._ask: Ask | None = None  # COMMITTED: what the commit asks for
        self.peer_gone = False  # DROPPED: this rank's own collective failed (a peer is gone: generation.recover)
        # A leave the last commit asked for and held back while the ranks prepare for it
        # (ready_for_leave).
        self.leave_seen: frozenset[str] = frozenset()
        self.checkpoint_due = False  # the last commit's tail says a checkpoint is due (rank 0's clock)
        # A checkpoint due at a boundary where a membership change went: taken at the next
        # one (this rank asks for it in the next step's control tail).
        self.checkpoint_owed = False

    def _to(self, phase: StepPhase) -> None:
        if phase is not self.phase and phase not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"no step-boundary transition from {self.phase.value} to {phase.value}")
        self.phase = phase

    # -- the views ----------------------------------------------------------------------
    @property
    def over(self) -> bool:
        """The job ended for this rank, or this worker left it."""
        return self.phase is StepPhase.FINISHED or self.phase is StepPhase.LEFT

    @property
    def left(self) -> bool:
        return self.phase is StepPhase.LEFT

    @property
    def finished(self) -> bool:
        return self.phase is StepPhase.FINISHED

    @property
    def needs_recovery(self) -> bool:
        return self.phase is StepPhase.DROPPED

    # -- the transitions ----------------------------------------------------------------
    def tail_read(self, checkpoint: bool) -> None:
        """The step's summed control tail says whether a checkpoint is due; an owed one
        was asked for in it (a rank admitted since asks with the rest)."""
        self.checkpoint_due = checkpoint
        self.checkpoint_owed = False

    def committed(self, stop: bool, leaving: set[str], leave_ready: bool, join_ready: bool) -> None:
        """A step committed (STEPPING -> COMMITTED). `leaving`: the ranks' leave slots;
        a leave goes once every rank is ready for it (`leave_ready`), a join alone once
        every rank is (`join_ready`), a stop at once. A leave not ready yet is held back
        (`leave_seen`) while the ranks prepare for it."""
        leave = bool(leaving) and leave_ready
        change = stop or leave or join_ready
        self.leave_seen = frozenset(leaving) if leaving and not change else frozenset()
        self._to(StepPhase.COMMITTED)
        self._ask = Ask(stop, leaving if change else None)

    def take(self) -> Ask | None:
        """At the boundary: what the last commit asks for (COMMITTED -> STEPPING), or
        None when no commit came since the last boundary."""
        if self.phase is not StepPhase.COMMITTED:
            return None
        ask, self._ask = self._ask, None
        self._to(StepPhase.STEPPING)
        return ask

    def defer_checkpoint(self) -> None:
        """A membership change goes at this boundary: its due checkpoint goes at the next."""
        self.checkpoint_due, self.checkpoint_owed = False, True

    def dropped(self, peer_gone: bool = False) -> None:
        """A step was dropped, a checkpoint's transfer broke, or a generation broke while
        forming: the roll call at the boundary (-> DROPPED). `peer_gone`: this rank's own
        collective failed."""
        if self.over:
            return
        self._ask = None
        self.peer_gone = peer_gone
        self._to(StepPhase.DROPPED)

    def recovering(self) -> bool:
        """The roll call begins (-> STEPPING); whether this rank's own collective failed."""
        peer_gone, self.peer_gone = self.peer_gone, False
        if not self.over:
            self._to(StepPhase.STEPPING)
        return peer_gone

    def new_generation(self) -> None:
        """A generation formed: a leave held back for the old one is gone with it."""
        self.leave_seen = frozenset()

    def finish(self) -> None:
        """The job ended for this rank (-> FINISHED; a worker that left stays LEFT)."""
        if not self.over:
            self._ask = None
            self._to(StepPhase.FINISHED)

    def leave(self) -> None:
        """This worker left the job (-> LEFT; a rank whose job ended stays FINISHED)."""
        if not self.over:
            self._ask = None
            self._to(StepPhase.LEFT)

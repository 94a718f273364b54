"""`MirrorWorker`: mirrors committed checkpoints in the background, never blocking training."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from eltctl.errors import HostError
from eltctl.mirror.decisions import backoff_delay, lag
from eltctl.mirror.job import Mirror
from eltctl.mirror.values import Fault, MirrorError, Place

log = logging.getLogger("eltctl.mirror")

SourceLookup = Callable[[str], Awaitable[Place]]
RECHECK_S = 600.0  # after a permanent failure, the next try waits this long (or for `retry()`)


@dataclass
class _State:
    committed: int | None = None  # newest step rank 0 reported committed
    committed_host: str | None = None
    mirrored: int | None = None  # newest step verified on the mirror
    mirrored_time: float | None = None  # its `created`
    last_error: str | None = None
    last_attempt: float | None = None
    attempts: int = 0  # failed attempts in a row at the current step
    failures: int = 0
    mirrored_count: int = 0
    history: list[str] = field(default_factory=list)
    # the last failure, when it cannot succeed by retrying (permission, no space, ...):
    # the step it happened at is not retried; a newer one is tried once `recheck_s`
    # after it (or at once after `retry()`)
    fault: Fault | None = None
    fault_step: int | None = None
    fault_time: float | None = None
    # the last attempt failed because the checkpoint's host could not be reached
    source_unreachable: bool = False
    attempts_done: int = 0  # attempts ended, successful or not (flush counts them)


class MirrorWorker:
    """Mirrors committed checkpoints in the background (an asyncio task, started explicitly).

        worker = MirrorWorker(mirror, source=lambda name: host_place(fleet_transport(name), job))
        await worker.start()
        worker.notify("gpu3", 1200)       # rank 0 on gpu3 committed step 1200
        worker.status()                   # for `eltctl status`
        await worker.flush(timeout=120)   # `eltctl down`: the final checkpoint mirrored?
        await worker.stop()

    Only the newest notice matters: one still waiting is replaced by a newer one, and a
    failed copy is retried with back-off until it succeeds or a newer step is notified.
    A step whose source disappeared (host gone, retention) is dropped, not retried.
    Failures are sorted (`Mirror.fault`): a transient one (a reset connection, a
    timeout) is retried with back-off; a permanent one (permission, no space, a missing
    path, the mirror host's key or login) is not: `status()["problem"]` holds it with
    its fix, `flush` returns at once, and the newest checkpoint is tried again only
    `recheck_s` later (a fix is seen without a restart) or at once after `retry()`
    (`eltctl up` of the running job).
    """

    def __init__(self, mirror: Mirror, source: SourceLookup, *, clock: Callable[[], float] = time.time,
                 backoff_base: float = 2.0, backoff_cap: float = 60.0, recheck_s: float = RECHECK_S) -> None:
        self.mirror = mirror
        self._recheck = recheck_s
        self._source = source
        self._clock = clock
        self._base = backoff_base
        self._cap = backoff_cap
        self._state = _State()
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._attempted: asyncio.Event | None = None  # set after each attempt, while a flush waits
        # stop() asked: the loop ends at its next turn. Cancelling alone is not enough: a
        # wait_for whose event is set as the cancel arrives swallows it (Python < 3.12).
        self._stopping = False

    async def start(self) -> None:
        if self._task is not None:
            return
        self._wake, self._idle = asyncio.Event(), asyncio.Event()
        self._idle.set()
        try:  # learn what the mirror already holds (a restarted controller); best effort
            found = [c for c in await self.mirror.list_mirrored() if c.verified is not False]
            if found:
                self._state.mirrored, self._state.mirrored_time = found[0].step, found[0].created
        except (MirrorError, HostError) as exc:
            self._state.last_error = f"listing the mirror: {exc}"
            await self.mirror.reset()
        self._task = asyncio.create_task(self._loop(), name=f"mirror:{self.mirror.job}")

    def notify(self, host: str, step: int) -> None:
        """Checkpoint `step` was committed on `host` (from rank 0's status). Never blocks."""
        s = self._state
        if s.committed is not None and step <= s.committed:
            return
        s.committed, s.committed_host, s.attempts = step, host, 0
        if self._idle is not None and (s.mirrored is None or step > s.mirrored):
            self._idle.clear()
        if self._wake is not None:
            self._wake.set()

    def rewind(self, step: int) -> None:
        """The job restarted from checkpoint `step` (a restore that skipped newer, bad ones):
        notices count from there again, and a mirrored copy of a later step of the old
        run no longer counts as mirrored (its step will be committed anew and replaced)."""
        s = self._state
        s.committed, s.committed_host, s.attempts = step, None, 0
        if s.mirrored is not None and s.mirrored > step:
            s.mirrored, s.mirrored_time = step, None

    def status(self) -> dict[str, Any]:
        """{target, step, time, age_s, lag_steps, last_error, last_attempt} (+ pending, failures)."""
        s = self._state
        now = self._clock()
        return {
            "target": str(self.mirror.target),
            "step": s.mirrored,
            "time": s.mirrored_time,
            "age_s": None if s.mirrored_time is None else max(0.0, now - s.mirrored_time),
            "lag_steps": lag(s.committed, s.mirrored),
            "last_error": s.last_error,
            "last_attempt": s.last_attempt,
            "pending": s.committed if s.committed is not None and s.committed != s.mirrored else None,
            "failures": s.failures,
            "mirrored": s.mirrored_count,
            # a permanent failure ({kind, message, fix}): not retried, shown as a warning
            "problem": s.fault.as_json() if s.fault is not None else None,
        }

    def _todo(self) -> tuple[str, int] | None:
        s = self._state
        if s.committed is None or s.committed_host is None:
            return None
        if s.mirrored is not None and s.committed <= s.mirrored:
            return None
        if self._held_for() > 0:
            return None  # permanent: waits for a person (`retry()`), or `recheck_s`
        return s.committed_host, s.committed

    def _held_for(self) -> float:
        """Seconds until the next try after a permanent failure (0: not held; inf: only a
        newer checkpoint or `retry()` ends it)."""
        s = self._state
        if s.fault is None or s.fault_time is None:
            return 0.0
        if s.committed is not None and s.fault_step is not None and s.committed <= s.fault_step:
            return float("inf")
        return max(0.0, s.fault_time + self._recheck - self._clock())

    def retry(self) -> None:
        """Try the newest checkpoint now, whatever failed before (someone says it is fixed)."""
        s = self._state
        s.fault_time = None  # not held any more (status still shows the fault until a copy works)
        s.attempts = 0
        if self._wake is not None:
            self._wake.set()

    async def _loop(self) -> None:
        assert self._wake is not None and self._idle is not None
        while not self._stopping:
            todo = self._todo()
            if todo is None:
                self._idle.set()
                self._wake.clear()
                held = self._held_for()
                try:  # held after a permanent failure: wake when the hold ends, or on news
                    await asyncio.wait_for(self._wake.wait(), None if held in (0.0, float("inf")) else held)
                except asyncio.TimeoutError:
                    pass
                continue
            host, step = todo
            s = self._state
            s.last_attempt = self._clock()
            source_reached = False
            try:
                source = await self._source(host)
                source_reached = True
                copied = await self.mirror.mirror_checkpoint(source, step)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is recorded; training goes on
                s.failures += 1
                s.last_error = f"step {step} from {host}: {exc}"
                s.source_unreachable = not source_reached
                fault = self.mirror.fault(exc) if source_reached else None
                if source_reached:  # the mirror's side may have broken; not when the source's lookup failed
                    await self.mirror.reset()
                s.attempts_done += 1
                if fault is not None and fault.permanent:
                    if s.fault is None or s.fault.message != fault.message:
                        log.warning("Mirror %s: %s; not retried for %g s or until `eltctl up` (fix: %s)",
                                    self.mirror.target, s.last_error, self._recheck, fault.fix)
                    s.fault, s.fault_step, s.fault_time = fault, step, self._clock()
                    self._changed()
                    continue
                log.warning("Mirror %s: %s", self.mirror.target, s.last_error)
                self._changed()
                if isinstance(exc, MirrorError) and exc.source_gone and self._todo() == todo:
                    s.committed_host = None  # gone from its host: wait for the next notice
                    continue
                s.attempts += 1
                delay = backoff_delay(s.attempts, base=self._base, cap=self._cap)
                self._wake.clear()
                try:  # a newer notice ends the wait early
                    await asyncio.wait_for(self._wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                continue
            if s.mirrored is None or copied.step >= s.mirrored:
                s.mirrored, s.mirrored_time = copied.step, copied.created
            s.mirrored_count += 1
            s.attempts = 0
            s.last_error = None
            s.fault = s.fault_step = s.fault_time = None
            s.source_unreachable = False
            s.attempts_done += 1
            self._changed()
            log.info("Mirror %s: step %d from %s mirrored and verified.", self.mirror.target, step, host)

    def _changed(self) -> None:
        if self._attempted is not None:
            self._attempted.set()

    def _flushed(self) -> bool:
        s = self._state
        return s.committed is None or (s.mirrored is not None and s.mirrored >= s.committed)

    async def flush(self, timeout: float) -> bool:
        """Wait until the newest notified checkpoint is on the mirror, verified; False on
        timeout, and False at once when waiting cannot help: a permanent failure (see the
        class), or an attempt made during the flush could not reach the checkpoint's host
        (`eltctl down` after the hosts were lost: the copy cannot be made without them)."""
        if self._idle is None or self._wake is None:
            return self._flushed()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        s = self._state
        started = s.attempts_done
        self._wake.set()  # skip a back-off wait
        while True:
            if self._idle.is_set() and self._todo() is None:
                return self._flushed()
            if s.fault is not None and self._todo() is None:
                return False  # permanent: nothing will be tried until a newer checkpoint
            if s.attempts_done > started and s.source_unreachable:
                return False
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._attempted = asyncio.Event()
            idle = asyncio.ensure_future(self._idle.wait())
            attempted = asyncio.ensure_future(self._attempted.wait())
            try:
                await asyncio.wait({idle, attempted}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                idle.cancel()
                attempted.cancel()
                self._attempted = None

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            if self._wake is not None:
                self._wake.set()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self.mirror.close()

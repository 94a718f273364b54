"""`MirrorWorker` in-process, with a stand-in mirror: how it treats each kind of failure.

- a permanent failure (permission): one attempt, no back-off retries; `status()` holds
  the problem and its fix; `flush` answers at once; newer checkpoints wait `recheck_s`
  (or `retry()`, what `eltctl up` does) and, the fix made, mirror and clear the problem;
- a transient failure (a cut connection) is retried with back-off until it succeeds;
- the checkpoint's host unreachable during `flush` (`down` after the hosts were lost):
  `flush` answers after that attempt instead of waiting out its timeout.
"""

from __future__ import annotations

import asyncio

from eltctl.errors import HostError
from eltctl.mirror import Located, Mirror, MirrorError, MirrorWorker, parse_target
from eltctl.mirror.values import Place

DENIED = MirrorError("mirroring step {step} from h1 to mirror on h1 failed: PermissionError: [Errno 13] "
                     "Permission denied: '/m/j/.tmp-step'", errno="EACCES")


class StandIn:
    """The parts of `Mirror` the worker uses; `failures` says what each attempt raises."""

    def __init__(self, failures: list[BaseException | None]) -> None:
        self.real = Mirror(parse_target("/m"), "j")
        self.target, self.job = self.real.target, self.real.job
        self.failures = failures
        self.attempts: list[int] = []

    async def list_mirrored(self):
        return []

    async def mirror_checkpoint(self, host: Place, step: int) -> Located:
        self.attempts.append(step)
        failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            raise failure
        return Located(step, "mirror", f"/m/j/{step}", 1.0, 1, ())

    def fault(self, exc):
        return self.real.fault(exc)

    async def reset(self):
        pass

    async def close(self):
        pass


async def source(name: str) -> Place:
    return Place(name, None, "/ckpt")  # type: ignore[arg-type]


def test_a_permanent_failure_is_not_retried_shows_its_fix_and_does_not_hold_up_flush():
    async def main():
        mirror = StandIn([DENIED, DENIED, None])
        worker = MirrorWorker(mirror, source, backoff_base=0.01, backoff_cap=0.02)  # type: ignore[arg-type]
        await worker.start()
        try:
            worker.notify("h1", 100)
            await asyncio.sleep(0.3)  # many back-off periods: none is used
            parked = worker.status()
            # it answers at once: were it to wait out its 600 s, the guard would fail the test
            flushed = await asyncio.wait_for(worker.flush(timeout=600), 30)
            worker.notify("h1", 200)  # newer checkpoints are not tried either, for recheck_s (10 min)
            await asyncio.sleep(0.3)
            held = list(mirror.attempts)
            worker.retry()  # `eltctl up`: someone says it is fixed; it is not
            await asyncio.sleep(0.3)
            again = worker.status()
            worker.notify("h1", 300)
            worker.retry()  # fixed now
            ok = await asyncio.wait_for(worker.flush(timeout=600), 30)
            return mirror.attempts, held, parked, flushed, again, ok, worker.status()
        finally:
            await worker.stop()

    attempts, held, parked, flushed, again, ok, after = asyncio.run(main())
    assert held == [100] and attempts == [100, 200, 300]
    assert parked["failures"] == 1 and parked["lag_steps"] == 100
    assert parked["problem"]["kind"] == "permission" and "Permission denied" in parked["problem"]["message"]
    assert "same uid" in parked["problem"]["fix"] and "group-writable" in parked["problem"]["fix"]
    assert flushed is False
    assert again["failures"] == 2 and again["problem"] is not None
    assert ok and after["step"] == 300 and after["problem"] is None and after["last_error"] is None


def test_after_a_permanent_failure_a_newer_checkpoint_is_tried_once_recheck_s_has_passed():
    async def main():
        mirror = StandIn([DENIED, None])
        worker = MirrorWorker(mirror, source, recheck_s=0.5)  # type: ignore[arg-type]
        await worker.start()
        try:
            worker.notify("h1", 100)
            await asyncio.sleep(0.1)
            worker.notify("h1", 200)  # within recheck_s: held
            await asyncio.sleep(0.1)
            held = list(mirror.attempts)
            await asyncio.sleep(1.0)  # the hold ends by itself: 200 is tried and mirrored
            return held, mirror.attempts, worker.status()
        finally:
            await worker.stop()

    held, attempts, status = asyncio.run(main())
    assert held == [100] and attempts == [100, 200]
    assert status["step"] == 200 and status["problem"] is None


def test_a_transient_failure_is_retried_with_back_off_until_it_succeeds():
    cut = MirrorError("the copy from h1 to mirror was cut after 10 bytes: ConnectionResetError: reset")

    async def main():
        mirror = StandIn([cut, cut, None])
        worker = MirrorWorker(mirror, source, backoff_base=0.01, backoff_cap=0.02)  # type: ignore[arg-type]
        await worker.start()
        try:
            worker.notify("h1", 100)
            ok = await worker.flush(timeout=60)
            return mirror.attempts, ok, worker.status()
        finally:
            await worker.stop()

    attempts, ok, status = asyncio.run(main())
    assert attempts == [100, 100, 100] and ok
    assert status["failures"] == 2 and status["problem"] is None and status["step"] == 100


def test_flush_ends_when_the_checkpoints_host_cannot_be_reached():
    calls = []

    async def lost(name: str) -> Place:
        calls.append(name)
        raise HostError(name, f"{name}: connection refused", kind="unreachable")

    async def main():
        worker = MirrorWorker(StandIn([]), lost, backoff_base=5.0, backoff_cap=5.0)  # type: ignore[arg-type]
        await worker.start()
        try:
            worker.notify("h1", 100)
            await asyncio.sleep(0.1)  # the first attempt failed; a 5 s back-off runs
            ok = await asyncio.wait_for(worker.flush(timeout=600), 30)  # not its 600 s
            return ok, worker.status()
        finally:
            await worker.stop()

    ok, status = asyncio.run(main())
    assert ok is False  # after one more attempt (the back-off skipped)
    assert len(calls) == 2 and status["problem"] is None and "connection refused" in status["last_error"]


def test_stop_ends_the_worker_even_when_its_wait_ends_as_the_cancel_arrives():
    # `down`: flush wakes the worker (its event set), then stop cancels it at once; a
    # wait_for whose event is already set swallows that cancel (Python < 3.12), and the
    # worker would wait on for its 10-minute hold, with `down` waiting on it.
    async def main():
        worker = MirrorWorker(StandIn([DENIED]), source)  # type: ignore[arg-type]
        await worker.start()
        worker.notify("h1", 100)
        await asyncio.sleep(0.1)
        worker.notify("h1", 200)  # held: the worker waits (up to recheck_s) on its event
        await asyncio.sleep(0.1)
        assert await worker.flush(timeout=600) is False  # sets the event
        loop_task = worker._task
        stopping = asyncio.ensure_future(worker.stop())
        done, _ = await asyncio.wait({stopping}, timeout=30)
        return stopping in done, loop_task is not None and loop_task.done()

    stopped, loop_ended = asyncio.run(main())
    assert stopped and loop_ended

"""What is worth a notification: a pure function of the last status document and a clock.

`watch(before, doc, now, stall_after)` compares the status document the controller just
made (controller/status.py; its shape: docs/control-plane.md) with what was remembered
of the last one (`Watch`) and returns the new memory and the events to send:

    finished  rank 0 wrote the job's end (`done.reason` "finished"): the training returned
    failed    the job cannot go on by itself: restart mode stopped on its restart limit
              (`failed`), or every host given slots failed at start (`start_failed`);
              `cause` is the failing line (a traceback's exception line); the same
              cause again is news only after the job made progress
    paused    the job's state became "paused" (working hours, quotas, cordons leave too
              few slots); `resumed` when it leaves "paused" again
    stalled   no new step (nor restart-mode snapshot) for `stall_after` while the job is
              meant to run (not paused, stopping, stopped, failed or finished); once per
              stall: a new step re-arms it
    benched   a host was benched (its workers kept failing); `host`, `cause`
    quota     hosts reached a GPU-hours quota (`hosts`)
    forged    forged store values were read (the document's `forged.total` rose); at
              most once every FORGED_REPEAT_S, with the total then

The first document a controller sees sets the memory and sends nothing: a controller
restarted (or adopting a running job) does not repeat what its predecessor told.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

FORGED_REPEAT_S = 600.0
QUIET_STATES = ("paused", "stopping", "stopped", "failed", "finished")  # no stall is judged in these


@dataclass(frozen=True)
class Watch:
    """What the last status document said, as far as notifications go."""

    started: bool = False
    state: str = ""
    progress: tuple = ()  # (step, snapshot) last seen to change
    progress_at: float = 0.0  # when it last changed (or the clock restarted: paused, stopped)
    stalled: bool = False  # told for this stall
    benched: frozenset[str] = field(default_factory=frozenset)
    quota: frozenset[str] = field(default_factory=frozenset)
    forged: int = 0  # the forged total last told
    forged_told_at: float = float("-inf")
    done: str = ""  # the `done.reason` seen
    failed: str = ""  # the failure cause told ("" while none)


def notification(kind: str, job: str, now: float, detail: str, **extra: Any) -> dict[str, Any]:
    """One notification event: `{kind, job, time, detail, ...extra}` (docs/notifications.md)."""
    return {"kind": kind, "job": job, "time": now, "detail": detail, **extra}


def _failure(doc: Mapping[str, Any]) -> tuple[str, str | None]:
    """(cause, host) of a failed job; ("", None) while it is not failed."""
    if doc.get("failed"):
        return str(doc["failed"]), None
    start = doc.get("start_failed")
    if isinstance(start, dict) and start:
        host = sorted(start)[0]
        return str(start[host] or "its workers failed at start"), host
    return "", None


def _hosts(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    hosts = doc.get("hosts")
    return [h for h in hosts if isinstance(h, dict)] if isinstance(hosts, list) else []


def watch(before: Watch, doc: Mapping[str, Any], now: float, stall_after: float) -> tuple[Watch, list[dict]]:
    """The new memory and the events `doc` brings (see the module docstring)."""
    job = str(doc.get("job") or "?")
    state = str(doc.get("state") or "")
    step = doc.get("step")
    common = {"state": state, "step": step}
    done = doc.get("done") if isinstance(doc.get("done"), dict) else {}
    done_reason = str(done.get("reason") or "")
    cause, cause_host = _failure(doc)
    benched = frozenset(str(h.get("name")) for h in _hosts(doc) if h.get("benched_until"))
    quota = frozenset(str(h.get("name")) for h in _hosts(doc) if h.get("state") == "quota")
    forged_doc = doc.get("forged") if isinstance(doc.get("forged"), dict) else {}
    forged = forged_doc.get("total") if isinstance(forged_doc.get("total"), int) else 0
    progress = (step, doc.get("snapshot"))
    quiet = state in QUIET_STATES or bool(done_reason)

    if not before.started:
        return Watch(started=True, state=state, progress=progress, progress_at=now, benched=benched,
                     quota=quota, forged=forged, done=done_reason, failed=cause), []

    events: list[dict] = []
    if done_reason == "finished" and before.done != "finished":
        events.append(notification("finished", job, now, f"the training finished at step {done.get('step', step)}",
                                   **common))
    if cause and cause != before.failed:
        what = ("the job stopped on its restart limit" if doc.get("failed") else
                "the job's workers failed at start on every host given slots")
        events.append(notification("failed", job, now, f"{what}: {cause}", cause=cause,
                                   host=cause_host, **common))
    if state == "paused" and before.state != "paused":
        events.append(notification("paused", job, now, str(doc.get("message") or "paused"), **common))
    elif before.state == "paused" and state not in QUIET_STATES:
        events.append(notification("resumed", job, now, f"the job is {state} again", **common))

    stalled = before.stalled
    progress_at = before.progress_at
    if progress != before.progress or quiet:
        progress_at, stalled = now, False  # progress, or nothing is meant to run: the clock restarts
    elif not stalled and now - progress_at >= stall_after:
        stalled = True
        message = f" ({doc.get('message')})" if doc.get("message") else ""
        events.append(notification("stalled", job, now, f"no new step for {_minutes(now - progress_at)} "
                                   f"(step {step}; the job is {state}{message})", since=progress_at, **common))

    for host in sorted(benched - before.benched):
        entry = next((h for h in _hosts(doc) if h.get("name") == host), {})
        why = str(entry.get("last_problem") or entry.get("reason") or "its workers kept failing")
        events.append(notification("benched", job, now, f"host {host} is benched: {why}", host=host, cause=why,
                                   **common))
    if quota - before.quota:
        new = sorted(quota - before.quota)
        entry = next((h for h in _hosts(doc) if h.get("name") == new[0]), {})
        events.append(notification("quota", job, now, f"{', '.join(new)}: {entry.get('reason') or 'quota reached'}",
                                   hosts=new, **common))

    forged_told, told_at = before.forged, before.forged_told_at
    if forged > before.forged and now - before.forged_told_at >= FORGED_REPEAT_S:
        events.append(notification("forged", job, now, f"{forged} forged store value(s) read and ignored "
                                   f"({forged - before.forged} new): someone who reaches the store's port "
                                   "writes values not signed with the job's secret", total=forged,
                                   forged=dict(forged_doc), **common))
        forged_told, told_at = forged, now
    elif forged < before.forged:
        forged_told = forged  # a new controller's counts start again

    # A failure told stays told until the job makes progress again: a start failure that
    # comes and goes while hosts are retried is one notification, not one per retry.
    failed = cause or (before.failed if progress == before.progress else "")
    return replace(before, state=state, progress=progress, progress_at=progress_at, stalled=stalled,
                   benched=benched, quota=quota, forged=forged_told, forged_told_at=told_at,
                   done=done_reason, failed=failed), events


def _minutes(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


__all__ = ["FORGED_REPEAT_S", "Watch", "notification", "watch"]

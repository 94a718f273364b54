"""Delivering notifications: a thread of its own, a timeout per attempt, retries with
back-off, every delivery recorded.

`Notifier.submit(event)` only appends to a queue and returns at once: the controller's
loop never waits for a target. The thread (`start`/`stop`, never started by the
constructor) sends each event to the webhook and to the command of `[notify]`
(inventory/notify.py): an attempt is bounded by `timeout` (the HTTP request's socket
operations; the command is killed), a failed one is tried again `retries` times after
1 s, 2 s, 4 s ... (at most BACKOFF_MAX_S). At most MAX_PENDING events wait; beyond
that the oldest is dropped (counted). After each delivery the record is rewritten
atomically to `record_path` (the controller's: notify.json in the job's state
directory, `StateDir.notify_json`),

    {"delivered": n, "failed": n, "dropped": n, "pending": n,
     "last": {kind, target, ok, attempts, time, error},        # the last delivery
     "last_failure": {kind, target, attempts, time, error}}     # null: none failed yet

which the status document carries as `notify` (and `eltctl status` shows the last
failure). A webhook's URL is recorded as its scheme and host only (bodies.redact_url).
Only the standard library is used (urllib.request, subprocess).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping

from eltctl.inventory.notify import NotifySettings
from eltctl.notify.bodies import command_input, redact_url, webhook_request
from eltctl_runtime.files import write_json_atomic

log = logging.getLogger("eltctl.notify")

MAX_PENDING = 100
BACKOFF_S = 1.0
BACKOFF_MAX_S = 60.0
RESPONSE_MAX = 64 * 1024  # bytes of an answer read (and ignored)
ERROR_MAX = 300


def backoff(attempt: int) -> float:
    """Seconds before attempt `attempt` + 1 (attempt 1 failed: 1 s, then 2 s, 4 s, ...)."""
    return min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (attempt - 1))


def post_json(url: str, body: Mapping[str, Any], headers: tuple[tuple[str, str], ...], timeout: float) -> None:
    """POST `body` as JSON; raises OSError (urllib's errors are OSErrors) unless the answer is 2xx."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/json", "User-Agent": "eltctl", **dict(headers)})
    deadline = time.monotonic() + timeout
    with urllib.request.urlopen(req, timeout=timeout) as answer:  # noqa: S310 - the inventory's URL (http/https only)
        read = 0
        while read < RESPONSE_MAX and time.monotonic() < deadline:  # a trickling answer cannot hold us past it
            chunk = answer.read(4096)
            if not chunk:
                break
            read += len(chunk)
        if not 200 <= answer.status < 300:
            raise OSError(f"HTTP {answer.status}")


def run_command(argv: tuple[str, ...], event: Mapping[str, Any], timeout: float) -> None:
    """Run the notification command with the event on stdin; raises OSError on a failure."""
    env = {**os.environ, "ELTCTL_NOTIFY_KIND": str(event.get("kind", "")), "ELTCTL_JOB": str(event.get("job", ""))}
    try:
        done = subprocess.run(list(argv), input=command_input(event), capture_output=True, timeout=timeout, env=env,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        raise OSError(f"did not finish within {timeout:g} s (killed)") from None
    if done.returncode != 0:
        last = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        raise OSError(f"exited with status {done.returncode}" + (f": {last[-1]}" if last else ""))


def describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        text = f"HTTP {exc.code} {exc.reason}"
    elif isinstance(exc, urllib.error.URLError):
        text = str(exc.reason)
    elif isinstance(exc, (socket.timeout, TimeoutError)):
        text = "timed out"
    else:
        text = str(exc) or type(exc).__name__
    return text[:ERROR_MAX]


class Notifier:
    """Sends notification events from its own thread (see the module docstring)."""

    def __init__(self, settings: NotifySettings, record_path: Path | None = None, *,
                 clock: Callable[[], float] = time.time,
                 post: Callable[..., None] = post_json, run: Callable[..., None] = run_command) -> None:
        self.settings = settings
        self.record_path = record_path
        self.clock = clock
        self._post = post
        self._run = run
        self._queue: collections.deque[dict] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._stop_event = threading.Event()  # cuts a back-off wait short (a new event does not)
        self._busy = False
        self._thread: threading.Thread | None = None
        self._record: dict[str, Any] = {"delivered": 0, "failed": 0, "dropped": 0, "pending": 0,
                                        "last": None, "last_failure": None}

    # ------------------------------------------------------------ the controller's side

    def submit(self, event: dict) -> bool:
        """Queue `event` for delivery and return at once. False when [notify] sends nothing
        or not this kind."""
        if not self.settings.enabled or not self.settings.wants(str(event.get("kind"))):
            return False
        with self._cond:
            if len(self._queue) >= MAX_PENDING:
                self._queue.popleft()
                self._record["dropped"] += 1
            self._queue.append(dict(event))
            self._record["pending"] = len(self._queue)
            self._cond.notify()
        return True

    def status(self) -> dict[str, Any]:
        """The record (the status document's `notify`), pending events included."""
        with self._cond:
            doc = json.loads(json.dumps(self._record))
            doc["pending"] = len(self._queue) + (1 if self._busy else 0)
        return doc

    def start(self) -> "Notifier":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="eltctl-notify", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Deliver what is queued for up to `timeout` seconds more (no back-off waits),
        then leave the rest: the thread is a daemon and does not hold the process."""
        with self._cond:
            self._stopping = True
            self._stop_event.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "Notifier":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                event = self._queue.popleft()
                self._busy = True
                self._record["pending"] = len(self._queue) + 1
            try:
                self.deliver(event)
            except Exception:  # noqa: BLE001 - a delivery bug never ends the thread
                log.exception("Delivering a notification failed.")
            finally:
                with self._cond:
                    self._busy = False

    def deliver(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Send `event` to every target now, with the retries (blocking: the thread's
        work, and `eltctl notify test`'s). Returns one result per target."""
        s = self.settings
        results = []
        if s.webhook:
            url, body = webhook_request(s.webhook, s.format, event)
            results.append(self._attempts(event, f"webhook {redact_url(s.webhook)} ({s.format})",
                                          lambda: self._post(url, body, s.headers, s.timeout)))
        if s.command:
            results.append(self._attempts(event, f"command {s.command[0]}",
                                          lambda: self._run(s.command, event, s.timeout)))
        return results

    def _attempts(self, event: Mapping[str, Any], target: str, send: Callable[[], None]) -> dict[str, Any]:
        tries = 1 + max(0, self.settings.retries)
        error = ""
        attempt = 0
        for attempt in range(1, tries + 1):
            try:
                send()
            except Exception as exc:  # noqa: BLE001 - every failure is retried and recorded
                error = describe(exc)
                log.log(logging.WARNING if attempt == tries else logging.INFO,
                        "Notification %s to %s failed (attempt %d of %d): %s", event.get("kind"), target,
                        attempt, tries, error)
                if attempt < tries and not self._wait(backoff(attempt)):
                    break
                continue
            error = ""
            break
        result = {"kind": event.get("kind"), "target": target, "ok": not error, "attempts": attempt,
                  "time": self.clock(), "error": error or None}
        self._note(result)
        return result

    def _wait(self, seconds: float) -> bool:
        """Sleep before a retry (cut short when the notifier stops: the retries then
        follow at once). Always True: retry."""
        self._stop_event.wait(seconds)
        return True

    def _note(self, result: dict[str, Any]) -> None:
        with self._cond:
            rec = self._record
            rec["last"] = result
            if result["ok"]:
                rec["delivered"] += 1
            else:
                rec["failed"] += 1
                rec["last_failure"] = {k: v for k, v in result.items() if k != "ok"}
            doc = json.loads(json.dumps(rec))
        if self.record_path is not None:
            try:
                write_json_atomic(self.record_path, doc, sync=False)
            except OSError as exc:
                log.warning("Cannot write %s: %s", self.record_path, exc)


def read_record(path: Path) -> dict[str, Any] | None:
    """notify.json, or None."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


__all__ = ["BACKOFF_MAX_S", "MAX_PENDING", "Notifier", "backoff", "describe", "post_json",
           "read_record", "run_command"]

"""The inventory's `[notify]` table: where the controller sends the job's notifications.

    [notify]
    webhook = "https://ntfy.sh/my-lab-jobs"   # a JSON POST per event (eltctl/notify/bodies.py)
    format = "ntfy"                           # "json" (default), "slack" or "ntfy"
    headers = { Authorization = "Bearer tk_..." }
    command = ["notify-send", "eltctl"]       # run with the event as JSON on stdin (no shell)
    timeout = "10s"                           # per delivery attempt
    retries = 3                               # attempts after the first, with back-off
    stall_after = "30m"                       # no new step this long: a `stalled` event
    events = ["finished", "failed"]           # default: every kind (NOTIFY_EVENTS)

Neither `webhook` nor `command`: nothing is sent. docs/notifications.md says what each
event means and the bodies sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from eltctl.inventory.tables import ABSENT, BAD, Table, got, show

NOTIFY_KEYS = ("webhook", "format", "headers", "command", "timeout", "retries", "stall_after", "events")
# The event kinds, in the order docs/notifications.md lists them ("test": `eltctl notify test`).
NOTIFY_EVENTS = ("finished", "failed", "paused", "resumed", "stalled", "benched", "quota", "forged")
FORMATS = ("json", "slack", "ntfy")


@dataclass(frozen=True)
class NotifySettings:
    """[notify]; `enabled` when a webhook or a command is set."""

    webhook: str | None = None
    format: str = "json"
    headers: tuple[tuple[str, str], ...] = ()
    command: tuple[str, ...] | None = None
    timeout: float = 10.0  # seconds, per attempt (a command is killed after it)
    retries: int = 3  # attempts after the first; back-off 1 s, 2 s, 4 s ... (at most 60 s)
    stall_after: float = 1800.0  # seconds without a new step before `stalled`
    events: tuple[str, ...] = NOTIFY_EVENTS

    @property
    def enabled(self) -> bool:
        return bool(self.webhook or self.command)

    def wants(self, kind: str) -> bool:
        return kind == "test" or kind in self.events


def _webhook(t: Table) -> Any:
    url = t.string("webhook")
    if not isinstance(url, str):
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return t.fail("webhook", f"{show(url)} is not an http:// or https:// URL; write e.g. "
                                 'webhook = "https://ntfy.sh/my-topic"')
    return url


def _headers(t: Table) -> Any:
    value = t.raw("headers")
    if value is ABSENT:
        return ()
    if not isinstance(value, dict):
        return t.fail("headers", f'must be a table of strings, {got(value)}; write headers = '
                                 '{ Authorization = "Bearer ..." }')
    pairs = []
    for name, item in value.items():
        if not isinstance(item, str) or not name.strip() or any(c in name for c in ":\r\n ") \
                or any(c in item for c in "\r\n"):
            t.fail(f"headers.{name}", f"must be an HTTP header name with a one-line string value, {got(item)}")
            continue
        pairs.append((name, item))
    return tuple(pairs)


def notify_settings(t: Table) -> NotifySettings:
    """[notify], checked (a key that failed keeps its default; the problem is reported)."""
    d = NotifySettings()
    values = dict(
        webhook=_webhook(t),
        format=t.choice("format", d.format, FORMATS),
        headers=_headers(t),
        command=t.command("command", '["my-notifier", "--json"] (run without a shell, the event on stdin)'),
        timeout=t.duration("timeout", d.timeout, positive=True),
        retries=t.integer("retries", d.retries, lo=0, hi=10, meaning=" (attempts after the first)"),
        stall_after=t.duration("stall_after", d.stall_after, positive=True),
        events=t.names("events", NOTIFY_EVENTS, NOTIFY_EVENTS, noun="event kind"),
    )
    return NotifySettings(**{k: (getattr(d, k) if v is BAD else v) for k, v in values.items()})


__all__ = ["FORMATS", "NOTIFY_EVENTS", "NOTIFY_KEYS", "NotifySettings", "notify_settings"]

"""What a notification target receives (pure; docs/notifications.md shows each body).

A webhook gets one JSON POST (`webhook_request`), in the `[notify] format`:

- "json" (the default): the event's fields and a `text` line,
  `{"text": "eltctl job bert: finished: the training finished at step 1200", "kind":
  "finished", "job": "bert", "time": ..., "detail": ..., ...}`: Slack's and Mattermost's
  incoming webhooks show `text` (they ignore the other fields), a script reads the rest;
- "slack": `{"text": ...}` alone;
- "ntfy": ntfy's JSON publishing (`{"topic", "title", "message", "tags", "priority"}`),
  POSTed to the server's root: `webhook` is the topic's URL as ntfy shows it
  (`https://ntfy.sh/my-topic`), its last path segment is the topic.

A command gets the "json" body on stdin (`command_input`), one line, and the kind and
job in its environment (ELTCTL_NOTIFY_KIND, ELTCTL_JOB).
"""

from __future__ import annotations

import json
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

TITLES = {"finished": "finished", "failed": "FAILED", "paused": "paused", "resumed": "resumed",
          "stalled": "no progress", "benched": "host benched", "quota": "quota reached",
          "forged": "forged store values", "test": "test notification"}
NTFY_TAGS = {"finished": "white_check_mark", "failed": "x", "paused": "pause_button", "resumed": "arrow_forward",
             "stalled": "hourglass", "benched": "warning", "quota": "chart_with_upwards_trend",
             "forged": "rotating_light", "test": "bell"}
NTFY_PRIORITY = {"failed": 5, "stalled": 4, "forged": 4, "benched": 4}  # others: 3, ntfy's default


def text_line(event: Mapping[str, Any]) -> str:
    kind = str(event.get("kind", "?"))
    return f"eltctl job {event.get('job', '?')}: {TITLES.get(kind, kind)}: {event.get('detail', '')}"


def json_body(event: Mapping[str, Any]) -> dict[str, Any]:
    return {"text": text_line(event), **event}


def command_input(event: Mapping[str, Any]) -> bytes:
    """A command's stdin: the "json" body, one line."""
    return (json.dumps(json_body(event)) + "\n").encode()


def webhook_request(url: str, fmt: str, event: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the URL to POST to, the JSON body) for `event` in format `fmt`."""
    if fmt == "slack":
        return url, {"text": text_line(event)}
    if fmt == "ntfy":
        parts = urlsplit(url)
        path = parts.path.rstrip("/")
        topic = path.rsplit("/", 1)[-1]
        root = urlunsplit((parts.scheme, parts.netloc, path[: len(path) - len(topic)] or "/", "", ""))
        kind = str(event.get("kind", ""))
        return root, {"topic": topic, "title": f"eltctl {event.get('job', '?')}: {TITLES.get(kind, kind)}",
                      "message": str(event.get("detail", "")), "tags": [NTFY_TAGS.get(kind, "bell")],
                      "priority": NTFY_PRIORITY.get(kind, 3)}
    return url, json_body(event)


def redact_url(url: str) -> str:
    """A webhook URL as records and `status` show it: scheme and host only. Its path
    often is the secret (a Slack webhook's token, an ntfy topic)."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}/…"


__all__ = ["command_input", "json_body", "redact_url", "text_line", "webhook_request"]

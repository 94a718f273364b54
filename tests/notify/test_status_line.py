"""`eltctl status` shows the last failed delivery of a notification in one line (the
document's `notify.last_failure`), and nothing while none failed."""

from __future__ import annotations

from eltctl.statusview import Source
from tests.test_statusview import NOW, TRAINING, view_text

FAILURE = {"kind": "failed", "target": "webhook https://ntfy.sh/… (ntfy)", "attempts": 4, "time": NOW - 125,
           "error": "HTTP 500 Internal Server Error"}


def line(text: str) -> str:
    return next((ln for ln in text.splitlines() if ln.startswith("notify")), "")


def test_the_last_failure_is_one_line_with_its_target_attempts_and_error():
    doc = {**TRAINING, "notify": {"delivered": 3, "failed": 1, "dropped": 0, "pending": 0, "last": FAILURE | {
        "ok": False}, "last_failure": FAILURE}}
    assert line(view_text(doc, Source.CONTROLLER, NOW)) == (
        "notify      last failure 2 min 05 s ago: failed to webhook https://ntfy.sh/… (ntfy) after 4 attempt(s): "
        "HTTP 500 Internal Server Error")
    later = {"kind": "finished", "target": FAILURE["target"], "ok": True, "attempts": 1, "time": NOW - 5}
    doc["notify"] = {**doc["notify"], "last": later}
    assert line(view_text(doc, Source.CONTROLLER, NOW)).endswith("   delivered since")


def test_no_line_while_nothing_failed():
    ok = {"delivered": 3, "failed": 0, "dropped": 0, "pending": 0, "last": None, "last_failure": None}
    assert line(view_text({**TRAINING, "notify": ok}, Source.CONTROLLER, NOW)) == ""
    assert line(view_text(TRAINING, Source.CONTROLLER, NOW)) == ""

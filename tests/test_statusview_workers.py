"""`eltctl status`: each worker's share and speed (the workers table), from fixed
documents (exact text), and the controller's document carrying them."""

from __future__ import annotations

import copy
import textwrap

from eltctl.controller.status import worker_entries
from eltctl.statusview import Source, worker_note
from tests.test_statusview import NOW, TRAINING, view_text

RUNTIME = {"members": ["ws1/0/1", "ws1/1/1", "ws3/0/1"], "workers": {
    "ws3/0/1": {"share": 1, "samples_per_s": 9.5, "relative_speed": 0.03, "speedup_without": 1.4,
                "straggler": True},
    "ws1/0/1": {"share": 32, "samples_per_s": 305.2, "relative_speed": 1.0, "speedup_without": 0.52,
                "straggler": False},
    "ws1/1/1": {"share": 31, "samples_per_s": 301.0, "relative_speed": 0.99, "speedup_without": 0.51,
                "straggler": False},
}}


def test_worker_entries_are_in_rank_order_with_every_field():
    entries = worker_entries(RUNTIME)
    assert [e["worker"] for e in entries] == RUNTIME["members"]
    assert entries[2] == {"worker": "ws3/0/1", "share": 1, "samples_per_s": 9.5, "relative_speed": 0.03,
                          "speedup_without": 1.4, "straggler": True}
    assert worker_entries({"members": ["a"]}) == [] and worker_entries({}) == []


def test_worker_note_says_why_a_straggler_is_one():
    assert worker_note({"straggler": False, "relative_speed": 0.1}) == ""
    assert worker_note({"straggler": True, "relative_speed": 0.031, "speedup_without": 1.4}) == \
        "straggler: 0.031x the others' speed, the job is 1.4x faster without it"
    assert worker_note({"straggler": True, "relative_speed": 0.2, "speedup_without": 0.9}) == \
        "straggler: 0.2x the others' speed"


def test_the_view_shows_each_workers_share_and_speed_under_the_job():
    doc = copy.deepcopy(TRAINING)
    doc["workers"] = worker_entries(RUNTIME)
    text = view_text(doc, Source.CONTROLLER, NOW + 0.5)
    lines = text.split("controller  running (pid 4242), status 0.5 s old\n\n", 1)[1].splitlines()[:5]
    assert lines[0] == "  worker    share   samples/s   note" and set(lines[1].strip()) == {"─"}
    assert lines[2:] == [
        "  ws1/0/1      32       305.2",
        "  ws1/1/1      31       301.0",
        "  ws3/0/1       1         9.5   straggler: 0.03x the others' speed, the job is 1.4x faster without it"]
    assert "workers     3 (min 2, max 8)" in text  # the rest of the view is as without

"""Where a cold start resumed from, and a newer checkpoint out of reach (issue 50,
finding 5: training went back from step 2235 to 2001 without a word)."""

from __future__ import annotations

import pytest

from eltctl.controller import resume

KNOWN = {"step": 2235, "host": "gone", "path": "/h/.eltctl/jobs/j/gone/checkpoints", "time": 1.0}


@pytest.mark.parametrize("known, chosen, looked_at, hosts, expected", [
    # the newest seen was on a host taken out of the inventory
    (KNOWN, 2001, ["b"], ["b"], {"host": "gone", "step": 2235, "why": resume.NOT_IN_INVENTORY}),
    # ... on a host of the inventory that did not answer
    (KNOWN, 2001, ["b"], ["b", "gone"], {"host": "gone", "step": 2235, "why": resume.NOT_REACHED}),
    # nothing restored at all: the job would start from step 0
    (KNOWN, None, [], ["b"], {"host": "gone", "step": 2235, "why": resume.NOT_IN_INVENTORY}),
    # the host was looked at: found, or passed over with its reason said elsewhere
    (KNOWN, 2001, ["b", "gone"], ["b", "gone"], None),
    # the one restored is as new (from the mirror, say)
    (KNOWN, 2235, ["b"], ["b"], None),
    ({**KNOWN, "step": 10}, 2001, ["b"], ["b"], None),
    # nothing remembered, or not where
    (None, 2001, ["b"], ["b"], None),
    ({"step": 2235, "host": None}, 2001, ["b"], ["b"], None),
    ({"step": "2235", "host": "gone"}, 2001, ["b"], ["b"], None),
])
def test_newer_out_of_reach(known, chosen, looked_at, hosts, expected):
    assert resume.newer_out_of_reach(known, chosen, looked_at, hosts) == expected


def _restore(time, step, where, newer=None):
    ev = {"time": time, "kind": "restore", "host": None, "detail": "...", "step": step, "where": where}
    return {**ev, "newer": newer} if newer else ev


def test_up_lines_say_where_from_and_warn_of_a_newer_one():
    newer = {"host": "gone", "step": 2235, "why": resume.NOT_IN_INVENTORY}
    events = [_restore(5.0, 100, "b"), {"time": 11.0, "kind": "start", "host": "b"},
              _restore(12.0, 2001, "b", newer),
              # the runtime's own restore event (what rank 0 loaded) comes after the controller's
              {"time": 13.0, "kind": "restore", "host": None, "from_step": 2001, "step": 2002}]
    lines = resume.up_lines(events, since=10.0)
    assert lines[0] == (False, "resumed from step 2001 (host b)")
    warning, text = lines[1]
    assert warning and "step 2235" in text and "host gone" in text and "no longer in the inventory" in text
    assert "resumes from step 2001" in text and "add gone back to the inventory" in text


def test_up_lines_only_for_this_start():
    assert resume.up_lines([_restore(5.0, 100, "mirror")], since=10.0) == []
    assert resume.up_lines([_restore(10.0, 100, "mirror")], since=10.0) == [
        (False, "resumed from step 100 (the mirror)")]
    assert resume.up_lines([], since=0.0) == []


def test_up_lines_when_nothing_was_restored_but_a_newer_one_is_out_of_reach():
    newer = {"host": "h3", "step": 40, "why": resume.NOT_REACHED}
    [(warning, text)] = resume.up_lines([_restore(1.0, None, None, newer)], since=0.0)
    assert warning and "resumes from step 0" in text and "make h3 reachable" in text

"""The daemon's history of ended workers (runtime/daemon/history.py): what asked each
worker to go, the newest DAEMON_HISTORY_KEPT entries kept across a daemon restart, and
a process's start time read from /proc."""

from __future__ import annotations

import subprocess
import sys
import time

from eltctl_runtime.daemon.history import History, process_start
from eltctl_runtime.protocol import DAEMON_HISTORY_KEPT


def test_each_ended_worker_says_what_asked_it_to_go(tmp_path):
    h = History(tmp_path / "history.json")
    h.note_why("w/0/1", "planned")
    h.note_why("w/0/1", "down")  # the first reason stands
    h.note_why("w/1/2", "planned")
    h.note_why("w/1/2", "yield")  # but an owner's return outranks a planned leave under way
    h.ended("w/0/1", 0, 100.0, 160.0, "left")
    h.ended("w/1/2", 1, 100.0, 130.0, "evicted")
    h.ended("w/2/3", 2, 100.0, 110.0, "crashed")  # unasked
    assert [(e["worker_id"], e["why"], e["state"], e["end"] - e["start"]) for e in h.entries()] == [
        ("w/0/1", "planned", "left", 60.0), ("w/1/2", "yield", "evicted", 30.0), ("w/2/3", "", "crashed", 10.0)]


def test_the_newest_entries_are_kept_across_a_daemon_restart(tmp_path):
    h = History(tmp_path / "history.json")
    for n in range(DAEMON_HISTORY_KEPT + 5):
        h.ended(f"w/0/{n}", 0, float(n), float(n) + 1, "left")
    again = History(tmp_path / "history.json")
    again.load()
    kept = [e["worker_id"] for e in again.entries()]
    assert len(kept) == DAEMON_HISTORY_KEPT and kept[0] == "w/0/5" and kept[-1] == f"w/0/{DAEMON_HISTORY_KEPT + 4}"


def test_a_process_start_is_read_to_within_a_clock_tick(tmp_path):
    before = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    after = time.time()
    try:
        start = process_start(proc.pid)
        assert start is not None and before - 0.02 <= start <= after + 0.02, (before, start, after)
    finally:
        proc.kill()
        proc.wait()
    assert process_start(proc.pid) is None

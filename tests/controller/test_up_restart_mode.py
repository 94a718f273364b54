"""`up` and a restart-mode job: when it counts as training, what it prints, and its
error when the job stopped on `max_restarts` (eltctl/controller/client.py)."""

from __future__ import annotations

import pytest

from eltctl.controller.client import restart_failed_error, training_message, trains
from eltctl.controller.status import restart_fields


@pytest.mark.parametrize("doc, expect", [
    ({"mode": "elastic", "step": 0}, False),
    ({"mode": "elastic", "step": 1}, True),
    # restart mode: the status step may stand still or be unknown while the script trains
    ({"mode": "restart", "step": None, "script": {"running": False}}, False),
    ({"mode": "restart", "step": 7000, "script": {"running": False}}, False),  # restored, not running yet
    ({"mode": "restart", "step": None, "script": {"running": True}}, True),
])
def test_up_counts_a_restart_mode_job_as_training_once_its_scripts_run(doc, expect):
    assert trains(doc) is expect


def test_up_prints_the_world_size_and_the_scripts_step_where_known():
    assert training_message({"mode": "restart", "world_size": 1, "step": 11234}) == \
        "training: world size 1, step 11234 (the script's)"
    assert training_message({"mode": "restart", "world_size": 2, "step": None}) == (
        "training: world size 2 (restart mode; the script's step is not known: set [job] progress or call "
        "eltctl_runtime.report)")
    assert training_message({"mode": "elastic", "world_size": 3, "step": 5}) == "training: world size 3, step 5"


def test_up_names_the_scripts_last_line_when_the_job_stopped_on_its_restart_limit():
    failed = "the script exited 5 times in 10 min; last line: ModuleNotFoundError: No module named 'foo'"
    err = restart_failed_error({"failed": failed, "script": {"ever_running": False}})
    assert err.message == f"the job's script failed at start; the job stopped: {failed}"
    assert "install" in err.hint or "module" in err.hint, err.hint
    later = restart_failed_error({"failed": failed, "script": {"ever_running": True}})
    assert later.message.startswith("the job's script failed; the job stopped")


def test_the_status_document_carries_restart_modes_fields():
    rs = {"snapshot": 4, "failed": None, "script": {"step": 9, "step_from": "output", "running": True,
                                                    "metrics": {"lr": 0.1}}}
    fields = restart_fields(rs)
    assert fields["snapshot"] == 4 and fields["failed"] is None
    assert fields["script"]["step_from"] == "output" and fields["script"]["running"] is True
    assert "metrics" not in fields["script"]

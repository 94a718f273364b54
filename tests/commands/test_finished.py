"""A job whose training returns, end to end on this machine (`address = "local"`, the
test bed of test_up.py): the controller stops every daemon and ends, `eltctl status`
says "finished" with no worker (before: "starting (starting workers)" for ever, the
hosts "starting", and a new worker found the job done and exited at once); `up` of
the unchanged job starts nothing (a cron entry would otherwise rerun it, and its
notification, every time); `up` after raising the steps trains on from the last
checkpoint; `down` forgets the end."""

from __future__ import annotations

import json

import pytest

from eltctl_runtime.files import read_json
from eltctl_runtime.pids import pid_alive
from tests.commands.test_up import local_job  # noqa: F401 - the fixture
from tests.testbed.hostpython import HOST_PYTHON
from tests.testbed.jobenv import job_pids, wait_for


def command(steps: int) -> list[str]:
    return ["python", "train.py", "--steps", str(steps), "--hidden", "16", "--layers", "1", "--samples", "512",
            "--batch", "8", "--step-sleep", "0.02", "--checkpoint-every", "10"]


def finished(lj, step: int) -> dict:
    doc = lj.status()
    return doc if doc.get("state") == "finished" and doc.get("step") == step else {}


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_finished_job_ends_its_controller_and_daemons_and_up_trains_on_only_when_the_job_changed(
        local_job):  # noqa: F811
    lj = local_job
    lj.write({"h1": HOST_PYTHON, "h2": HOST_PYTHON}, command=command(30))
    (lj.root / "claims").mkdir(exist_ok=True)  # the probe makes each host's claims directory, not its parent
    out, _ = lj.eltctl("up", "--timeout", "240")
    assert out.returncode == 0, out.stdout + out.stderr
    first = lj.controller_pid()
    doc = wait_for(lambda: finished(lj, 30), 120, "the job finished at step 30")
    assert doc["phase"] == "finished" and doc["done"] == {"step": 30, "reason": "finished"}
    assert "the training finished at step 30; every worker and daemon stopped" in doc["message"]
    assert doc["world_size"] == 0 and doc["members"] == [] and "workers" not in doc
    assert all(h["workers"] == 0 and h["state"] != "starting" for h in doc["hosts"]), doc["hosts"]
    wait_for(lambda: not pid_alive(first), 30, "the controller to end")
    wait_for(lambda: job_pids(lj.job) == [], 30, "no process of the job left")
    for name in ("h1", "h2"):  # its fair-share demand on the hosts: it holds and wants nothing (issue 50)
        (entry,) = (lj.root / "claims" / name).glob(f"demand.*.{lj.job}")
        got = json.loads(entry.read_text())
        assert (got["held"], got["wanted"]) == (0, 0), got
    shown = lj.eltctl("status")[0]
    assert shown.returncode == 0 and "finished" in shown.stdout, shown.stdout + shown.stderr
    assert "controller ended with the job" in shown.stdout and "workers keep training" not in shown.stdout

    # the same job again (a cron entry): nothing is started
    out, took = lj.eltctl("up")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "finished:" in out.stdout and "nothing was started" in out.stdout and "step 30" in out.stdout
    assert lj.controller_pid() == first and job_pids(lj.job) == []
    assert lj.status()["state"] == "finished"

    # more steps: it trains on from step 30's checkpoint and finishes again
    lj.write({"h1": HOST_PYTHON, "h2": HOST_PYTHON}, command=command(50))
    out, _ = lj.eltctl("up", "--timeout", "240")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nothing was started" not in out.stdout
    second = lj.controller_pid()
    assert second != first
    doc = wait_for(lambda: finished(lj, 50), 120, "the job finished at step 50")
    restores = [e for e in doc["events"] if e.get("kind") == "restore"]
    assert restores and "step 30" in restores[0]["detail"], doc["events"]
    wait_for(lambda: not pid_alive(second) and job_pids(lj.job) == [], 30, "the second run to end")
    assert read_json(lj.state_dir / "hosts.json")["finished"]["step"] == 50

    # `down` forgets the end: the next `up` would run the job again
    down = lj.eltctl("down")[0]
    assert down.returncode == 0, down.stdout + down.stderr
    assert read_json(lj.state_dir / "hosts.json").get("finished") is None
    assert json.loads(lj.eltctl("status", "--json")[0].stdout)["state"] == "stopped"

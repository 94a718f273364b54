"""The same job name run from two control machines (one here, one simulated with its own
state directory and ELTCTL_CONTROL_ID): the second cannot start, adopt or take down the
first one's job on the shared hosts."""

from __future__ import annotations

import subprocess

import pytest

from tests.testbed.jobenv import ELTCTL, worker_pids

pytestmark = [pytest.mark.sshd, pytest.mark.slow]


def test_a_second_control_machine_cannot_take_over_or_take_down_the_job(job_env, tmp_path):
    job_env.eltctl("up")
    st = job_env.training_at(6)
    workers = worker_pids(job_env.job)
    other = {**job_env.env, "ELTCTL_CONTROL_ID": "another-machine", "XDG_STATE_HOME": str(tmp_path / "state")}

    def eltctl_elsewhere(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*ELTCTL, "-i", str(job_env.inventory), *args], env=other, capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)

    up = eltctl_elsewhere("up")
    text = up.stdout + up.stderr
    assert up.returncode == 3, text
    assert text.count("runs here from another control machine") >= 3 and "[job] name" in text, text
    down = eltctl_elsewhere("down", "--force")
    assert down.returncode == 0, down.stdout + down.stderr
    # The first machine's job never noticed.
    assert worker_pids(job_env.job) == workers
    job_env.training_at(6, after_step=st["step"] + 5)
    assert not [e for e in job_env.status().get("events", []) if e.get("kind") in ("leave", "stop", "crash")]

"""A host's daemon follows the host's GPU list, end to end on real sshd hosts (issue 49).

The plan: h3 shows one GPU when `up` starts the job (h1 and h2 two each): its daemon
starts with GPU [0] from the probe, and the job trains at world 5. Then h3's second
GPU appears. What must hold: the job reaches world 6 with the same h3 daemon (its
nvidia-smi list is followed, `follow_gpus`), the worker on h3's GPU 0 is the one from
before, and the controller never replaced the daemon (judged by its kind alone, it is
not the wrong one). Before this, a daemon kept the GPUs it was configured with: the
controller had to replace it, every worker of the host leaving first (and in a CI run
one stayed at world 5 of 6).
"""

from __future__ import annotations

import pytest

from tests.testbed.jobenv import worker_pids

pytestmark = [pytest.mark.sshd, pytest.mark.slow]


def _daemon_pid(job_dir) -> int:
    return int((job_dir / "daemon.pid").read_text().split()[0])


def test_a_gpu_that_appears_under_a_running_daemon_is_taken_up_by_that_daemon(job_env):
    h3 = job_env.hosts[2]
    h3.set_gpus(1)
    job_env.eltctl("up")
    job_env.training_at(5, timeout=300)
    job_dir = h3.home / ".eltctl" / "jobs" / job_env.job / h3.name
    daemon = _daemon_pid(job_dir)
    before = {w for w in worker_pids(job_env.job) if w.startswith(f"{h3.name}/")}
    assert [w.split("/")[1] for w in before] == ["0"], before

    h3.set_gpus(2)
    job_env.training_at(6, timeout=300)
    after = {w for w in worker_pids(job_env.job) if w.startswith(f"{h3.name}/")}
    assert sorted(w.split("/")[1] for w in after) == ["0", "1"], after
    assert _daemon_pid(job_dir) == daemon, "h3's daemon was replaced"
    assert before <= after, "h3's worker on GPU 0 (the same incarnation) did not train on"
    log = (job_dir / "daemon.log").read_text()
    assert "nvidia-smi now lists GPUs [0, 1] (the daemon had [0]): its slots follow" in log, log[-3000:]
    assert "is replaced by a daemon" not in job_env.controller_log(400)

"""Restart mode end to end on real sshd hosts: an unmodified torchrun script.

Plan: examples/ddp_restart.py (no import of eltctl: env:// rendezvous, its own
checkpoint in $ELTCTL_CHECKPOINT_DIR) under `mode = "restart"` on h1 and h2 (2
simulated GPUs each: four CPU workers), with a shared-directory mirror. Then, on one
test bed:

1. another user takes GPU 1 of h2: the job restarts at three (owner yield);
2. the owner leaves and `scale --remove h2`: the job restarts at two (scale-down);
3. `scale --add h2`: it restarts at four (scale-up);
4. h1 and h2 die at once; the inventory names h3 instead and `up` restores the
   script's directory from the mirror: it trains on at two on h3.

After each planned change the script resumes at exactly the step it had reached
(its SIGTERM save, handed to the next rank 0); after the loss, at the mirrored
snapshot's step at most. `status` shows the mode and the restart count all along.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.testbed.jobenv import POLICY, REPO, job_pids, wait_for
from tests.testbed.scriptlog import ScriptLog

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(900)]

class Script(ScriptLog):
    """What rank 0's script printed (tests/testbed/scriptlog.py)."""

    def check_planned(self, restart: int) -> int:
        """The restart resumed at the last step the script had reached before it: nothing redone."""
        steps = self.steps()
        before = max(s for s, _w, r in steps if r < restart)
        resumed, _w = self.resumed()[restart]
        assert resumed == before, (restart, resumed, before)
        assert min(s for s, _w, r in steps if r == restart) == resumed + 1
        return resumed


def test_unmodified_script_trains_through_yield_scale_and_loss_of_every_host(job_env):
    bed = job_env.bed
    h1, h2, h3 = job_env.hosts
    shutil.copy(REPO / "examples" / "ddp_restart.py", job_env.workdir / "ddp_restart.py")
    root = job_env.inventory.parent
    mirror = root / "mirror"
    job = {
        "name": job_env.job, "workdir": str(job_env.workdir), "device": "cpu", "min_workers": 1,
        "mode": "restart", "stop_grace": "20s",
        "command": ["python", "ddp_restart.py", "--steps", "1000000", "--save-every", "10", "--step-sleep", "0.1",
                    "--samples", "512", "--batch", "8", "--hidden", "16",
                    "--checkpoint-dir", "{checkpoint_dir}"],
        "env": {"OMP_NUM_THREADS": "1"},
    }

    def use_hosts(hosts) -> None:
        bed.write_inventory(job_env.inventory, hosts=hosts, job=job,
                            extra=POLICY + f'\n[storage]\nmirror = "{mirror}"\n')

    script = Script(bed.dir, job_env.job)

    def status_restarts() -> int:
        doc = json.loads(job_env.eltctl("status", "--json").stdout)
        assert doc["mode"] == "restart", doc
        return doc["restarts"]

    # 0. Up on h1 and h2: four workers.
    use_hosts([h1, h2])
    job_env.eltctl("up")
    r = script.at(4, after_restart=-1, steps=5)

    # 1. The owner of GPU 1 of h2 comes back: restart at three, nothing redone.
    owner = h2.start_foreign_process(1, memory_mib=8000, utilization=90)
    r = script.at(3, after_restart=r)
    script.check_planned(r)
    assert status_restarts() >= 1
    assert any(e["kind"] == "yield" for e in job_env.status().get("events") or [])

    # 2. Scale down: h2 is removed (its other worker leaves).
    h2.stop_foreign_process(owner)
    assert "h2: ok" in job_env.eltctl("scale", "--remove", "h2").stdout
    r = script.at(2, after_restart=r)
    script.check_planned(r)

    # 3. Scale up: h2 again, both GPUs.
    assert "h2: ok" in job_env.eltctl("scale", "--add", "h2").stdout
    r = script.at(4, after_restart=r)
    script.check_planned(r)
    assert status_restarts() >= 3
    view = job_env.eltctl("status").stdout
    assert "restart mode" in view, view
    wait_for(lambda: ((job_env.status().get("mirror") or {}).get("step") or 0) >= 3, 120,
             "a snapshot of the script's directory mirrored")
    mirrored = job_env.status()["mirror"]["step"]
    last_before_loss = max(s for s, _w, _r in script.steps())

    # 4. Every host of the job dies; h3 takes over from the mirror.
    for h in (h1, h2):
        h.crash()
    use_hosts([h3])
    job_env.eltctl("up")
    r = script.at(2, after_restart=r)
    resumed, _w = script.resumed()[r]
    assert 0 < resumed <= last_before_loss, (resumed, last_before_loss)
    restores = [e for e in job_env.status().get("events") or [] if e.get("kind") == "restore"]
    assert any(e.get("where") == "mirror" and (e.get("step") or 0) >= mirrored for e in restores), restores

    out = job_env.eltctl("down").stdout
    assert "final checkpoint: snapshot " in out, out  # no [job] progress: the script's step is not known
    assert job_pids(job_env.job) == []

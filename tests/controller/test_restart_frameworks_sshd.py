"""Restart mode with the frameworks people use, on real sshd hosts: HF Trainer and Lightning.

Plan, one test per framework, each on a test bed of two hosts with one simulated GPU
(examples/lightning_train.py and examples/hf_trainer.py, both with
eltctl_runtime.integrations' callback, run by the frameworks' host interpreter; the
runtime itself runs on the torch-only one):

1. `up` on h1 and h2: the script trains at world size 2;
2. the owner of h2's GPU comes back: the job restarts at 1 (owner yield);
3. Lightning's job only: the owner leaves and `scale --add h2`: it restarts at 2
   (the policy's long cooldown keeps h2 out until then).

Both restarts are the same stop for the script (SIGTERM, the callback's save at a
step's end, a resume from it), so each framework's callback is proven by one
restart; HF's job skips the scale, whose restart at world 2 costs most on a busy
2-core machine (two cold transformers imports).

After each restart the script resumes at exactly the step it had reached (the
callback's SIGTERM save): no optimizer step redone or skipped, by the script's
own step log. `status` shows the script's progress; `down` leaves no process.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from tests.testbed.hostpython import FRAMEWORKS_PYTHON, frameworks_missing_reason
from tests.testbed.jobenv import REPO, job_env_on, job_pids, wait_for
from tests.testbed.scriptlog import ScriptLog

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(900)]

# As tests/testbed/jobenv.POLICY, with a cooldown that keeps a yielded host out until `scale --add`.
POLICY = """\
[policy]
idle_for = "1s"
cooldown = "10m"
probe_interval = "2s"
watch_interval = "1s"
hang_timeout = "6s"
nvidia_smi_timeout = "5s"
"""


class StepLog(ScriptLog):
    """Rank 0's step log of a job (tests/testbed/scriptlog.py)."""

    steps_wanted = 2

    def check_planned(self, restart: int) -> None:
        """Resumed at the last step reached before the restart, and went on from the next one."""
        steps = self.steps()
        before = max(s for s, _w, r in steps if r < restart)
        resumed = {int(r): int(s) for r, (s, _w) in self.resumed().items()}[restart]
        assert resumed == before, (restart, resumed, before)
        after = sorted({s for s, _w, r in steps if r == restart})
        assert after[0] == resumed + 1 and after == list(range(after[0], after[0] + len(after))), after[:20]


def _run_through_yield_and_scale(je, script: str, scale: bool) -> None:
    h1, h2 = je.hosts
    shutil.copy(REPO / "examples" / script, je.workdir / script)
    job = {"name": je.job, "workdir": str(je.workdir), "device": "cpu", "min_workers": 1, "mode": "restart",
           "stop_grace": "30s", "env": {"OMP_NUM_THREADS": "1"},
           "command": [FRAMEWORKS_PYTHON, script, "--max-steps", "1000000", "--save-steps", "1000",
                       "--step-sleep", "0.1"]}
    je.bed.write_inventory(je.inventory, hosts=[h1, h2], job=job, extra=POLICY)
    log = StepLog(je.bed.dir, je.job)

    je.eltctl("up")
    r = log.at(2, after_restart=-1)

    owner = h2.start_foreign_process(0, memory_mib=8000, utilization=90)  # the owner is back
    r = log.at(1, after_restart=r)
    log.check_planned(r)
    assert any(e["kind"] == "yield" for e in je.status().get("events") or []), je.status().get("events")

    restarts = 1
    if scale:
        h2.stop_foreign_process(owner)
        assert "h2: ok" in je.eltctl("scale", "--add", "h2").stdout
        r = log.at(2, after_restart=r)
        log.check_planned(r)
        restarts = 2

    last = max(s for s, _w, _r in log.steps())
    seen = {"step": None, "t": time.monotonic()}

    def progress():
        doc = json.loads(je.eltctl("status", "--json").stdout)
        assert doc["mode"] == "restart", doc
        step = doc.get("step") or 0  # restart mode: the script's own step
        if step != seen["step"]:
            seen.update(step=step, t=time.monotonic())
        # the loss comes from the callback's report(), which may follow the step line by a status write
        return doc if step >= last and doc.get("loss") is not None else None
    # A loaded machine may be slow to show it, not stuck: the wait goes on while status's step
    # moves (60 s without a move fail it), up to 240 s in all.
    doc = wait_for(progress, 240, f"status showing the script's step >= {last} and its loss",
                   stalled=lambda: time.monotonic() - seen["t"] > 60)
    assert doc["restarts"] >= restarts and doc.get("loss") is not None, doc  # the callback's report() calls
    assert "restart mode" in je.eltctl("status").stdout

    out = je.eltctl("down").stdout
    assert "final checkpoint" in out, out
    assert job_pids(je.job) == []
    if not scale:
        h2.stop_foreign_process(owner)


# One test per framework (its own two hosts), so that pytest-xdist's two workers run them at once.
@pytest.mark.parametrize("script, scale", [("lightning_train.py", True), ("hf_trainer.py", False)],
                         ids=["lightning", "hf_trainer"])
def test_a_frameworks_job_loses_no_step_through_yield_and_scale(testbed, script, scale):
    reason = frameworks_missing_reason()
    if reason:
        pytest.skip(reason)
    env = job_env_on(testbed, testbed.add_hosts(2, gpus=1))
    je = next(env)
    try:
        _run_through_yield_and_scale(je, script, scale)
    finally:
        env.close()

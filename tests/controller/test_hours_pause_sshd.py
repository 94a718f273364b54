"""Outside working hours on every host: the job pauses on a checkpoint and resumes by itself.

Plan: a job on one simulated host (two GPUs) with a checkpoint mirror trains at world
size 2. The host's window closes a few seconds from now and opens again some seconds
later. When it closes, every worker leaves; rank 0 writes a checkpoint first, the
mirror copies it, and the job's phase is `paused` with the time it resumes. When the
window opens, the job restarts from that checkpoint (a `restore` event at its step:
no step beyond it was lost) and trains at 2 again; the controller kept running.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest

from tests.testbed.jobenv import job_env_on, wait_for, worker_pids

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(400)]

CLOSES_IN_S = 8.0
CLOSED_FOR_S = 25.0


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M:%S")


def test_no_host_in_its_window_pauses_the_job_on_a_checkpoint_and_it_resumes(testbed, tmp_path):
    hosts = testbed.add_hosts(1, gpus=2)
    mirror = tmp_path / "mirror"
    gen = job_env_on(testbed, hosts, extra=f'timezone = "UTC"\n\n[storage]\nmirror = "{mirror}"\n')
    je = next(gen)
    try:
        je.eltctl("up")
        je.training_at(2)
        ctl = je.controller_pid()
        now = time.time()
        closes, opens = now + CLOSES_IN_S, now + CLOSES_IN_S + CLOSED_FOR_S
        if datetime.fromtimestamp(closes, timezone.utc).date() != datetime.fromtimestamp(opens + 5, timezone.utc).date():
            pytest.skip("too close to midnight UTC for a window within one day")
        text = je.inventory.read_text()
        je.inventory.write_text(text.replace('timezone = "UTC"\n',
                                             f'timezone = "UTC"\nhours = ["{_utc(opens)}-{_utc(closes)}"]\n'))
        je.eltctl("up")

        def paused():
            doc = je.status()
            return doc if doc.get("state") == "paused" and not worker_pids(je.job) else None

        doc = wait_for(paused, 90, "the job to pause with no worker left")
        assert "outside working hours, resumes at" in doc["message"], doc["message"]
        assert doc["hosts"][0]["state"] == "off-hours", doc["hosts"]
        # Rank 0's last status (written after its final checkpoint) may reach status.json a
        # pass after the pause shows: the step it left at is the one whose checkpoint is mirrored.
        def mirrored():
            d = je.status()
            return d if d.get("step") is not None and (d.get("mirror") or {}).get("step") == d["step"] else None

        left_at = wait_for(mirrored, 60, "the final checkpoint to be mirrored")["step"]
        assert left_at >= doc["step"]

        je.training_at(2, after_step=left_at, timeout=180)
        assert je.controller_pid() == ctl  # the controller kept running
        # The runtime's restore event reaches the status with a status write after the first steps.
        restores = wait_for(lambda: [e for e in je.status().get("events") or ()
                                     if e["kind"] == "restore" and e.get("from_step") is not None], 60,
                            f"the runtime's restore event (events: {je.status().get('events')})")
        assert restores[-1]["from_step"] == left_at, restores
    finally:
        next(gen, None)

"""`eltctl status` against what holds, end to end: after a resize and after a crash, the
status (text and --json) agrees with `eltctl checkpoints` and with the worker processes
that actually run.

One job on two simulated hosts of one GPU each (the `job_env` test bed: real sshd, real
daemons, examples/train.py on CPU). Rank 0 checkpoints every 150 steps, so after a
resize the new rank 0 has saved nothing for a while: that is when status once said
"checkpoint none yet" although the earlier checkpoints were all there. A crash's
cooldown is 10 s: while it lasts no worker runs, and status once still showed the dead
run's members, world size and speed.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.testbed.jobenv import job_env_on, wait_for, worker_pids

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(600)]

CHECKPOINT_EVERY = 150


@pytest.fixture
def job_env(testbed):
    gen = job_env_on(testbed, testbed.add_hosts(2, gpus=1))
    je = next(gen)
    text = je.inventory.read_text()
    assert '"--checkpoint-every", "25"' in text, text
    text = text.replace('"--checkpoint-every", "25"', f'"--checkpoint-every", "{CHECKPOINT_EVERY}"')
    je.inventory.write_text(text.replace('cooldown = "2s"', 'cooldown = "10s"'))  # time to look at a crash
    yield je
    gen.close()


def newest_listed(job_env) -> int | None:
    """The newest verified checkpoint `eltctl checkpoints --json` lists."""
    doc = json.loads(job_env.eltctl("checkpoints", "--json").stdout)
    steps = [c["step"] for c in doc["checkpoints"] if c["verified"]]
    return max(steps) if steps else None


def status_json(job_env) -> dict:
    return json.loads(job_env.eltctl("status", "--json").stdout)


def agrees_with_checkpoints(job_env) -> tuple[dict, int | None]:
    """The status's checkpoint and the listing's newest, read while no new checkpoint was
    written between them (the status read before and after names the same step)."""
    for _ in range(10):
        before = status_json(job_env)
        listed = newest_listed(job_env)
        after = status_json(job_env)
        step = (before.get("checkpoint") or {}).get("step")
        if step == (after.get("checkpoint") or {}).get("step"):
            return after, listed
    raise AssertionError("a checkpoint was written during every comparison")


def members_run(doc: dict, job: str) -> bool:
    """Every member and worker row the status names is a running worker process."""
    running = set(worker_pids(job))
    named = set(doc.get("members") or []) | {w["worker"] for w in doc.get("workers") or []}
    return named <= running and doc.get("world_size") == len(doc.get("members") or [])


def test_status_agrees_with_checkpoints_and_the_running_workers_after_a_resize_and_a_crash(job_env):
    job_env.eltctl("up")
    job_env.training_at(2)
    first = wait_for(lambda: (job_env.status().get("checkpoint") or {}).get("step"), 120, "the first checkpoint")

    # 1. A resize: the host of rank 0 leaves; the new rank 0 has written no checkpoint yet.
    rank0_host = job_env.status()["members"][0].split("/")[0]
    assert f"{rank0_host}: ok" in job_env.eltctl("scale", "--remove", rank0_host).stdout
    st = job_env.training_at(1)  # the new generation's first status (read every 0.5 s)
    assert (st["checkpoint"] or {}).get("step", 0) >= first, st["checkpoint"]  # not "none yet"
    doc, listed = agrees_with_checkpoints(job_env)
    assert listed is not None and doc["checkpoint"]["step"] == listed, (doc["checkpoint"], listed)
    assert doc["checkpoint"]["host"] in ("h1", "h2")
    text = " ".join(job_env.eltctl("status").stdout.split())
    assert f"checkpoint step {listed} on " in text and "none yet" not in text, text
    assert members_run(doc, job_env.job), (doc["members"], worker_pids(job_env.job))

    # 2. A crash: every worker is killed at once. Once its daemon has reported it (the host
    #    cools down before its worker is started again), status names no worker: none runs.
    victims = worker_pids(job_env.job)
    assert victims
    for pid in victims.values():
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: any(h["state"] == "cooldown" for h in job_env.status().get("hosts", [])), 30,
             "the host to cool down after the crash", interval=0.2)
    doc = status_json(job_env)
    assert (doc["world_size"], doc["members"], doc.get("workers")) == (0, [], None), doc
    assert doc["state"] != "training" and doc["samples_per_s"] is None, doc
    assert members_run(doc, job_env.job)
    assert doc["checkpoint"]["step"] == listed  # the checkpoint it will resume from
    text = " ".join(job_env.eltctl("status").stdout.split())
    assert "no worker runs now" in text and "samples/s" not in text, text
    # 3. The job resumes from that checkpoint: training again, its step past it, and `up`
    #    reports the running job's step, never the dead run's.
    st = job_env.training_at(1, after_step=listed, timeout=120)
    assert members_run(st, job_env.job), (st["members"], worker_pids(job_env.job))
    out = job_env.eltctl("up").stdout
    line = next((x for x in out.splitlines() if x.startswith("training:")), out)
    assert int(line.rsplit("step ", 1)[1]) > listed, (line, listed)
    doc, newest = agrees_with_checkpoints(job_env)
    assert doc["checkpoint"]["step"] == newest >= listed
    assert members_run(doc, job_env.job) and doc["world_size"] == 1

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


def listed_steps(job_env) -> list[int]:
    """The verified checkpoints' steps that `eltctl checkpoints --json` lists."""
    doc = json.loads(job_env.eltctl("checkpoints", "--json").stdout)
    return sorted(c["step"] for c in doc["checkpoints"] if c["verified"])


def status_json(job_env) -> dict:
    return json.loads(job_env.eltctl("status", "--json").stdout)


def agrees_with_checkpoints(job_env) -> tuple[dict, int]:
    """`status --json`'s checkpoint is the newest `eltctl checkpoints` lists: read between
    two listings (rank 0 may write one meanwhile), it is listed and verified in the
    second, and no older than the newest of the first. Returns the status and that step."""
    before = listed_steps(job_env)
    doc = status_json(job_env)
    after = listed_steps(job_env)
    step = (doc.get("checkpoint") or {}).get("step")
    assert before and step in after and step >= before[-1], (doc.get("checkpoint"), before, after)
    return doc, step


def members_run(doc: dict, job: str) -> bool:
    """Every member and worker row the status names is a running worker process."""
    running = set(worker_pids(job))
    named = set(doc.get("members") or []) | {w["worker"] for w in doc.get("workers") or []}
    return named <= running and doc.get("world_size") == len(doc.get("members") or [])


def test_status_agrees_with_checkpoints_and_the_running_workers_after_a_resize_and_a_crash(job_env):
    job_env.eltctl("up")
    job_env.training_at(2)
    first = wait_for(lambda: (job_env.status().get("checkpoint") or {}).get("step"), 120, "the first checkpoint")
    # Progress at a glance (issue 50): step N of M from the runtime, one samples/s (the
    # controller's rate over recent commits) and the time to finish at that rate.
    doc = wait_for(lambda: (lambda d: d if d.get("eta_s") is not None else None)(status_json(job_env)), 60,
                   "a time to finish")
    assert doc["total_steps"] == 1_000_000 and doc["steps_per_s"] > 0 and doc["samples_per_s"] > 0, doc
    text = " ".join(job_env.eltctl("status").stdout.split())
    assert " of 1000000 (" in text and "finishes in " in text, text

    # 1. A resize: the host of rank 0 leaves; the new rank 0 has written no checkpoint yet.
    rank0_host = job_env.status()["members"][0].split("/")[0]
    assert f"{rank0_host}: ok" in job_env.eltctl("scale", "--remove", rank0_host).stdout
    st = job_env.training_at(1)  # the new generation's first status (read every 0.5 s)
    assert (st["checkpoint"] or {}).get("step", 0) >= first, st["checkpoint"]  # not "none yet"
    doc, listed = agrees_with_checkpoints(job_env)
    assert doc["checkpoint"]["host"] in ("h1", "h2")
    text = " ".join(job_env.eltctl("status").stdout.split())
    assert "checkpoint step " in text and "none yet" not in text, text
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
    assert doc["checkpoint"]["step"] >= listed and doc["checkpoint"]["step"] in listed_steps(job_env)
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
    assert newest >= listed
    assert members_run(doc, job_env.job) and doc["world_size"] == 1

"""The owner comes back, end to end on real sshd hosts.

Plan: `up` on three simulated GPU hosts (2 GPUs each, six CPU workers). Another
user's process appears on h2's GPU 1. Then: the worker on that GPU exits (and no
other), the job trains on at five, a `yield` event names the user and pid, the
status shows the GPU busy, and the GPU stays unused while the owner holds it. The
owner's process ends: after idle_for and the cooldown, h2 rejoins with a new worker
on GPU 1 and the job is back at six. `eltctl status` and `eltctl logs h2` show it.

The `job_env` fixture (tests/testbed/jobenv.py) gives the hosts, a private
XDG_STATE_HOME and a finalizer that kills, by pid, every process of the job the test started.
"""

from __future__ import annotations

import json
import os
import pwd
import time

import pytest

from tests.testbed.jobenv import wait_for, worker_pids

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(600)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _user_of(pid: int) -> str:
    return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name


def _host(doc: dict, name: str) -> dict:
    return next(h for h in doc["hosts"] if h["name"] == name)


def test_owner_takes_a_gpu_the_job_yields_it_and_rejoins_after(job_env):
    job_env.eltctl("up")
    st = job_env.training_at(6)
    workers = worker_pids(job_env.job)
    victim_id = next(w for w in workers if w.startswith("h2/1/"))
    victim = workers[victim_id]
    others = {w: p for w, p in workers.items() if w != victim_id}

    h2 = job_env.bed.host("h2")
    registered = time.time()
    owner = h2.start_foreign_process(1, memory_mib=8000, utilization=90)
    wait_for(lambda: not _alive(victim), 60, f"worker {victim_id} (pid {victim}) to leave GPU 1 of h2",
             interval=0.05)
    print(f"owner yield: {time.time() - registered:.2f} s from the foreign process to our worker's exit")
    assert all(_alive(p) for p in others.values()), "only the worker on the owner's GPU leaves"

    st = job_env.training_at(5, after_step=st["step"])
    yields = [e for e in st["events"] if e["kind"] == "yield" and e["host"] == "h2"]
    assert yields, st["events"]
    assert str(owner) in yields[-1]["detail"] and _user_of(owner) in yields[-1]["detail"]
    # The status says why the GPU is not used (its next refresh at the latest).
    wait_for(lambda: {g["index"]: g["state"] for g in _host(job_env.status(), "h2")["gpus"]}.get(1) == "busy",
             30, f"status to show GPU 1 of h2 busy (h2: {_host(job_env.status(), 'h2')})")

    # Longer than idle_for and the cooldown: the GPU stays the owner's while they use it.
    st = job_env.training_at(5, after_step=st["step"] + 5)
    time.sleep(4)
    st = job_env.training_at(5, after_step=st["step"])
    assert not any(w.startswith("h2/1/") for w in worker_pids(job_env.job))

    shown = json.loads(job_env.eltctl("status", "--json").stdout)
    assert shown["world_size"] == 5 and shown["controller"]["alive"] is True
    view = job_env.eltctl("status").stdout
    assert "yield" in view and f"pid {owner}" in view

    h2.stop_foreign_process(owner)
    st = job_env.training_at(6, after_step=st["step"], timeout=180)
    back = worker_pids(job_env.job)
    rejoined = [w for w in back if w.startswith("h2/1/")]
    assert rejoined and rejoined[0] != victim_id, back
    assert {w: p for w, p in back.items() if w != rejoined[0]} == others  # nobody else restarted
    assert any(e["kind"] == "join" for e in st["events"] if e["time"] > yields[-1]["time"])

    logs = job_env.eltctl("logs", "h2", "-n", "200").stdout
    assert any(line.startswith("[daemon] ") and str(owner) in line for line in logs.splitlines()), logs[-3000:]
    assert "[worker 1] " in logs and "[worker 0] " in logs

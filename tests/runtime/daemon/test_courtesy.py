"""Courtesy while running (runtime/daemon/courtesy.py): the real daemon starts its
workers at daemon.json's nice level and I/O class, with their CPU threads and
memory limited, and the kernel says so (/proc/<pid>/stat, ioprio_get,
/proc/<pid>/limits, /proc/<pid>/environ); torch in the worker sees the thread limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eltctl_runtime.daemon.config import DaemonConfig, DaemonConfigError, worker_env
from eltctl_runtime.daemon.courtesy import Courtesy, describe, ioprio_get, ioprio_value, preexec
from tests.runtime.daemon.daemon_fixtures import SimHost, job_pids
from tests.testbed.jobenv import proc_env

# Prints what torch sees, then sleeps until the daemon's test ends it.
TORCH_SLEEPER = ("import torch, time; print('torch threads', torch.get_num_threads(), flush=True); "
                 "time.sleep(600)")
SLEEPER = "import time; time.sleep(600)"
BASE = {"job": "j", "host": "h", "store": "127.0.0.1:1", "job_dir": "/tmp/j", "code_dir": "/tmp/j",
        "command": ["python", "t.py"]}


def nice_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[16])  # field 19 of proc(5): nice


def address_space_limit(pid: int) -> str:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max address space"))
    return line.split()[3]  # the soft limit: bytes, or "unlimited"


def test_an_old_daemon_json_without_courtesy_means_none():
    cfg = DaemonConfig.from_json(json.dumps(BASE))
    assert cfg.courtesy == Courtesy(nice=0, ionice="none")
    assert preexec(cfg.courtesy, "cpu") is None
    assert "OMP_NUM_THREADS" not in worker_env(cfg, {}, 0, "h/0/1")


def test_courtesy_is_read_and_the_thread_limit_overrides_the_jobs_env():
    doc = dict(BASE, env={"OMP_NUM_THREADS": "8"},
               courtesy={"nice": 12, "ionice": "idle", "cpu_threads": 2, "memory_limit_mib": 1024})
    cfg = DaemonConfig.from_json(json.dumps(doc))
    assert cfg.courtesy == Courtesy(nice=12, ionice="idle", cpu_threads=2, memory_limit_mib=1024)
    env = worker_env(cfg, {}, 0, "h/0/1")
    assert [env[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                             "ELTCTL_CPU_THREADS")] == ["2"] * 4


@pytest.mark.parametrize("courtesy, says", [
    ({"nice": 20}, "courtesy.nice must be an integer from 0 to 19"),
    ({"nice": -1}, "courtesy.nice"),
    ({"ionice": "realtime"}, "courtesy.ionice must be one of none, best-effort, idle"),
    ({"cpu_threads": 0}, "courtesy.cpu_threads"),
    ({"memory_limit_mib": "1G"}, "courtesy.memory_limit_mib"),
    ([], "'courtesy' must be an object"),
])
def test_a_bad_courtesy_is_an_error_naming_the_key(courtesy, says):
    with pytest.raises(DaemonConfigError, match=says.replace(".", r"\.")):
        DaemonConfig.from_json(json.dumps(dict(BASE, courtesy=courtesy)))


def test_ioprio_words():
    assert ioprio_value("best-effort") == (2 << 13) | 7
    assert ioprio_value("idle") == 3 << 13
    assert ioprio_value("none") is None


def test_memory_limit_is_not_put_on_cuda_workers_and_the_log_says_so():
    c = Courtesy(nice=10, ionice="best-effort", memory_limit_mib=2048)
    assert "not enforced on CUDA workers" in describe(c, "cuda")
    assert "2048 MiB of address space" in describe(c, "cpu")


@pytest.mark.slow
def test_cpu_workers_run_with_the_nice_level_io_class_threads_and_memory_limit(tmp_path):
    """Two CPU slots, courtesy nice 13, idle I/O, 1 thread, 3 GiB: each worker (torch
    imported under the limit) runs with exactly that."""
    host = SimHost(tmp_path, nvidia_smi=False, overrides={
        "gpus": None, "slots": 2, "command": ["python", "-c", TORCH_SLEEPER],
        "courtesy": {"nice": 13, "ionice": "idle", "cpu_threads": 1, "memory_limit_mib": 3072}})
    try:
        host.start_daemon()
        host.desire([0, 1])
        workers = host.wait_for(lambda: len(w := host.live_workers()) == 2 and w, "two workers", timeout=60)
        for slot, w in workers.items():
            pid = w["pid"]
            assert nice_of(pid) == 13
            word = ioprio_get(pid)
            if word is not None:  # None: no syscall table for this machine (then courtesy.describe says so)
                assert word == ioprio_value("idle")
            assert address_space_limit(pid) == str(3072 * 2**20)
            assert proc_env(pid)["OMP_NUM_THREADS"] == "1"
            host.wait_for(lambda s=slot: "torch threads 1" in host.worker_log(s), f"torch's threads on slot {slot}",
                          timeout=90)
        assert "workers run with nice 13, I/O class idle, 1 CPU threads, at most 3072 MiB" in host.log()
        assert len(job_pids(host.job, workers_only=True)) == 2
    finally:
        host.close()


@pytest.mark.slow
def test_gpu_workers_get_the_priority_but_no_address_space_limit(tmp_path):
    """A (simulated) CUDA host: best-effort I/O at its lowest level, nice 10, and no
    RLIMIT_AS (it would break the driver); the daemon's log says the limit is not enforced."""
    host = SimHost(tmp_path, n_gpus=1, overrides={
        "device": "cuda", "command": ["python", "-c", SLEEPER],
        "courtesy": {"nice": 10, "ionice": "best-effort", "memory_limit_mib": 1024}})
    try:
        host.start_daemon()
        host.desire([0])
        workers = host.wait_for(lambda: host.live_workers(), "a worker", timeout=60)
        pid = workers[0]["pid"]
        assert nice_of(pid) == 10
        word = ioprio_get(pid)
        if word is not None:
            assert word == ioprio_value("best-effort")
        assert address_space_limit(pid) == "unlimited"
        assert "memory_limit (1024 MiB) is not enforced on CUDA workers" in host.log()
    finally:
        host.close()


def test_a_nice_level_at_or_below_the_daemons_own_is_left_alone():
    # A child of ours at nice 15 asks for 10: it cannot raise its own priority, so nothing is set.
    code = ("import os; os.setpriority(os.PRIO_PROCESS, 0, 15); "
            "from eltctl_runtime.daemon.courtesy import Courtesy, preexec; "
            "print(preexec(Courtesy(nice=10, ionice='none'), 'cpu'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert out.stdout.strip() == "None", out.stderr

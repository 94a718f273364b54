"""The control plane end to end on real sshd hosts: `up`, `scale`, crashes, adoption, `down`.

Each test runs the real CLI (`python -m eltctl`) against three simulated GPU hosts
of the test bed (2 GPUs each, CPU workers), with real daemons, real workers running
examples/train.py, and a real controller and store keeper on this machine. The
scenarios share one job per test to keep the suite short on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.testbed.jobenv import ELTCTL, job_pids, proc_env, wait_for, worker_pids

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(900)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _on(host: str, workers: dict[str, int]) -> dict[str, int]:
    return {w: p for w, p in workers.items() if w.startswith(f"{host}/")}


def test_up_twice_scale_controller_killed_and_down(job_env):
    # 1. Two `up` at once on three hosts: one controller; six workers (2 simulated
    #    GPUs each) train at world size 6.
    h1_home = job_env.hosts[0].dir / "home"
    (h1_home / ".eltctl").mkdir(mode=0o755, exist_ok=True)  # left by an older eltctl: tightened
    (h1_home / ".eltctl").chmod(0o755)
    t0 = time.monotonic()
    both = [subprocess.Popen([*ELTCTL, "-i", str(job_env.inventory), "up"], env=job_env.env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    assert all("training: world size" in o for o, _ in outs), outs
    pids = {line.split()[1] for o, _ in outs for line in o.splitlines() if line.startswith("controller ")}
    assert len(pids) == 1, outs  # the loser's controller found the lock taken and left
    print(f"\nup (two at once) returned after {time.monotonic() - t0:.1f} s")
    st = job_env.training_at(6)
    assert sorted(h["name"] for h in st["hosts"] if h["state"] == "running") == ["h1", "h2", "h3"]
    ctl = job_env.controller_pid()
    workers = worker_pids(job_env.job)
    assert len(workers) == 6
    assert {proc_env(p).get("ELTSIM_HOST") for p in workers.values()} == {"h1", "h2", "h3"}
    # Nothing of the job on a host is readable by another account (daemon.json holds the job's env).
    job_dir = h1_home / ".eltctl" / "jobs" / job_env.job / "h1"
    modes = {str(p.relative_to(h1_home)): p.stat().st_mode & 0o777
             for p in [h1_home / ".eltctl", job_dir, *job_dir.rglob("*")] if not p.is_symlink()}
    assert modes[".eltctl"] == 0o700 and {k: oct(m) for k, m in modes.items() if m & 0o077} == {}

    # 2. `up` again changes nothing: the same controller, not one worker restarted.
    out = job_env.eltctl("up").stdout
    assert "already running" in out, out
    assert job_env.controller_pid() == ctl
    job_env.training_at(6, after_step=job_env.status()["step"] + 5)
    assert worker_pids(job_env.job) == workers

    # 3. `scale --remove h2`: its workers leave in the planned way; h2 stays out
    #    even after idle_for and the cooldown have passed.
    t0 = time.monotonic()
    assert "h2: ok" in job_env.eltctl("scale", "--remove", "h2").stdout
    st = job_env.training_at(4)
    print(f"scale --remove h2 -> world size 4 in {time.monotonic() - t0:.1f} s")
    wait_for(lambda: not any(_alive(p) for p in _on("h2", workers).values()), 60, "h2's workers to leave")
    time.sleep(4)
    st = job_env.training_at(4, after_step=st["step"])
    assert {h["name"]: h["state"] for h in st["hosts"]}["h2"] == "removed"
    assert _on("h1", worker_pids(job_env.job)) == _on("h1", workers)  # the others were not restarted

    # 4. `scale --add h2` while someone uses both its GPUs: refused with the reason.
    h2 = job_env.bed.host("h2")
    owners = [h2.start_foreign_process(g, memory_mib=4000) for g in (0, 1)]
    refused = job_env.eltctl("scale", "--add", "h2", check=False)
    assert refused.returncode == 1 and "refused" in refused.stdout and "no free GPU" in refused.stdout, \
        refused.stdout + refused.stderr
    for pid in owners:
        h2.stop_foreign_process(pid)
    t0 = time.monotonic()
    assert "h2: ok" in job_env.eltctl("scale", "--add", "h2").stdout
    st = job_env.training_at(6, after_step=st["step"])
    print(f"scale --add h2 -> world size 6 in {time.monotonic() - t0:.1f} s")
    workers = worker_pids(job_env.job)
    assert len(_on("h2", workers)) == 2

    # 5. The controller is SIGKILLed: training goes on; `up` starts a new controller
    #    that adopts the job: same store, same workers.
    old = job_env.controller_pid()
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not _alive(old), 30, "the controller to die")
    step = job_env.status()["step"]
    t0 = time.monotonic()
    out = job_env.eltctl("up").stdout
    assert "(started)" in out, out
    print(f"up adopting the job returned after {time.monotonic() - t0:.1f} s")
    assert job_env.controller_pid() not in (None, old)
    job_env.training_at(6, after_step=step + 10)
    assert worker_pids(job_env.job) == workers

    # 6. `down`: final checkpoint, then nothing of the job is left anywhere.
    doc = json.loads((job_env.state_dir / "controller.json").read_text())
    ctl, keeper = doc["pid"], doc["store"]["pid"]
    t0 = time.monotonic()
    out = job_env.eltctl("down").stdout
    print(f"down took {time.monotonic() - t0:.1f} s")
    assert f"no process of job {job_env.job} left on h1, h2, h3" in out, out
    assert "final checkpoint: step" in out, out
    assert job_pids(job_env.job) == []  # checked here on /proc too, not only by the command
    for pid in (ctl, keeper):
        wait_for(lambda: not _alive(pid), 30, f"pid {pid} to exit")
    assert job_env.status()["state"] == "stopped"


def test_every_process_of_a_host_killed_the_job_goes_on_and_the_host_rejoins(job_env):
    job_env.eltctl("up")
    st = job_env.training_at(6)
    h3 = job_env.bed.host("h3")
    h3.crash()  # its sshd, daemon and both workers
    assert not any(proc_env(p).get("ELTSIM_HOST") == "h3" for p in job_pids(job_env.job))
    st = job_env.training_at(4, after_step=st["step"])
    st = job_env.training_at(4, after_step=st["step"] + 5)  # and keeps training
    # Its daemon's heartbeat goes stale and SSH fails: the controller sees it gone.
    wait_for(lambda: {h["name"]: h["state"] for h in job_env.status()["hosts"]}["h3"]
             in ("unreachable", "cooldown", "benched"), 60, "h3 to be seen gone")
    h3.restore()  # the machine is back: after its cooldown and idle_for it rejoins
    st = job_env.training_at(6, after_step=st["step"], timeout=180)

    # The controller dies, then `down` (no controller to ask) still stops everything.
    os.kill(job_env.controller_pid(), signal.SIGKILL)
    out = job_env.eltctl("down").stdout
    assert "no controller is running" in out and f"no process of job {job_env.job} left on h1, h2, h3" in out, out
    assert job_pids(job_env.job) == []


def test_up_with_too_few_free_gpus_says_so_exits_0_and_the_controller_waits(job_env):
    text = job_env.inventory.read_text().replace("min_workers = 1", "min_workers = 7")
    job_env.inventory.write_text(text)
    r = job_env.eltctl("up")
    assert "waiting" in r.stdout and "min_workers is 7" in r.stdout, r.stdout
    assert job_env.controller_pid() is not None and _alive(job_env.controller_pid())
    assert worker_pids(job_env.job) == {}
    wait_for(lambda: job_env.status().get("state") == "waiting", 30, "status.json to say waiting")

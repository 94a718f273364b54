"""`eltctl up` checks before it starts anything: hosts on this machine (`address = "local"`).

Each first mistake a newcomer makes is named at once (well under the 5-minute failure
cooldown it replaces), with its cause and its fix, and nothing is started: an
interpreter without torch, a script name that does not exist, a workdir that does
not exist, a `-m` module found nowhere. Mixed good and bad hosts: the good one
trains, the bad one is left out with the reason in `eltctl status`, and comes back
at the next `up` once fixed. The same against real sshd hosts: test_up_sshd.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.testbed.hostpython import HOST_PYTHON
from tests.testbed.jobenv import ELTCTL, REPO, ControllerFiles, end_job, job_pids, wait_for
from tests.testbed.torchstamp import seed_torch_stamp

NO_TORCH = "/usr/bin/python3"  # the system interpreter: Python, no torch
QUICK_S = 60.0  # generous: one probe and one check, far below the 5-minute cooldown


def _no_torch_python() -> str:
    if not os.path.exists(NO_TORCH):
        pytest.skip(f"{NO_TORCH} is missing")
    if subprocess.run([NO_TORCH, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{NO_TORCH} has torch")
    return NO_TORCH


class LocalJob(ControllerFiles):
    """A job on hosts of this machine, each with its own HOME, and the real CLI."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.job = f"u{uuid.uuid4().hex[:8]}"
        self.workdir = root / "code"
        self.workdir.mkdir()
        for f in ("train.py", "toy.py"):
            shutil.copy(REPO / "examples" / f, self.workdir / f)
        self.inventory = root / "hosts.toml"
        self.env = {**os.environ, "XDG_STATE_HOME": str(root / "state"), "PYTHONUNBUFFERED": "1"}

    @property
    def state_dir(self) -> Path:
        return self.root / "state" / "eltctl" / self.job

    def write(self, hosts: dict[str, str], *, command=None, workdir=None, policy: dict[str, str] | None = None) -> None:
        command = command or ["python", "train.py", "--steps", "1000000", "--hidden", "16", "--layers", "1",
                              "--samples", "512", "--batch", "8", "--step-sleep", "0.05"]
        lines = ["[job]", f'name = "{self.job}"', f"command = {json.dumps(command)}",
                 f"workdir = {json.dumps(str(workdir or self.workdir))}", 'device = "cpu"',
                 'env = { OMP_NUM_THREADS = "1" }', "",
                 "[policy]"]
        policy = {"idle_for": "1s", "cooldown": "2s", "probe_interval": "1s", **(policy or {})}
        lines += [f"{k} = {json.dumps(v)}" for k, v in policy.items()]
        for name, python in hosts.items():
            home = self.root / "home" / name
            if not home.exists() and python == HOST_PYTHON:
                # A new host with the host interpreter: it has met eltctl before, like the test
                # bed's (its torch-import stamp, tests/testbed/torchstamp.py), so `up` does not
                # import torch there for nothing. A host first written with another interpreter
                # (a bad one, fixed later) has none: its fix is checked in full.
                home.mkdir(parents=True)
                seed_torch_stamp(home)
            home.mkdir(parents=True, exist_ok=True)
            lines += ["", "[[hosts]]", f'name = "{name}"', 'address = "local"', f"python = {json.dumps(python)}",
                      f"env = {{ HOME = {json.dumps(str(home))}, "
                      f"ELTCTL_CLAIMS_DIR = {json.dumps(str(self.root / 'claims' / name))} }}"]
        self.inventory.write_text("\n".join(lines) + "\n")

    def eltctl(self, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        out = subprocess.run([*ELTCTL, "-i", str(self.inventory), *args], env=self.env, capture_output=True,
                             text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        return out, time.monotonic() - t0



@pytest.fixture
def local_job():
    root = Path(tempfile.mkdtemp(prefix="eltu-"))  # short: unix socket paths are limited
    lj = LocalJob(root)
    try:
        yield lj
    finally:
        try:
            end_job(lj.job, root, root / "state")  # by pid, each one this test started (jobenv.py)
        finally:
            shutil.rmtree(root, ignore_errors=True)


def assert_refused(lj: LocalJob, out: subprocess.CompletedProcess, took: float, code: int, *words: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == code, text
    for w in words:
        assert w in text, f"{w!r} not in:\n{text}"
    assert took < QUICK_S, f"up took {took:.1f} s"
    assert lj.controller_pid() is None and not (lj.state_dir / "control.sock").exists(), "a controller started"
    assert job_pids(lj.job) == []


def test_interpreter_without_torch(local_job):
    local_job.write({"h1": _no_torch_python()})
    out, took = local_job.eltctl("up")
    assert_refused(local_job, out, took, 3, "h1", "torch", "No module named 'torch'",
                   f"{NO_TORCH} -m pip install torch", "point this host's `python`")


def test_script_name_that_does_not_exist(local_job):
    local_job.write({"h1": HOST_PYTHON}, command=["python", "trian.py"])
    out, took = local_job.eltctl("up")
    assert_refused(local_job, out, took, 2, "job.command", "trian.py", "not in the workdir",
                   "did you mean train.py", "fix the script's name")


def test_workdir_that_does_not_exist(local_job):
    local_job.write({"h1": HOST_PYTHON}, workdir=local_job.root / "nowhere")
    out, took = local_job.eltctl("up")
    assert_refused(local_job, out, took, 2, "job.workdir", str(local_job.root / "nowhere"), "does not exist",
                   "set [job] workdir")


def test_module_found_nowhere(local_job):
    local_job.write({"h1": HOST_PYTHON}, command=["python", "-m", "trainer_nowhere"])
    out, took = local_job.eltctl("up")
    assert_refused(local_job, out, took, 3, "h1", "module", "trainer_nowhere", "neither in the workdir",
                   "fix:")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mixed_hosts_the_good_one_trains_the_bad_one_is_left_out_until_fixed(local_job):
    local_job.write({"good": HOST_PYTHON, "bad": _no_torch_python()})
    out, took = local_job.eltctl("up")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "warning: bad is left out" in out.stdout and "No module named 'torch'" in out.stdout
    assert "pip install torch" in out.stdout and "training: world size 1" in out.stdout, out.stdout
    hosts = {h["name"]: h for h in local_job.status()["hosts"]}
    assert hosts["good"]["state"] == "running"
    assert hosts["bad"]["state"] == "removed" and "No module named 'torch'" in hosts["bad"]["reason"]
    shown, _ = local_job.eltctl("status")
    assert shown.returncode == 0 and "left out" in shown.stdout, shown.stdout

    # Fixed: the next `up` checks the left-out host again (not the running one) and it joins.
    local_job.write({"good": HOST_PYTHON, "bad": HOST_PYTHON})
    out, took = local_job.eltctl("up")
    assert out.returncode == 0, out.stdout + out.stderr
    checked = next(line for line in out.stdout.splitlines() if "checking" in line)
    assert checked.endswith(": bad") and "warning" not in out.stdout, out.stdout  # not the running one
    wait_for(lambda: {h["name"]: h["state"] for h in local_job.status().get("hosts", [])}.get("bad") == "running",
             120, "the fixed host to run a worker")

    # A healthy running job: `up` checks no host and stays quick.
    out, took = local_job.eltctl("up")
    assert out.returncode == 0 and "checking" not in out.stdout and "already running" in out.stdout, out.stdout
    assert took < 30

    # A second inventory with the same job name cannot steer this job (up, scale, down refuse).
    other = local_job.root / "other.toml"
    other.write_text(local_job.inventory.read_text())
    pid = local_job.controller_pid()
    for args in (("up",), ("scale", "--remove", "bad"), ("down", "--force")):
        out = subprocess.run([*ELTCTL, "-i", str(other), *args], env=local_job.env, capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert "already run on this machine from another inventory" in out.stderr, out.stderr
        assert str(local_job.inventory) in out.stderr and "[job] name" in out.stderr, out.stderr
    assert local_job.controller_pid() == pid and local_job.status()["state"] == "training"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cpu_slots_train_at_once_whatever_idle_for_says(local_job):
    """Issue 25, finding 1: the starter's idle_for = "10m" held CPU slots (no owner process
    to watch) for 10 minutes; `up --timeout` then failed although nothing was wrong."""
    local_job.write({"h1": HOST_PYTHON}, policy={"idle_for": "10m"})
    out, took = local_job.eltctl("up", "--timeout", "240")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "training: world size 1" in out.stdout, out.stdout


def _sigint_default() -> None:
    """In the child before exec: SIGINT back to its default, so Python turns it into a
    KeyboardInterrupt even when the suite runs from a shell that ignores it (a
    non-interactive background job: `bash .ci/run &`), which `up` would inherit."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_start_that_waits_for_idle_for_returns_with_a_countdown_and_ctrl_c_says_what_runs_on(local_job):
    """Issue 25, findings 1 and 5: waiting is the plan, so `up` returns (exit 0) with when the
    job starts; and a Ctrl-C in `up` says that the controller goes on and how to stop it."""
    import signal

    local_job.write({"h1": HOST_PYTHON}, policy={"cpu_idle_for": "10m"})
    out, took = local_job.eltctl("up")
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"waiting: starts in (9 min \d+ s|10 min): 1 free CPU slot\(s\) are used once they have been "
                     r"free for cpu_idle_for \(10m\); `eltctl scale --add h1` uses them now", out.stdout), out.stdout
    assert "the controller starts the job by itself then" in out.stdout and took < QUICK_S
    shown, _ = local_job.eltctl("status")
    assert re.search(r"starts in (9|10) min", shown.stdout), shown.stdout

    # A start due within a minute: `up` waits for it, counting down; Ctrl-C then says what
    # keeps running and how to stop it (it printed nothing and left the user guessing).
    local_job.write({"h1": HOST_PYTHON}, policy={"cpu_idle_for": "50s"})
    up = subprocess.Popen([*ELTCTL, "-i", str(local_job.inventory), "up"], env=local_job.env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                          preexec_fn=_sigint_default)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("starting: starts in " in ln for ln in lines) or up.poll() is not None, 120,
                 "up's countdown")
        assert up.poll() is None, lines
        up.send_signal(signal.SIGINT)
        stderr = up.stderr.read()
        up.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if up.poll() is None:
            up.kill()
    stdout = "".join(lines)
    pid = local_job.controller_pid()
    assert up.returncode == 130, stdout + stderr
    assert re.search(r"starting: starts in \d+ s: 1 free CPU slot", stdout), stdout  # the countdown
    assert f"interrupted: the controller (pid {pid}) keeps running" in stderr, stderr
    assert "`eltctl status` follows it; `eltctl down` stops it" in stderr, stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_in_up_says_the_controller_keeps_running_and_how_to_stop_it(local_job):
    """Issue 25, finding 5: Ctrl-C during `up` printed nothing (exit 130) while the
    controller went on starting the job."""
    import signal

    # Workers that never reach a first step: `up` waits for one until it is interrupted.
    local_job.write({"h1": HOST_PYTHON}, command=["python", "-c", "import time; time.sleep(600)"])
    up = subprocess.Popen([*ELTCTL, "-i", str(local_job.inventory), "up"], env=local_job.env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                          preexec_fn=_sigint_default)
    try:
        wait_for(lambda: local_job.controller_pid() is not None or up.poll() is not None, 120,
                 "the controller to start")
        time.sleep(1.0)
        assert up.poll() is None, up.communicate()
        up.send_signal(signal.SIGINT)
        stdout, stderr = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    pid = local_job.controller_pid()
    assert up.returncode == 130, stdout + stderr
    assert pid is not None, "the controller should run on"
    assert (f"interrupted: the controller (pid {pid}) keeps running: `up` started it and only stopped waiting; "
            f"job {local_job.job} starts (or goes on) by itself") in stderr, stderr
    assert "`eltctl status` follows it; `eltctl down` stops it" in stderr, stderr

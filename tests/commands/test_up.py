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
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.testbed.hostpython import HOST_PYTHON
from tests.testbed.jobenv import ELTCTL, REPO, ControllerFiles, job_pids, wait_for

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

    def write(self, hosts: dict[str, str], *, command=None, workdir=None) -> None:
        command = command or ["python", "train.py", "--steps", "1000000", "--hidden", "16", "--layers", "1",
                              "--samples", "512", "--batch", "8", "--step-sleep", "0.05"]
        lines = ["[job]", f'name = "{self.job}"', f"command = {json.dumps(command)}",
                 f"workdir = {json.dumps(str(workdir or self.workdir))}", 'device = "cpu"',
                 'env = { OMP_NUM_THREADS = "1" }', "",
                 "[policy]", 'idle_for = "1s"', 'cooldown = "2s"', 'probe_interval = "1s"']
        for name, python in hosts.items():
            home = self.root / "home" / name
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
        if lj.controller_pid() is not None or job_pids(lj.job):
            try:
                lj.eltctl("down", "--force", timeout=120)
            except subprocess.TimeoutExpired:
                pass
        for pid in [lj.controller_pid(), *job_pids(lj.job)]:
            if pid:
                try:
                    os.kill(pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass
        keeper = None
        try:
            keeper = (json.loads((lj.state_dir / "controller.json").read_text()).get("store") or {}).get("pid")
        except (OSError, ValueError):
            pass
        if keeper:
            try:
                os.kill(int(keeper), 9)
            except (ProcessLookupError, PermissionError):
                pass
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

"""`eltctl up`'s checks against real sshd hosts (the test bed): each first mistake is
named at once with its cause and its fix, and nothing starts; with mixed good and bad
hosts the good ones train and the bad ones are left out, their reason in `status`.
The same on local hosts: test_up.py.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.testbed.jobenv import ELTCTL, POLICY, REPO, job_pids, worker_pids

pytestmark = pytest.mark.sshd

NO_TORCH = "/usr/bin/python3"
QUICK_S = 60.0  # generous: one probe and one check, far below the 5-minute cooldown


def _skip_without_no_torch_python() -> None:
    if not Path(NO_TORCH).exists() or \
            subprocess.run([NO_TORCH, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"needs {NO_TORCH} without torch")


def _setup(testbed, tmp_path, *, command=("python", "train.py"), workdir=None, python=None, hosts=None):
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    shutil.copy(REPO / "examples" / "train.py", code / "train.py")
    job = f"s{uuid.uuid4().hex[:8]}"
    inventory = testbed.write_inventory(tmp_path / "hosts.toml", hosts=hosts, job={
        "name": job, "command": list(command), "workdir": str(workdir or code), "device": "cpu"}, extra=POLICY)
    if python is not None:
        text = inventory.read_text()
        for h in hosts or testbed.hosts:
            text = text.replace(f'python = "{h.python}"', f'python = "{python}"')
        inventory.write_text(text)
    state = Path(f"/tmp/eltu-{job}")  # short: unix socket paths are limited
    env = {**__import__("os").environ, "XDG_STATE_HOME": str(state)}
    return inventory, job, env, state


def _up(inventory, env):
    t0 = time.monotonic()
    out = subprocess.run([*ELTCTL, "-i", str(inventory), "up"], capture_output=True, text=True, env=env,
                         timeout=300, stdin=subprocess.DEVNULL)
    return out, time.monotonic() - t0


def assert_refused(out, took, code, job, state, *words):
    text = out.stdout + out.stderr
    try:
        assert out.returncode == code, text
        for w in words:
            assert w in text, f"{w!r} not in:\n{text}"
        assert took < QUICK_S, f"up took {took:.1f} s"
        assert not (state / "eltctl" / job / "controller.json").exists(), "a controller started"
        assert job_pids(job) == []
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_interpreter_without_torch_on_every_host(testbed, tmp_path):
    _skip_without_no_torch_python()
    testbed.add_hosts(2)
    inventory, job, env, state = _setup(testbed, tmp_path, python=NO_TORCH)
    out, took = _up(inventory, env)
    assert_refused(out, took, 3, job, state, "h1: torch", "h2: torch", "No module named 'torch'",
                   f"{NO_TORCH} -m pip install torch")


def test_host_key_unknown(testbed, tmp_path):
    testbed.add_host("h1", known=False)
    inventory, job, env, state = _setup(testbed, tmp_path)
    out, took = _up(inventory, env)
    assert_refused(out, took, 3, job, state, "h1: host key", "unknown host key", "SHA256:",
                   "eltctl doctor --accept-new")


def test_script_name_that_does_not_exist(testbed, tmp_path):
    testbed.add_host("h1")
    inventory, job, env, state = _setup(testbed, tmp_path, command=("python", "trian.py"))
    out, took = _up(inventory, env)
    assert_refused(out, took, 2, job, state, "job.command", "trian.py", "did you mean train.py",
                   "fix the script's name")


def test_workdir_that_does_not_exist(testbed, tmp_path):
    testbed.add_host("h1")
    inventory, job, env, state = _setup(testbed, tmp_path, workdir=tmp_path / "nowhere")
    out, took = _up(inventory, env)
    assert_refused(out, took, 2, job, state, "job.workdir", "does not exist", "set [job] workdir")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mixed_hosts_good_ones_train_bad_ones_are_left_out(job_env):
    """h1, h2 good; h3 without torch; h4 with an unknown host key; h5's sshd allows no Unix-socket
    forward (the default store mode needs one)."""
    _skip_without_no_torch_python()
    h3 = job_env.hosts[2]
    h4 = job_env.bed.add_host("h4", known=False)
    h5 = job_env.bed.add_host("h5")
    h5.set_sshd_option("AllowStreamLocalForwarding", "no")
    good3, bad3 = f'port = {h3.port}\npython = "{h3.python}"\n', f'port = {h3.port}\npython = "{NO_TORCH}"\n'
    text = job_env.inventory.read_text().replace(good3, bad3)
    assert bad3 in text
    text += (f'\n[[hosts]]\nname = "h4"\naddress = "{h4.address}"\nport = {h4.port}\n'
             f'python = "{h4.python}"\n'
             f'\n[[hosts]]\nname = "h5"\naddress = "{h5.address}"\nport = {h5.port}\n'
             f'python = "{h5.python}"\n')
    job_env.inventory.write_text(text)
    t0 = time.monotonic()
    out = job_env.eltctl("up")
    took = time.monotonic() - t0
    assert "warning: h3 is left out" in out.stdout and "No module named 'torch'" in out.stdout, out.stdout
    assert "warning: h4 is left out" in out.stdout and "--accept-new" in out.stdout, out.stdout
    assert "warning: h5 is left out: store forward" in out.stdout and "AllowStreamLocalForwarding yes" in out.stdout, \
        out.stdout
    assert "training: world size" in out.stdout, out.stdout
    # the link test (eltctl/linkspeed.py) between the two hosts that passed, both ways
    assert "link test: slowest h1 -> h2" in out.stdout or "link test: slowest h2 -> h1" in out.stdout, out.stdout
    print(f"\nup with two bad hosts of four returned after {took:.1f} s")
    st = job_env.training_at(4, timeout=300)
    hosts = {h["name"]: h for h in st["hosts"]}
    assert hosts["h1"]["state"] == hosts["h2"]["state"] == "running"
    assert hosts["h3"]["state"] == "removed" and "No module named 'torch'" in hosts["h3"]["reason"]
    assert "pip install torch" in hosts["h3"]["reason"]
    assert hosts["h4"]["state"] == "removed" and "unknown host key" in hosts["h4"]["reason"]
    assert hosts["h5"]["state"] == "removed" and "AllowStreamLocalForwarding" in hosts["h5"]["reason"]
    assert not any(w.startswith(("h3/", "h4/", "h5/")) for w in worker_pids(job_env.job))

    # h3 fixed: the next `up` checks only the hosts not running (h3, h4) and h3 joins.
    job_env.inventory.write_text(text.replace(bad3, good3))
    out = job_env.eltctl("up")
    checked = next(line for line in out.stdout.splitlines() if "checking" in line)
    assert "h3" in checked and "h4" in checked and "warning: h3" not in out.stdout, out.stdout
    assert "link test" not in out.stdout, out.stdout  # one checked host passed: no pair to measure
    st = job_env.training_at(6, timeout=300)
    assert {h["name"]: h["state"] for h in st["hosts"]}["h4"] == "removed"

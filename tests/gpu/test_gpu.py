"""Checks for a machine with a real NVIDIA GPU (skipped without CUDA): `scripts/gpu-check.sh`.

Everything real: the driver's `nvidia-smi`, CUDA workers on NCCL, the controller, the
store keeper and a host daemon on this machine (`address = "local"`). The test steps
share one job, in order:

1. `eltctl probe --json` reads the GPU through the real nvidia-smi;
2. `eltctl up` trains on the GPU with NCCL (device "cuda");
3. another process (another user's where the machine has one to run as) takes memory on
   the GPU: the daemon's watch sees it, our worker leaves and its memory is released;
   the time it took is printed (a figure, not an assertion);
4. the owner goes, the GPU comes back after idle_for + cooldown, and the job resumes
   from its checkpoint (a restore on CUDA);
5. `eltctl down` takes a final checkpoint; `up` again restores it (the step goes on);
   `down` leaves nothing running.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.testbed.jobenv import ELTCTL, REPO, ControllerFiles, job_pids, wait_for

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and shutil.which("nvidia-smi")),
    reason="needs an NVIDIA GPU, its nvidia-smi and a CUDA build of torch (scripts/gpu-check.sh)")

OWNER_MIB = 2048


class GpuJob(ControllerFiles):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.job = f"g{uuid.uuid4().hex[:8]}"
        self.workdir = root / "code"
        self.workdir.mkdir()
        for f in ("train.py", "toy.py"):
            shutil.copy(REPO / "examples" / f, self.workdir / f)
        self.inventory = root / "hosts.toml"
        home = root / "home"
        home.mkdir()
        command = ["python", "train.py", "--steps", "1000000", "--hidden", "256", "--layers", "2",
                   "--samples", "4096", "--batch", "64", "--step-sleep", "0.02", "--checkpoint-every", "50"]
        self.inventory.write_text("\n".join([
            "[job]", f'name = "{self.job}"', f"command = {json.dumps(command)}",
            f"workdir = {json.dumps(str(self.workdir))}", 'device = "cuda"', "",
            "[policy]", 'idle_for = "2s"', 'cooldown = "3s"', 'probe_interval = "1s"', 'watch_interval = "0.5s"',
            "memory_threshold_mib = 500", "",
            "[[hosts]]", 'name = "gpu"', 'address = "local"', f"python = {json.dumps(sys.executable)}",
            "gpus = [0]", f"env = {{ HOME = {json.dumps(str(home))} }}", ""]))
        self.env = {**os.environ, "XDG_STATE_HOME": str(root / "state"), "PYTHONUNBUFFERED": "1"}

    @property
    def state_dir(self) -> Path:
        return self.root / "state" / "eltctl" / self.job

    def eltctl(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        out = subprocess.run([*ELTCTL, "-i", str(self.inventory), *args], env=self.env, capture_output=True,
                             text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        print(f"$ eltctl {' '.join(args)} -> {out.returncode}\n{out.stdout}{out.stderr}")
        return out

    def step(self) -> int:
        return int(self.status().get("step") or 0)

    def training(self, after_step: int = 0, timeout: float = 180) -> dict:
        def ok():
            st = self.status()
            return st if st.get("state") == "training" and (st.get("step") or 0) > after_step else None
        try:
            return wait_for(ok, timeout, f"training past step {after_step}")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.logs()}") from None

    def logs(self) -> str:
        out = []
        for f in [self.state_dir / "controller.log", *sorted((self.root / "home").rglob("*.log"))]:
            try:
                out.append(f"--- {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
            except OSError:
                pass
        return "\n".join(out)


def gpu_pids() -> dict[int, int]:
    """pid -> MiB of every compute process on GPU 0, from the real nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits",
                          "-i", "0"], capture_output=True, text=True, timeout=30).stdout
    found = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            found[int(parts[0])] = int(parts[1]) if parts[1].isdigit() else 0
    return found


def owner_command() -> list[str]:
    """A CUDA process holding OWNER_MIB on GPU 0, as another user when one can be run as."""
    code = ("import torch, time; x = torch.empty(%d * 2**20, dtype=torch.uint8, device='cuda'); "
            "print('owner holds the GPU', flush=True); time.sleep(600)" % OWNER_MIB)
    argv = [sys.executable, "-c", code]
    if os.geteuid() == 0 and shutil.which("runuser"):
        try:
            pwd.getpwnam("nobody")
            return ["runuser", "-u", "nobody", "--", *argv]
        except KeyError:
            pass
    return argv


@pytest.fixture(scope="module")
def gpu_job():
    root = Path(tempfile.mkdtemp(prefix="eltg-"))
    root.chmod(0o755)
    job = GpuJob(root)
    try:
        yield job
    finally:
        if job.controller_pid() is not None or job_pids(job.job):
            try:
                job.eltctl("down", "--force", timeout=180)
            except subprocess.TimeoutExpired:
                pass
        for pid in [job.controller_pid(), *job_pids(job.job)]:
            if pid:
                try:
                    os.kill(pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass
        shutil.rmtree(root, ignore_errors=True)


def test_probe_reads_the_real_gpu(gpu_job):
    out = gpu_job.eltctl("probe", "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    (host,) = json.loads(out.stdout)
    assert host["reachable"], host
    gpu = next(g for g in host["gpus"] if g["index"] == 0)
    assert gpu["name"] and gpu["memory_total_mib"] and gpu["memory_total_mib"] > 1000, gpu
    assert gpu["uuid"].startswith("GPU-"), gpu
    print(f"probe: {gpu['name']}, {gpu['memory_total_mib']} MiB, state {gpu['state']} ({gpu['reason']})")


def test_a_one_gpu_job_on_nccl_yields_to_an_owner_and_survives_a_stop(gpu_job):
    out = gpu_job.eltctl("up", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr + gpu_job.logs()
    st = gpu_job.training(after_step=5)
    assert st["world_size"] == 1
    (worker,) = [pid for pid in job_pids(gpu_job.job) if pid in gpu_pids()]
    print(f"training on the GPU: worker pid {worker}, {gpu_pids()[worker]} MiB, step {st['step']}")

    # An owner takes the GPU: our worker leaves and its memory is released.
    owner = subprocess.Popen(owner_command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        assert "owner holds the GPU" in owner.stdout.readline()
        t0 = time.monotonic()
        wait_for(lambda: worker not in gpu_pids(), 120, "our worker to leave the GPU", interval=0.05)
        released = time.monotonic() - t0
        print(f"owner yield: our worker left the GPU and its memory was released {released:.2f} s after the "
              f"owner's process held it (watch_interval 0.5 s)")
        step_at_yield = gpu_job.step()
        events = [e for e in gpu_job.status().get("events", []) if e.get("kind") == "yield"]
        assert events, gpu_job.status().get("events")
    finally:
        os.killpg(owner.pid, 9)
        owner.wait()

    # The owner is gone: after idle_for + cooldown the job resumes from its checkpoint, on CUDA.
    st = gpu_job.training(after_step=step_at_yield, timeout=240)
    assert st["step"] > step_at_yield
    print(f"resumed after the owner left: step {st['step']}")

    # down takes a final checkpoint; up again restores it.
    out = gpu_job.eltctl("down", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert job_pids(gpu_job.job) == []
    stopped_at = gpu_job.step()
    ckpts = sorted((gpu_job.root / "home").rglob("step-*"))
    assert ckpts, "no checkpoint after down"
    out = gpu_job.eltctl("up", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    st = gpu_job.training(after_step=stopped_at)
    kinds = [e.get("kind") for e in st.get("events", [])]
    assert "restore" in kinds, kinds
    out = gpu_job.eltctl("down", timeout=300)
    assert out.returncode == 0
    assert job_pids(gpu_job.job) == []

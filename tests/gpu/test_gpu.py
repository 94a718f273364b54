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

Then more jobs on the same GPU, one after the other:

6. restart mode on NCCL: the unmodified DDP script examples/ddp_restart.py; an owner
   comes: the supervisor SIGTERMs the script, which saves, and the job pauses; the
   owner goes: the script starts again and resumes at exactly the step it had reached
   (its own step log);
7. examples/train_real.py with fp16 autocast and its GradScaler on CUDA: an owner
   yield, the resume (the scaler's state travels with the checkpoint), and
   `eltctl checkpoints export` of the result, which loads with plain torch.
8. sharded training (issue 22) at world 1 on NCCL, without eltctl: replicated, ZeRO-2,
   ZeRO-1 three times and ZeRO-2 in micro-batches reduced each, deterministic kernels;
   each sharded run must end at replicated's loss and parameters (within 1e-4); the
   CUDA peaks are printed.

Events are waited for, never asserted the instant something else is seen: the
status file is written about once a second, after the worker's memory is already
free (asserting the yield event at once raced on an H200). The whole check takes a
few minutes (under 5 on an H100/H200 machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
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


TRAIN = ["python", "train.py", "--steps", "1000000", "--hidden", "256", "--layers", "2",
         "--samples", "4096", "--batch", "64", "--step-sleep", "0.02", "--checkpoint-every", "50"]
STEP = re.compile(r"^step (\d+) world (\d+) restart (\d+)", re.M)
RESUMED = re.compile(r"^resumed at step (\d+) world (\d+) restart (\d+)", re.M)


class GpuJob(ControllerFiles):
    def __init__(self, root: Path, command: list[str] = TRAIN, files: tuple[str, ...] = ("train.py", "toy.py"),
                 job_keys: tuple[str, ...] = ()) -> None:
        self.root = root
        self.job = f"g{uuid.uuid4().hex[:8]}"
        self.workdir = root / "code"
        self.workdir.mkdir()
        for f in files:
            shutil.copy(REPO / "examples" / f, self.workdir / f)
        self.inventory = root / "hosts.toml"
        home = root / "home"
        home.mkdir()
        self.inventory.write_text("\n".join([
            "[job]", f'name = "{self.job}"', f"command = {json.dumps(command)}",
            f"workdir = {json.dumps(str(self.workdir))}", 'device = "cuda"', *job_keys, "",
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

    def script_log(self) -> str:
        """What the job's workers printed (restart mode: rank 0's script lines among them)."""
        out = []
        for f in sorted((self.root / "home").glob(f".eltctl/jobs/{self.job}/*/workers/*.log")):
            try:
                out.append(f.read_text(errors="replace"))
            except OSError:
                pass
        return "\n".join(out)

    def events(self, kind: str) -> list[dict]:
        return [e for e in self.status().get("events") or [] if e.get("kind") == kind]

    def wait_event(self, kind: str, timeout: float = 60) -> dict:
        """The newest `kind` event, once the status file shows one (it is written about once a second)."""
        try:
            return wait_for(lambda: (self.events(kind) or [None])[-1], timeout, f"a {kind!r} event in status")
        except AssertionError as e:
            raise AssertionError(f"{e}\nevents: {self.status().get('events')}\n{self.logs()}") from None

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


class Owner:
    """Another user's CUDA process on GPU 0 while the `with` block runs."""

    def __enter__(self) -> "Owner":
        self.proc = subprocess.Popen(owner_command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        assert "owner holds the GPU" in self.proc.stdout.readline()
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        os.killpg(self.proc.pid, 9)
        self.proc.wait()


@contextlib.contextmanager
def new_job(**kwargs):
    root = Path(tempfile.mkdtemp(prefix="eltg-"))
    root.chmod(0o755)
    job = GpuJob(root, **kwargs)
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


@pytest.fixture(scope="module")
def gpu_job():
    with new_job() as job:
        yield job


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
    with Owner() as owner:
        wait_for(lambda: worker not in gpu_pids(), 120, "our worker to leave the GPU", interval=0.05)
        released = time.monotonic() - owner.t0
        print(f"owner yield: our worker left the GPU and its memory was released {released:.2f} s after the "
              f"owner's process held it (watch_interval 0.5 s)")
        # The memory is free before the status file says why: wait for the event.
        gpu_job.wait_event("yield")
        step_at_yield = gpu_job.step()

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


def test_restart_mode_on_nccl_resumes_an_unmodified_script_after_an_owner_yield():
    command = ["python", "ddp_restart.py", "--steps", "1000000", "--save-every", "1000", "--step-sleep", "0.02",
               "--samples", "4096", "--batch", "64", "--hidden", "256", "--checkpoint-dir", "{checkpoint_dir}"]
    keys = ('mode = "restart"', 'stop_grace = "30s"', 'progress = "step-loss"')  # status reads its step lines
    with new_job(command=command, files=("ddp_restart.py",), job_keys=keys) as job:
        out = job.eltctl("up", timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr + job.logs()
        steps = lambda: [tuple(map(int, m)) for m in STEP.findall(job.script_log())]  # noqa: E731
        wait_for(lambda: len(steps()) >= 10, 180, "10 steps of the script on the GPU")
        assert all(w == 1 for _s, w, _r in steps())
        with Owner():
            job.wait_event("yield")
            wait_for(lambda: not [p for p in job_pids(job.job) if p in gpu_pids()], 120, "the script off the GPU")
        # The owner went: after idle_for + cooldown the script starts again where it stopped.
        resumed = wait_for(lambda: [tuple(map(int, m)) for m in RESUMED.findall(job.script_log())], 240,
                           "the script to resume")
        step, world, restart = resumed[-1]
        last = max(s for s, _w, r in steps() if r < restart)
        assert step == last, (step, last, job.script_log()[-3000:])  # its SIGTERM save: nothing redone
        wait_for(lambda: [s for s, _w, r in steps() if r == restart], 120, "a step after the resume")
        assert min(s for s, _w, r in steps() if r == restart) == last + 1
        print(f"restart mode on NCCL: stopped at step {last} for the owner, resumed at {step} (restart {restart})")
        out = job.eltctl("down", timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        assert job_pids(job.job) == []


def test_fp16_grad_scaler_on_cuda_through_a_yield_a_resume_and_an_export():
    command = ["python", "train_real.py", "--steps", "1000000", "--schedule-steps", "5000", "--hidden", "256",
               "--samples", "4096", "--batch", "64", "--fp16", "--step-sleep", "0.02", "--checkpoint-every", "25"]
    with new_job(command=command, files=("train_real.py",)) as job:
        out = job.eltctl("up", timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr + job.logs()
        job.training(after_step=30)
        with Owner():
            job.wait_event("yield")
            step_at_yield = job.step()
        st = job.training(after_step=step_at_yield, timeout=240)
        print(f"fp16 + GradScaler: yielded at step {step_at_yield}, resumed past it (step {st['step']})")
        wait_for(lambda: ((job.status().get("checkpoint") or {}).get("step") or 0) > step_at_yield, 120,
                 "a checkpoint after the resume")
        out_pt = job.root / "model.pt"
        out = job.eltctl("checkpoints", "export", str(out_pt), timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        exported = torch.load(out_pt, weights_only=True)
        assert exported["step"] > step_at_yield, exported["step"]
        scaler = exported["extra_state"].get("grad_scaler")
        assert scaler and scaler.get("scale", 0) > 0, scaler
        assert all(torch.isfinite(v).all() for v in exported["model"].values() if v.is_floating_point())
        print(f"exported step {exported['step']}, GradScaler scale {scaler['scale']}")
        out = job.eltctl("down", timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        assert job_pids(job.job) == []


# The one-device runs of issue 22's check: replicated, then each shard setting, ZeRO-1 three
# times, ZeRO-2 in micro-batches reduced each (reduce_each_micro_batch) (one of six runs on an H100, in an earlier session, ended at another loss than
# replicated's; it was not reproduced): the toy MLP (hidden 2048, 3 layers), AdamW, clipping
# and checkpoints every 10 steps, as in that run, but at lr 1e-4 and with deterministic
# kernels. At that run's lr 3e-3 the model blows up at step 2 (a loss of 809 on the CPU) and
# training turns chaotic: a difference in the last bit anywhere grows to percents of the loss
# by step 30, so any kernel's nondeterminism could have made that run's difference. Here a
# sharded run matches replicated's bit for bit on the CPU, and a race in the gradient path
# (a bucket reduced before its last gradient, a step on a reduction not yet complete) would
# move the loss by far more than the bounds below.
SHARD_RUNS = (("replicated", None, ()), ("zero1-a", "optimizer", ()), ("zero2", "gradients", ()),
              ("zero1-b", "optimizer", ()), ("zero1-c", "optimizer", ()),
              ("zero2-micro", "gradients", ("--micro-batch", "16", "--reduce-each-micro-batch")))
ONE_DEVICE_ARGS = ["--steps", "30", "--hidden", "2048", "--layers", "3", "--samples", "4096", "--batch", "64",
                   "--bucket-mb", "4", "--checkpoint-every", "10", "--max-grad-norm", "1.0", "--lr", "1e-4",
                   "--deterministic"]


def one_device_run(root: Path, shard: str | None, device: str, extra: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """One world-1 job of tests/runtime/shard_worker.py on `device` ("cuda": NCCL), its own
    store and checkpoint directory under `root`: its result and its final parameters."""
    from datetime import timedelta

    import torch.distributed as dist

    root.mkdir(parents=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    shim = root / "shim"
    shim.mkdir()
    (shim / "eltctl_runtime").symlink_to(REPO / "runtime")
    env = {**os.environ, "ELTCTL_STORE": f"127.0.0.1:{store.port}", "ELTCTL_JOB": f"s{uuid.uuid4().hex[:8]}",
           "ELTCTL_WORKER_ID": f"gpu/{device}/0", "ELTCTL_DEVICE": device, "ELTCTL_CHECKPOINT_DIR": str(root / "ckpt"),
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), str(REPO), os.environ.get("PYTHONPATH")]))}
    if device == "cuda":
        env["ELTCTL_LOCAL_GPU"] = "0"
    result = root / "result.json"
    cmd = [sys.executable, str(REPO / "tests" / "runtime" / "shard_worker.py"), *ONE_DEVICE_ARGS,
           "--result", str(result), *extra] + (["--shard", shard] if shard else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    r = json.loads(result.read_text())
    assert r["step"] == 30 and r["world_size"] == 1 and r["loss"] is not None, r
    assert sorted(p.name for p in (root / "ckpt").iterdir() if p.name.startswith("step-"))[-1] == "step-00000030"
    del store
    return r, torch.load(str(result) + ".pt", map_location="cpu", weights_only=True)


def compare_one_device_runs(root: Path, device: str) -> list[str]:
    """Every SHARD_RUNS job on `device`; each sharded one must end where replicated's does
    (the final loss and every parameter, within what the clipping norm's other summation
    order moves them). Returns the lines to print, one per run; raises at the end, after
    every run, if one differs (so all are printed)."""
    lines, bad = [], []
    ref_loss, ref = None, None
    for name, shard, extra in SHARD_RUNS:
        r, params = one_device_run(root / name, shard, device, extra)
        peak = r["cuda_peak_bytes"]
        if ref is None:
            ref_loss, ref = r["loss"], params
            lines.append(f"{name}: loss {r['loss']:.6f}" + (f", CUDA peak {peak / 2**20:.1f} MiB" if peak else ""))
            continue
        diff = max(float((params[k].double() - v.double()).abs().max()) for k, v in ref.items())
        rel = abs(r["loss"] - ref_loss) / abs(ref_loss)
        lines.append(f"{name}: loss {r['loss']:.6f} (relative difference {rel:.1e}), largest parameter difference "
                     f"{diff:.1e}" + (f", CUDA peak {peak / 2**20:.1f} MiB" if peak else ""))
        if set(params) != set(ref) or rel > 1e-4 or diff > 1e-4:
            bad.append(name)
    for line in lines:
        print(f"one {device} device: {line}")
    assert not bad, f"these runs ended elsewhere than replicated's: {bad}\n" + "\n".join(lines)
    return lines


def test_a_one_gpu_sharded_run_on_nccl_prints_its_cuda_peak(tmp_path):
    """Sharded training (issue 22) on one GPU: world 1 on NCCL, replicated and each shard
    setting (ZeRO-1 three times; ZeRO-2 also in micro-batches of 16, each reduced), AdamW,
    clipping, checkpoints gathered from the shard: each ends at replicated's loss and
    parameters; the CUDA peaks (torch.cuda.max_memory_allocated) are printed."""
    compare_one_device_runs(tmp_path, "cuda")

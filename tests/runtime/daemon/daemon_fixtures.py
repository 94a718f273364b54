"""A simulated GPU host for the host daemon's tests: a store hosted here, the
GPU simulator (eltctl/sim) with its stand-in `nvidia-smi` first on the daemon's
PATH, and the real daemon as a subprocess running the real example training
(examples/train.py, tiny model, device cpu, one worker per simulated GPU).

Everything it starts (the daemon, its workers, foreign processes) is ended in
`close()`, pass or fail: the daemon and foreign processes by the process groups
we created, the workers (their own sessions, started by the daemon) by the pids
in their pid files and any process left whose environment carries this test's
unique ELTCTL_JOB.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import eltctl_runtime as elt
from eltctl.sim.gpustate import ForeignProcess, GpuState, install_nvidia_smi
from eltctl_runtime.store import auth
from eltctl_runtime.protocol import desired_key, get_events, get_status, state_key
from tests.testbed.hostpython import HOST_PYTHON, host_env

ROOT = Path(__file__).resolve().parents[3]
TRAIN = ROOT / "examples" / "train.py"
# Small model and data, and a short sleep per step so that a run never ends by itself.
TRAIN_ARGS = ["--hidden", "32", "--layers", "2", "--samples", "480", "--batch", "24", "--lr", "3e-3",
              "--steps", "1000000", "--step-sleep", "0.02"]


def job_pids(job: str, workers_only: bool = False) -> list[int]:
    """Live processes whose environment holds ELTCTL_JOB=<job> (not ourselves):
    the daemon (started with it, as the controller does), its nvidia-smi calls
    and the workers; workers_only: the worker processes (session leaders with
    an ELTCTL_WORKER_ID)."""
    marker = f"\0ELTCTL_JOB={job}\0".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = b"\0" + f.read() + b"\0"
            with open(f"/proc/{entry}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
        except (OSError, IndexError):
            continue
        if marker not in env or zombie:
            continue
        if workers_only:
            try:
                leader = os.getsid(int(entry)) == int(entry)
            except OSError:
                continue
            if not leader or b"\0ELTCTL_WORKER_ID=" not in env:
                continue
        out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


@dataclass
class SimHost:
    tmp: Path
    n_gpus: int = 2
    name: str = "h1"
    hang_timeout: float = 5.0
    nvidia_smi: bool = True  # False: a CPU-only host (no nvidia-smi on the daemon's PATH)
    overrides: dict = field(default_factory=dict)
    job: str = field(default_factory=lambda: f"d{uuid.uuid4().hex[:8]}")
    secret: bytes | None = None  # the job's secret: in job_dir/secret, named by daemon.json's secret_file

    def __post_init__(self) -> None:
        self.job_dir = self.tmp / "jobs" / self.job / self.name
        self.job_dir.mkdir(parents=True)
        if self.secret is not None:
            auth.write_secret(self.job_dir / auth.SECRET_FILE_NAME, self.secret)
        self.bin = self.tmp / "bin"
        install_nvidia_smi(self.bin)
        self.gpu = GpuState(self.tmp / "gpus.json", self.name)
        self.gpu.initialize(self.n_gpus)
        self.store = self._serve()
        self.port = self.store.port
        self.config_path = self.job_dir / "daemon.json"
        self.daemons: list[subprocess.Popen] = []
        self.foreign: list[subprocess.Popen] = []
        self._seq = 0
        self.write_config()

    def _serve(self, port: int = 0) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=30))

    # -- the daemon ----------------------------------------------------------------
    def write_config(self) -> None:
        cfg = {
            "job": self.job, "host": self.name, "store": f"127.0.0.1:{self.port}", "job_dir": str(self.job_dir),
            "code_dir": str(ROOT), "python": HOST_PYTHON, "command": ["python", str(TRAIN), *TRAIN_ARGS],
            "env": {"OMP_NUM_THREADS": "1"}, "device": "cpu", "gpus": list(range(self.n_gpus)), "slots": 1,
            "checkpoint_dir": str(self.tmp / "ckpt"), "hang_timeout": self.hang_timeout, "min_workers": 1,
            "max_workers": None, "watch_interval": 0.5, "nvidia_smi_timeout": 3, "leave_timeout": 60,
            "stop_timeout": 60,
        }
        if self.secret is not None:
            cfg["secret_file"] = str(self.job_dir / auth.SECRET_FILE_NAME)
        cfg.update(self.overrides)
        self.config_path.write_text(json.dumps(cfg, indent=1))

    def env(self) -> dict:
        env = host_env(dict(os.environ))
        # ELTCTL_JOB and ELTCTL_HOST as eltctl/hosts/ops.py starts the daemon: they mark the job's processes.
        env.update({"ELTSIM_STATE": str(self.gpu.path), "ELTSIM_HOST": self.name, "ELTCTL_JOB": self.job,
                    "ELTCTL_HOST": self.name,
                    # this simulated host's own GPU claims (runtime/claims.py), not the machine's
                    "ELTCTL_CLAIMS_DIR": str(self.tmp / "claims")})
        if self.nvidia_smi:
            env["PATH"] = f"{self.bin}:{env.get('PATH', os.defpath)}"
        return env

    def start_daemon(self) -> subprocess.Popen:
        p = subprocess.Popen([HOST_PYTHON, "-m", "eltctl_runtime.daemon", "--config", str(self.config_path)],
                             env=self.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
        self.daemons.append(p)
        return p

    def start_detached(self) -> subprocess.CompletedProcess:
        """`--detach`: the command answers once the daemon holds its pid file."""
        return subprocess.run([HOST_PYTHON, "-m", "eltctl_runtime.daemon", "--config", str(self.config_path),
                               "--detach"], env=self.env(), stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=120, cwd=ROOT)

    def daemon_pid(self) -> int | None:
        try:
            return int((self.job_dir / "daemon.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def js(self):
        """The job's store as the controller sees it (signed with the job's secret, if any)."""
        return elt.job_store(self.store, self.job, self.secret)

    def desire(self, slots: list[int], stop: bool = False) -> int:
        self._seq += 1
        js = self.js()
        js.set(desired_key(self.name), json.dumps({"seq": self._seq, "slots": slots, "stop": stop}))
        return self._seq

    # -- observation ---------------------------------------------------------------
    def state(self) -> dict | None:
        js = self.js()
        key = state_key(self.name)
        return json.loads(js.get(key)) if js.check([key]) else None

    def live_workers(self) -> dict[int, dict]:
        """slot -> worker entry of the daemon's state, for live workers."""
        st = self.state() or {}
        return {w["slot"]: w for w in st.get("workers", ())
                if w["state"] in ("running", "leaving", "stopping", "killed", "evicted")}

    def status(self) -> dict | None:
        return get_status(self.js())

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in get_events(self.js()) if kind is None or e.get("kind") == kind]

    def dead_reported(self, worker_id: str) -> bool:
        return self.js().check([elt.Keys.dead(worker_id)])

    def log(self) -> str:
        p = self.job_dir / "daemon.log"
        return p.read_text() if p.exists() else ""

    def worker_log(self, slot: int) -> str:
        p = self.job_dir / "workers" / f"{slot}.log"
        return p.read_text()[-3000:] if p.exists() else ""

    def wait_for(self, pred, what: str, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}\n--- daemon.log\n{self.log()[-6000:]}\n"
                             + "".join(f"--- worker {s}\n{self.worker_log(s)}\n" for s in range(self.n_gpus))
                             + f"--- state\n{json.dumps(self.state(), indent=1)}")

    def wait_world(self, world: int, timeout: float = 120.0) -> dict:
        """Wait until the runtime's status shows `world` members and two more steps."""
        first: dict = {}

        def ok():
            st = self.status()
            if not st or st["world_size"] != world:
                return None
            first.setdefault("step", st["step"])
            return st if st["step"] >= first["step"] + 2 else None

        return self.wait_for(ok, f"world size {world}", timeout)

    # -- faults --------------------------------------------------------------------
    def start_foreign(self, gpu: int) -> subprocess.Popen:
        """Somebody else's process (here: a `sleep` of ours) registered on `gpu`."""
        p = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, start_new_session=True)
        self.foreign.append(p)
        self.gpu.add_process(ForeignProcess(pid=p.pid, gpu=gpu, used_memory_mib=3000, utilization=90))
        return p

    def stop_store(self) -> None:
        del self.store

    def restart_store(self) -> None:
        self.store = self._serve(self.port)

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        pid = self.daemon_pid()  # a detached daemon of this test's own job directory
        if pid is not None and alive(pid) and pid not in [p.pid for p in self.daemons]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.daemons:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid_file in (self.job_dir / "workers").glob("*.pid"):
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if pid in job_pids(self.job):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in job_pids(self.job):  # anything of this (uniquely named) job that is left
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.foreign:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=10)
        deadline = time.monotonic() + 10
        while job_pids(self.job) and time.monotonic() < deadline:
            time.sleep(0.1)

"""The `job_env` fixture (a pytest plugin, registered in tests/conftest.py): a job on
real sshd hosts, for the end-to-end tests that drive the controller through the CLI.

`job_env` gives a test bed of three simulated GPU hosts (2 GPUs each), a job
directory holding the example training (tiny model, CPU workers on simulated GPUs),
an inventory with short policy times, a private XDG_STATE_HOME, and `eltctl(...)`
to run the real CLI. Its finalizer ends the job, pass or fail: it SIGKILLs, by pid,
every process whose environment names the job (ELTCTL_JOB: daemons, workers, restart
mode's supervisors and scripts) or its private state directory (XDG_STATE_HOME: the
controller, the store keeper, any `eltctl` still running) or whose command line
names its temporary directory, until none is left (`end_job`). It does not run `eltctl down`: a graceful stop (every worker's final
checkpoint, a check of every host over new SSH connections, a CLI start) cost 20 s of
a loaded machine per test and asserted nothing; the tests of `down` run it themselves.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from eltctl_runtime.files import read_json

REPO = Path(__file__).resolve().parents[2]
ELTCTL = [sys.executable, "-m", "eltctl"]

# Short times so the suite fits a busy 2-core machine. The probe (a shell of about 40 short
# processes and two nvidia-smi calls per host, about 50 ms of CPU) every 2 s, and the daemons'
# GPU watch (two nvidia-smi calls) at the product's default of 1 s: at 1 s and 0.5 s they were
# about a tenth of the suite's CPU, for events that then came at most a second sooner.
POLICY = """\
[policy]
idle_for = "1s"
cooldown = "2s"
probe_interval = "2s"
watch_interval = "1s"
hang_timeout = "4s"
nvidia_smi_timeout = "5s"
bench_after = 5
"""


def job_pids(job: str) -> list[int]:
    """Every live process whose environment holds ELTCTL_JOB=<job> (this machine runs all hosts)."""
    return marked_pids([f"ELTCTL_JOB={job}"])


def marked_pids(markers: list[str], in_cmdline: str | None = None) -> list[int]:
    """Every live process (not a zombie, not this one) whose environment holds one of
    `markers`, each a whole `NAME=value` entry, or whose command line contains `in_cmdline`."""
    needles = {m.encode() for m in markers}
    word = in_cmdline.encode() if in_cmdline else None
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if needles.isdisjoint(env):
                if word is None:
                    continue
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if word not in f.read():
                        continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
        except (OSError, IndexError):
            continue
        out.append(int(name))
    return sorted(out)


def end_job(job: str, root: Path, state_home: Path, timeout: float = 60) -> list[int]:
    """SIGKILL every process of a test's job until none is left; returns the pids killed.

    Its processes are found by what only the test's own processes carry: the job's name
    in their environment (ELTCTL_JOB, a fresh random name per test: daemons, workers,
    supervisors, scripts, on every simulated host), the test's private state directory
    (XDG_STATE_HOME: the controller, the store keeper and whatever they spawned), or the
    test's fresh temporary directory `root` on the command line (the controller and the
    keeper name its inventory). Scanned again after each round: a controller or a daemon
    may start a process between a scan and its kill. A process still there after
    `timeout` s fails the teardown."""
    markers = [f"ELTCTL_JOB={job}", f"XDG_STATE_HOME={state_home}"]
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while pids := marked_pids(markers, in_cmdline=f"{root}/"):
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job}: processes {pids} survived SIGKILL for {timeout:g} s")
        for pid in pids:
            _kill_pid(pid)
        killed.extend(p for p in pids if p not in killed)
        time.sleep(0.05)
    return killed


def proc_env(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def worker_pids(job: str) -> dict[str, int]:
    """worker id -> pid of the job's live workers."""
    out = {}
    for pid in job_pids(job):
        wid = proc_env(pid).get("ELTCTL_WORKER_ID")
        if wid:
            out[wid] = pid
    return out


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5, stalled=None):
    """Poll `predicate` until it returns something true (returned) or `timeout` s pass;
    `stalled()`, if given, true ends the wait early (no progress: waiting longer is no use)."""
    start = time.monotonic()
    deadline = start + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        if stalled is not None and stalled():
            raise AssertionError(f"no progress after {time.monotonic() - start:.0f} s waiting for {what} "
                                 f"(last: {last!r})")
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")


class ControllerFiles:
    """What a job's controller leaves in its state directory (`self.state_dir`), read as
    the tests need it; a missing or half-written file reads as empty."""

    def status(self) -> dict:
        return read_json(self.state_dir / "status.json") or {}

    def controller_pid(self) -> int | None:
        try:
            return int((read_json(self.state_dir / "controller.json") or {})["pid"])
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class JobEnv(ControllerFiles):
    bed: object
    hosts: list
    job: str
    inventory: Path
    state_home: Path
    workdir: Path
    env: dict = field(default_factory=dict)

    def eltctl(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([*ELTCTL, "-i", str(self.inventory), *args], env=self.env, capture_output=True,
                                text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise AssertionError(f"eltctl {' '.join(args)} exited {result.returncode}\n"
                                 f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\n"
                                 f"controller.log:\n{self.controller_log()}")
        return result

    @property
    def state_dir(self) -> Path:
        return self.state_home / "eltctl" / self.job

    def controller_log(self, n: int = 40) -> str:
        try:
            return "\n".join((self.state_dir / "controller.log").read_text().splitlines()[-n:])
        except OSError:
            return ""

    def training_at(self, world_size: int, *, after_step: int = 0, timeout: float = 120) -> dict:
        """Wait until status.json shows training at `world_size` past `after_step`."""
        def ok():
            st = self.status()
            if (st.get("state") == "training" and st.get("world_size") == world_size
                    and (st.get("step") or 0) > after_step):
                return st
            return None
        try:
            return wait_for(ok, timeout, f"training at world size {world_size} after step {after_step}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nstatus: {json.dumps(self.status())[:3000]}\n"
                                 f"controller.log:\n{self.controller_log()}\n{self.host_logs()}") from None

    def host_logs(self, n: int = 6) -> str:
        """The tails of every daemon and worker log on the hosts (for failure messages)."""
        out = []
        for f in sorted(Path(self.bed.dir).glob(f"*/home/.eltctl/jobs/{self.job}/*/*.log")) + \
                sorted(Path(self.bed.dir).glob(f"*/home/.eltctl/jobs/{self.job}/*/workers/*.log")):
            try:
                lines = f.read_text(errors="replace").splitlines()[-n:]
            except OSError:
                continue
            out.append(f"--- {f.relative_to(self.bed.dir)}\n" + "\n".join(lines))
        return "\n".join(out)


def _kill_pid(pid: int | None) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def hand_home_to_hosts_accounts(hosts) -> None:
    """The test bed's hosts give both accounts one home: hand ~/.eltctl to each host's
    own account, as its own home would be (on a lab each account has its own; the test
    bed's root account writes there whatever the owner)."""
    for h in hosts:
        top = h.dir / "home" / ".eltctl"
        uid = pwd.getpwnam(h.login)
        for d in (top, top / "jobs"):
            os.chown(d, uid.pw_uid, uid.pw_gid)
        subprocess.run(["chown", "-R", f"{uid.pw_uid}:{uid.pw_gid}", str(top / "runtime")], check=True)


@pytest.fixture
def job_env(testbed):
    yield from job_env_on(testbed, testbed.add_hosts(3, gpus=2))


def job_env_on(testbed, hosts: list, extra: str = ""):
    """The `job_env` fixture's body on hosts of the caller's (a generator: yield the JobEnv,
    tear everything down after); the inventory lists those hosts only (others of the test
    bed may stand for something else, an ssh:// mirror's host). `extra`: more inventory
    text (e.g. a [storage] table)."""
    job = f"t{uuid.uuid4().hex[:8]}"
    root = Path(tempfile.mkdtemp(prefix="eltc-"))  # short: unix socket paths are limited to 108 bytes
    workdir = root / "code"
    workdir.mkdir()
    for f in ("train.py", "toy.py"):
        shutil.copy(REPO / "examples" / f, workdir / f)
    command = ["python", "train.py", "--steps", "1000000", "--hidden", "16", "--layers", "1", "--samples", "4096",
               "--batch", "24", "--step-sleep", "0.05", "--checkpoint-every", "25"]
    inventory = testbed.write_inventory(root / "hosts.toml", hosts=hosts, job={
        "name": job, "command": command, "workdir": str(workdir), "device": "cpu", "min_workers": 1,
        "env": {"OMP_NUM_THREADS": "1"}}, extra=POLICY + extra)
    state_home = root / "state"
    env = {**os.environ, "XDG_STATE_HOME": str(state_home), "PYTHONUNBUFFERED": "1"}
    je = JobEnv(bed=testbed, hosts=hosts, job=job, inventory=inventory, state_home=state_home, workdir=workdir,
                env=env)
    try:
        yield je
    finally:
        try:
            end_job(job, root, state_home)
        finally:
            shutil.rmtree(root, ignore_errors=True)

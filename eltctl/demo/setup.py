"""The demo's plan and its files: the inventory of local hosts with simulated GPUs,
the example training's code, each host's GPU state file. `prepare` starts no process."""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from eltctl.errors import EltctlError
from eltctl.hosts import layout

MARKER_ENV = "ELTCTL_DEMO_ROOT"  # in the environment of every process the demo starts
OWNER_USER_LABEL = "owner"


class DemoError(EltctlError):
    """The demo could not run or did not reach a step of its scenario."""


@dataclass(frozen=True)
class DemoHost:
    name: str
    gpus: int


@dataclass(frozen=True)
class DemoPlan:
    """What the demo does, and how long it may wait for each step of it."""

    hosts: tuple[DemoHost, ...] = (DemoHost("ws1", 2), DemoHost("ws2", 1), DemoHost("ws3", 1))
    owner_host: str = "ws1"  # whose owner comes back, and to which of its GPUs
    owner_gpu: int = 1
    steps_before_owner: int = 15  # training steps at full size before the owner comes
    owner_stays_s: float = 6.0  # how long the owner keeps the GPU
    steps_after_rejoin: int = 10  # steps at full size again before `down`
    idle_for: str = "3s"  # [policy] of the demo inventory
    cooldown: str = "3s"
    probe_interval: str = "2s"
    watch_interval: str | None = None  # None: the inventory's default (written only if it knows the key)
    step_sleep_s: float = 0.05  # extra work per step: a pace a person can follow
    wait_s: float = 90.0  # the longest any one step of the scenario may take

    @property
    def gpu_count(self) -> int:
        return sum(h.gpus for h in self.hosts)


@dataclass(frozen=True)
class DemoSetup:
    """The files `prepare` wrote: where everything is."""

    root: Path
    inventory: Path
    job: str
    home: Path  # HOME of the demo's hosts (they share this machine and this home)
    state_home: Path  # XDG_STATE_HOME of the demo's controller
    bin_dir: Path  # holds the stand-in nvidia-smi
    gpu_states: Mapping[str, Path]  # host name -> its simulated GPU state file

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for eltctl's own commands: the private state and the marker."""
        env = dict(os.environ if base is None else base)
        env["XDG_STATE_HOME"] = str(self.state_home)
        env[MARKER_ENV] = str(self.root)
        return env

    def host_dir(self, host: str) -> Path:
        """The job's directory on a demo host (`~/.eltctl/jobs/<job>/<host>/`)."""
        return layout.job_dir_in(self.home, self.job, host)


def example_dir() -> Path:
    """The repository's examples/ (train.py, toy.py) next to the eltctl package."""
    return Path(__file__).resolve().parents[2] / "examples"


def training_command(python: str, plan: DemoPlan) -> list[str]:
    """The example training, small enough for 2 cores and long enough to outlast the demo."""
    return [python, "train.py", "--steps", "1000000", "--hidden", "64", "--layers", "2",
            "--samples", "4096", "--batch", "32", "--checkpoint-every", "20",
            "--step-sleep", f"{plan.step_sleep_s:g}"]


def _toml(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def _policy_keys() -> tuple[str, ...]:
    from eltctl.inventory import POLICY_KEYS

    return tuple(POLICY_KEYS)


def prepare(root: Path, plan: DemoPlan, *, python: str | None = None,
            source: Path | None = None, job: str | None = None) -> DemoSetup:
    """Write the demo's files under `root` (which must exist): code, GPUs, inventory.

    Starts no process. `python` is the interpreter with torch (default: this one).
    """
    from eltctl.sim.gpustate import GpuState, install_nvidia_smi

    python = python or sys.executable
    source = source or example_dir()
    job = job or f"demo-{os.getpid()}-{int(time.time()) % 100000}"
    root = Path(root)
    code = root / "code"
    code.mkdir(parents=True, exist_ok=True)
    for name in ("train.py", "toy.py"):
        if not (source / name).is_file():
            raise DemoError(f"the example training is missing: no {source / name}",
                            hint="run the demo from a checkout of eltctl (bash scripts/demo.sh)")
        shutil.copyfile(source / name, code / name)
    home = root / "home"
    home.mkdir(exist_ok=True)
    state_home = root / "state"
    state_home.mkdir(exist_ok=True)
    bin_dir = root / "bin"
    install_nvidia_smi(bin_dir)
    gpu_states: dict[str, Path] = {}
    for host in plan.hosts:
        path = root / "gpus" / f"{host.name}.json"
        path.parent.mkdir(exist_ok=True)
        GpuState(path, host.name).initialize(host.gpus)
        gpu_states[host.name] = path

    base_path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    policy = {"idle_for": plan.idle_for, "cooldown": plan.cooldown,
              "probe_interval": plan.probe_interval}
    if plan.watch_interval is not None and "watch_interval" in _policy_keys():
        policy["watch_interval"] = plan.watch_interval
    lines = [
        "# Written by `eltctl demo`: three hosts on this machine (no SSH), simulated GPUs.",
        "[job]",
        f"name = {_toml(job)}",
        f"command = {_toml(training_command(python, plan))}",
        f"workdir = {_toml(str(code))}",
        "min_workers = 1",
        f"max_workers = {plan.gpu_count}",
        'device = "cpu"',
        # Two cores for every worker, daemon and controller of the demo.
        'env = { OMP_NUM_THREADS = "1" }',
        "",
        "[policy]",
        *(f"{k} = {_toml(v)}" for k, v in policy.items()),
    ]
    for host in plan.hosts:
        env = {"HOME": str(home), "PATH": f"{bin_dir}:{base_path}",
               "ELTSIM_HOST": host.name, "ELTSIM_STATE": str(gpu_states[host.name]),
               # each simulated host its own GPU claims: they share this machine's /tmp
               "ELTCTL_CLAIMS_DIR": str(gpu_states[host.name].parent / f"{host.name}-claims")}
        lines += ["", "[[hosts]]", f"name = {_toml(host.name)}", 'address = "local"',
                  f"python = {_toml(python)}", f"env = {_toml(env)}"]
    inventory = root / "hosts.toml"
    inventory.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return DemoSetup(root=root, inventory=inventory, job=job, home=home, state_home=state_home,
                     bin_dir=bin_dir, gpu_states=gpu_states)

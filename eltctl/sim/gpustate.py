"""The simulated GPUs of one host: the state file and the API that controls it.

A simulated host is a real machine (a real sshd, real processes) whose GPUs are
described by a JSON file instead of a driver. `nvidia_smi.py` (the stand-in
`nvidia-smi`) reads that file on every call; the test bed and `eltctl demo`
change it through `GpuState` below. The file's path reaches the stand-in
through the environment variable `ELTSIM_STATE`, and the host's name through
`ELTSIM_HOST`.

State file format (version 1), written atomically (temp file + rename):

    {
      "version": 1,
      "host": "h1",                  # the simulated host's name (ELTSIM_HOST)
      "mode": "ok",                  # ok | na | fail | hang | missing (GpuMode)
      "driver_version": "535.129.03",
      "cuda_version": "12.2",
      "worker_memory_mib": 600,      # what one of "our" workers uses on its GPU
      "worker_utilization": 0,       # percent, likewise
      "gpus": [
        {"index": 0, "uuid": "GPU-...", "name": "NVIDIA A100-SXM4-40GB",
         "pci_bus_id": "00000000:07:00.0",
         "memory_total_mib": 40960,
         "memory_used_mib": 0,       # base value, before processes
         "utilization": 0}           # base value, percent
      ],
      "processes": [                 # foreign processes, registered by pid
        {"pid": 1234, "gpu": 0, "used_memory_mib": 2000, "utilization": 50,
         "starttime": 987654}        # /proc/PID/stat field 22; guards pid reuse
      ]
    }

Any numeric GPU or process field may instead hold a literal string such as
"[N/A]" or "[Not Supported]"; it is printed as is (as some boards and MIG do).

What `nvidia-smi` shows, per call:
- mode `ok`: the GPUs; memory.used and utilization.gpu are the base values plus
  those of the processes listed on that GPU (capped at the total / 100 %).
- mode `na`: as `ok`, but utilization.gpu and per-process used memory read
  `[N/A]`.
- mode `fail`: the driver message on stdout, exit status 9.
- mode `hang`: never answers (sleeps until killed, or until the state file is
  removed, so a leaked one ends with its test bed).
- mode `missing`: the host has no `nvidia-smi`: `install_nvidia_smi`'s launcher
  is removed from the host's bin directory by whoever controls the host (the
  test bed); if called anyway it answers like a shell's "command not found".
- processes: a registered foreign pid is listed while that process is alive
  (killing it frees the GPU, as on real hardware); and any live process whose
  environment holds `ELTSIM_HOST=<host>` and `CUDA_VISIBLE_DEVICES=<index or
  uuid>` (the first one listed) is listed as a worker on that GPU with
  `worker_memory_mib`. If such a process also holds `ELTSIM_STATE`, it must name
  this state file (so two test beds that both have an "h1" do not mix).
"""

from __future__ import annotations

import enum
import json
import os
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eltctl_runtime.files import write_atomic

STATE_ENV = "ELTSIM_STATE"
HOST_ENV = "ELTSIM_HOST"
FORMAT_VERSION = 1
DEFAULT_GPU_NAME = "NVIDIA A100-SXM4-40GB"
DEFAULT_MEMORY_TOTAL_MIB = 40960
DRIVER_FAILURE_MESSAGE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
DRIVER_FAILURE_EXIT = 9

# Field names a caller may pass to `set_gpu` (the state file's keys).
GPU_FIELDS = frozenset({"name", "uuid", "pci_bus_id", "memory_total_mib", "memory_used_mib", "utilization"})


class GpuMode(str, enum.Enum):
    """How the host's driver behaves. Any mode may follow any other."""

    OK = "ok"
    NA = "na"  # some fields read [N/A]
    FAIL = "fail"  # driver unreachable: message + exit 9
    HANG = "hang"  # wedged driver: never answers
    MISSING = "missing"  # no nvidia-smi at all (a CPU-only host)


@dataclass(frozen=True)
class ForeignProcess:
    """A process of somebody else that holds a GPU."""

    pid: int
    gpu: int
    used_memory_mib: int | str = 2000
    utilization: int | str = 50
    starttime: int | None = None


def process_starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])


def gpu_uuid(seed: str, index: int) -> str:
    """A stable, realistic-looking GPU UUID, unique per (seed, index)."""
    return "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"eltsim:{seed}:{index}"))


def fresh_gpus(n: int, *, seed: str, memory_total_mib: int = DEFAULT_MEMORY_TOTAL_MIB,
               name: str = DEFAULT_GPU_NAME) -> list[dict[str, Any]]:
    """`n` idle GPUs; the seed (e.g. the state file's path) makes the UUIDs unique."""
    return [
        {
            "index": i,
            "uuid": gpu_uuid(seed, i),
            "name": name,
            "pci_bus_id": f"00000000:{0x07 + 0x10 * i:02X}:00.0",
            "memory_total_mib": memory_total_mib,
            "memory_used_mib": 0,
            "utilization": 0,
        }
        for i in range(n)
    ]


class GpuState:
    """Reads and changes one host's state file. Each change is one atomic write."""

    def __init__(self, path: Path, host: str) -> None:
        self.path = Path(path)
        self.host = host

    # -- whole-file operations -------------------------------------------------

    def read(self) -> dict[str, Any]:
        with open(self.path, encoding="utf-8") as f:
            return json.load(f)

    def write(self, state: dict[str, Any]) -> None:
        # Temp file in the same directory + rename: a concurrent nvidia-smi sees
        # either the old file or the new one, never half of one. Readable by every
        # account of the host, as a driver's state is (a temp file alone is 0600: the
        # stand-in nvidia-smi of another account then failed as a missing driver).
        write_atomic(self.path, json.dumps(state, indent=1), mode=0o644, sync=False)

    def initialize(self, n_gpus: int = 2, *, memory_total_mib: int = DEFAULT_MEMORY_TOTAL_MIB,
                   name: str = DEFAULT_GPU_NAME) -> None:
        """A new state: `n_gpus` idle GPUs, mode ok, no processes."""
        self.write({
            "version": FORMAT_VERSION,
            "host": self.host,
            "mode": GpuMode.OK.value,
            "driver_version": "535.129.03",
            "cuda_version": "12.2",
            "worker_memory_mib": 600,
            "worker_utilization": 0,
            "gpus": fresh_gpus(n_gpus, seed=str(self.path), memory_total_mib=memory_total_mib, name=name),
            "processes": [],
        })

    def _update(self, change) -> dict[str, Any]:
        state = self.read()
        change(state)
        self.write(state)
        return state

    # -- the controls ----------------------------------------------------------

    def set_gpus(self, n: int, *, memory_total_mib: int = DEFAULT_MEMORY_TOTAL_MIB,
                 name: str = DEFAULT_GPU_NAME) -> None:
        """Replace the GPUs by `n` fresh, idle ones; registered processes are dropped."""
        def change(state: dict[str, Any]) -> None:
            state["gpus"] = fresh_gpus(n, seed=str(self.path), memory_total_mib=memory_total_mib, name=name)
            state["processes"] = []
        self._update(change)

    def set_gpu(self, index: int, **fields: Any) -> None:
        """Change fields of one GPU, e.g. memory_used_mib=30000, utilization="[N/A]"."""
        unknown = set(fields) - GPU_FIELDS
        if unknown:
            raise ValueError(f"unknown GPU field(s) {sorted(unknown)}; known: {sorted(GPU_FIELDS)}")

        def change(state: dict[str, Any]) -> None:
            for gpu in state["gpus"]:
                if gpu["index"] == index:
                    gpu.update(fields)
                    return
            raise IndexError(f"host {self.host} has no GPU {index}")
        self._update(change)

    def set_mode(self, mode: GpuMode | str) -> None:
        mode = GpuMode(mode)
        self._update(lambda state: state.__setitem__("mode", mode.value))

    def set_worker_load(self, *, memory_mib: int, utilization: int = 0) -> None:
        """What each of our workers (found by environment) adds to its GPU."""
        def change(state: dict[str, Any]) -> None:
            state["worker_memory_mib"] = memory_mib
            state["worker_utilization"] = utilization
        self._update(change)

    def add_process(self, proc: ForeignProcess) -> None:
        def change(state: dict[str, Any]) -> None:
            if not any(g["index"] == proc.gpu for g in state["gpus"]):
                raise IndexError(f"host {self.host} has no GPU {proc.gpu}")
            state["processes"] = [p for p in state["processes"] if p["pid"] != proc.pid]
            state["processes"].append({
                "pid": proc.pid, "gpu": proc.gpu, "used_memory_mib": proc.used_memory_mib,
                "utilization": proc.utilization,
                "starttime": proc.starttime if proc.starttime is not None else process_starttime(proc.pid),
            })
        self._update(change)

    def remove_process(self, pid: int) -> None:
        def change(state: dict[str, Any]) -> None:
            state["processes"] = [p for p in state["processes"] if p["pid"] != pid]
        self._update(change)


def nvidia_smi_source() -> Path:
    """The stand-in's source file (inside the installed eltctl package)."""
    return Path(__file__).with_name("nvidia_smi.py")


def find_system_python() -> str:
    """An interpreter for the stand-in. Any python3 works; a system one is
    preferred because a venv's site start-up is slower (the stand-in runs with
    -I -S anyway) and it does not depend on a venv staying where it is."""
    import shutil
    import sys
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("python3") or sys.executable


def install_nvidia_smi(bin_dir: Path, *, python: str | None = None) -> Path:
    """Write `bin_dir/nvidia-smi`: a two-line launcher that runs the stand-in.

    The launcher imports the stand-in as a module (so its bytecode is cached)
    under `python -I -S` (no site, no user environment): start-up cost is most of
    a call's cost, and 64 simulated hosts share the machine's cores.
    """
    bin_dir = Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    src_dir = nvidia_smi_source().parent
    launcher = bin_dir / "nvidia-smi"
    text = (
        f"#!{python or find_system_python()} -IS\n"
        f"import sys; sys.path.insert(0, {str(src_dir)!r}); import nvidia_smi; sys.exit(nvidia_smi.main(sys.argv[1:]))\n"
    )
    write_atomic(launcher, text, mode=0o755, sync=False)
    return launcher


def uninstall_nvidia_smi(bin_dir: Path) -> None:
    try:
        (Path(bin_dir) / "nvidia-smi").unlink()
    except FileNotFoundError:
        pass

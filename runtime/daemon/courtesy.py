"""Courtesy while running: the priority and limits the daemon's workers run with.

daemon.json's optional "courtesy" object (written from the inventory's `nice`,
`ionice`, `cpu_threads` and `memory_limit`; eltctl/inventory/courtesy.py)::

    "courtesy": {"nice": 10, "ionice": "best-effort", "cpu_threads": 4, "memory_limit_mib": 16384}

Absent (an older controller): no courtesy, the workers run as the daemon does.

How each is applied, in the worker's own process between fork and exec (so every
thread and child it makes inherits it; `preexec`):

- nice: `setpriority` to the level, when it is above the daemon's own (a worker
  never runs at a higher priority than its daemon; raising one needs privileges).
- ionice: `ioprio_set` (a raw syscall through ctypes; the stdlib has no wrapper):
  "best-effort" is class 2 at its lowest level, 7; "idle" is class 3. Where the
  syscall is missing (an unknown architecture) or refused, the worker starts without
  it and the daemon's log says so once (`describe`).
- cpu_threads: OMP_NUM_THREADS, MKL_NUM_THREADS, OPENBLAS_NUM_THREADS and
  ELTCTL_CPU_THREADS in the worker's environment (`thread_env`; torch sizes its
  intra-op pool from OMP_NUM_THREADS). They override the job's own `env`: the limit
  is the host owner's.
- memory_limit_mib: RLIMIT_AS of CPU workers (device "cpu"): an allocation past it
  fails in the worker (a crash, like an out-of-memory kill, not a planned leave).
  CUDA workers get no limit: the driver maps far more address space than memory,
  so any RLIMIT_AS breaks CUDA's initialisation; the daemon logs that it is not
  enforced there.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
from dataclasses import dataclass
from typing import Any, Callable

IONICE_CLASSES = ("none", "best-effort", "idle")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ELTCTL_CPU_THREADS")

# ioprio_set(2) / ioprio_get(2): include/uapi/linux/ioprio.h
IOPRIO_WHO_PROCESS = 1
IOPRIO_CLASS_SHIFT = 13
IOPRIO_CLASS = {"best-effort": 2, "idle": 3}
BEST_EFFORT_LOWEST = 7
# (ioprio_set, ioprio_get) per architecture (arch/*/syscall tables; aarch64 and riscv use the generic table).
_SYSCALLS = {"x86_64": (251, 252), "i386": (289, 290), "i686": (289, 290), "aarch64": (30, 31),
             "riscv64": (30, 31), "ppc64le": (273, 274), "s390x": (282, 283)}


@dataclass(frozen=True)
class Courtesy:
    nice: int = 0
    ionice: str = "none"
    cpu_threads: int | None = None
    memory_limit_mib: int | None = None

    @classmethod
    def from_json(cls, d: Any, source: str = "daemon.json") -> "Courtesy":
        """daemon.json's "courtesy" (None: no courtesy); ValueError names the bad key."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"{source}: 'courtesy' must be an object")

        def integer(key: str, lo: int, hi: int | None = None) -> int | None:
            value = d.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
                raise ValueError(f"{source}: courtesy.{key} must be an integer from {lo}"
                                 f"{f' to {hi}' if hi is not None else ''}, not {value!r}")
            return value

        ionice = d.get("ionice") or "none"
        if ionice not in IONICE_CLASSES:
            raise ValueError(f"{source}: courtesy.ionice must be one of {', '.join(IONICE_CLASSES)}, not {ionice!r}")
        return cls(nice=integer("nice", 0, 19) or 0, ionice=ionice, cpu_threads=integer("cpu_threads", 1),
                   memory_limit_mib=integer("memory_limit_mib", 1))


def thread_env(c: Courtesy) -> dict[str, str]:
    """The environment that limits a worker's CPU threads (empty: no limit)."""
    return {} if c.cpu_threads is None else {v: str(c.cpu_threads) for v in THREAD_VARS}


def ioprio_value(ionice: str) -> int | None:
    """The ioprio word for a class (None for "none")."""
    cls = IOPRIO_CLASS.get(ionice)
    if cls is None:
        return None
    return (cls << IOPRIO_CLASS_SHIFT) | (BEST_EFFORT_LOWEST if ionice == "best-effort" else 0)


def _syscall() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None


def ioprio_get(pid: int) -> int | None:
    """A process's ioprio word (class << 13 | level), or None where it cannot be read."""
    numbers, call = _SYSCALLS.get(platform.machine()), _syscall()
    if numbers is None or call is None:
        return None
    value = call(numbers[1], IOPRIO_WHO_PROCESS, pid)
    return None if value < 0 else value


def memory_limit_bytes(c: Courtesy, device: str) -> int | None:
    """RLIMIT_AS for a worker on `device`: CPU workers only (see the module docstring)."""
    if c.memory_limit_mib is None or device != "cpu":
        return None
    return c.memory_limit_mib * 2**20


def preexec(c: Courtesy, device: str) -> Callable[[], None] | None:
    """What runs in the worker between fork and exec (None: nothing to do).

    Everything it needs is resolved here, in the daemon, so the child only makes
    system calls (no imports, no allocation worth speaking of: the daemon has a
    thread), and nothing it does can fail the start: a nice level at or below the
    daemon's own is left alone (lowering it needs privileges), the memory limit is
    capped at the daemon's hard limit, and a refused call leaves that setting as the
    daemon's (see `describe`)."""
    nice = c.nice if c.nice > os.getpriority(os.PRIO_PROCESS, 0) else 0
    limit = memory_limit_bytes(c, device)
    if limit is not None:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    word = ioprio_value(c.ionice)
    numbers, call = _SYSCALLS.get(platform.machine()), _syscall()
    set_ioprio = None if word is None or numbers is None or call is None else numbers[0]
    if not nice and limit is None and set_ioprio is None:
        return None

    def apply() -> None:
        if nice:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, nice)
            except OSError:
                pass
        if set_ioprio is not None:
            call(set_ioprio, IOPRIO_WHO_PROCESS, 0, word)  # returns -1 when refused: nothing raised
        if limit is not None:
            try:
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            except (OSError, ValueError):
                pass

    return apply


def describe(c: Courtesy, device: str) -> str:
    """One line for the daemon's log: what its workers run with, and what is not applied."""
    parts = [f"nice {c.nice}", f"I/O class {c.ionice}"]
    if c.cpu_threads is not None:
        parts.append(f"{c.cpu_threads} CPU threads")
    notes = []
    if ioprio_value(c.ionice) is not None and (_SYSCALLS.get(platform.machine()) is None or _syscall() is None):
        notes.append(f"the I/O class is not set: no ioprio_set syscall known on {platform.machine()}")
    if c.memory_limit_mib is not None:
        if memory_limit_bytes(c, device) is None:
            notes.append(f"memory_limit ({c.memory_limit_mib} MiB) is not enforced on CUDA workers "
                         "(an address-space limit breaks the driver)")
        else:
            parts.append(f"at most {c.memory_limit_mib} MiB of address space")
    return ", ".join(parts) + "".join(f"; {n}" for n in notes)


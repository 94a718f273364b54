"""The host daemon's GPU watch: what `nvidia-smi` says runs on this host's GPUs,
and which of those processes are not this job's.

Two parts:

* pure functions, tested by tables: `parse_gpu_query` / `parse_app_query` read
  the answers to the watch's two queries (`--query-gpu=index,uuid,memory.used,
  memory.total,utilization.gpu` and `--query-compute-apps=gpu_uuid,pid,
  used_memory,process_name`) with the runtime's one nvidia-smi parser
  (nvsmi.py, which the controller's probe uses too), `descendants` closes a
  set of pids over a parent map, `classify_pid` says whether a GPU process is
  ours, foreign or invisible to us, `intruders` lists the foreign
  processes on GPUs our workers use, and `gpu_states` says each GPU's state
  (busy, ours, taken, free) for the state document;
* `SmiPoller`, a non-blocking runner of the two queries under a timeout, polled
  from the daemon's loop (no thread): a hung driver never blocks the daemon.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping

from .. import nvsmi
from ..nvsmi import GpuApp, GpuInfo

# What the watch asks (no GPU name: the daemon has no use for it).
GPU_FIELDS = ("index", "uuid", "memory.used", "memory.total", "utilization.gpu")
APP_FIELDS = nvsmi.APP_FIELDS
NOT_FOUND_STATUS = 127  # a shell's (and the simulator's) "command not found"


class Ownership(str, Enum):
    OURS = "ours"  # one of our workers, a descendant, or it carries ELTCTL_JOB=<job>
    FOREIGN = "foreign"  # visible here and not ours: somebody else uses the GPU
    INVISIBLE = "invisible"  # not in our /proc (another pid namespace): cannot tell
    TAKEN = "taken"  # another eltctl job's (its ELTCTL_JOB, or its user holds that GPU's claim): never an owner


@dataclass(frozen=True)
class Intruder:
    """A foreign process on a GPU that one of our slots uses (or is about to)."""

    gpu: int
    pid: int
    name: str


class WatchHealth(str, Enum):
    """What the last watch round learnt.

    OK: both queries answered. NONE: no nvidia-smi (a CPU-only host: nothing to
    watch). FAILED: it answered with an error. HUNG: it did not answer within the
    timeout and was killed. FAILED and HUNG make the host unhealthy in the
    daemon's state; the workers keep running."""

    OK = "ok"
    NONE = "none"
    FAILED = "failed"
    HUNG = "hung"


@dataclass(frozen=True)
class WatchResult:
    health: WatchHealth
    gpus: tuple[GpuInfo, ...] = ()
    apps: tuple[GpuApp, ...] = ()
    reason: str = ""
    duration_s: float = 0.0


# ---------------------------------------------------------------------------- parsing


def parse_gpu_query(text: str) -> tuple[GpuInfo, ...]:
    """The answer to the watch's GPU query (nvsmi.py reads it)."""
    return nvsmi.parse_gpus(text, GPU_FIELDS)


def parse_app_query(text: str) -> tuple[GpuApp, ...]:
    """The answer to the watch's compute-process query (nvsmi.py reads it)."""
    return nvsmi.parse_apps(text, APP_FIELDS)


# ---------------------------------------------------------------------------- decisions


def descendants(roots: Iterable[int], parent_of: Mapping[int, int]) -> frozenset[int]:
    """The roots and every process below them, given pid -> parent pid."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, ()))
    return frozenset(seen)


def classify_pid(pid: int, ours: frozenset[int], visible: bool, job_of_process: str | None, job: str, *,
                 claimed_by_its_user: bool = False) -> Ownership:
    """Whether a GPU process is this job's.

    `ours`: our worker pids and their descendants. `job_of_process`: the
    ELTCTL_JOB in its environment (None when unreadable: another user's process).
    A pid we cannot see at all is INVISIBLE, not FOREIGN: inside a container the
    driver reports host pids, and yielding on those would evict our own workers.
    Another eltctl job's process is TAKEN, never FOREIGN (no yield, no owner
    cooldown): its environment names that job, or, unreadable, its user holds
    the claim of its GPU for another job (`claimed_by_its_user`, runtime/claims.py)."""
    if pid in ours:
        return Ownership.OURS
    if not visible:
        return Ownership.INVISIBLE
    if job_of_process == job:
        return Ownership.OURS
    if job_of_process or (job_of_process is None and claimed_by_its_user):
        return Ownership.TAKEN
    return Ownership.FOREIGN


def intruders(gpus: Iterable[GpuInfo], apps: Iterable[GpuApp], watched: Iterable[int],
              ownership: Mapping[int, Ownership]) -> tuple[Intruder, ...]:
    """Foreign processes on the watched GPU indices (those our slots use).
    An app whose GPU uuid is unknown, or whose pid is missing from `ownership`,
    is ignored: only a process known to be foreign makes a worker leave."""
    by_uuid = {g.uuid: g.index for g in gpus}
    watched = set(watched)
    out = []
    for app in apps:
        index = by_uuid.get(app.gpu_uuid)
        if index is None or index not in watched:
            continue
        if ownership.get(app.pid) is Ownership.FOREIGN:
            out.append(Intruder(gpu=index, pid=app.pid, name=app.name))
    return tuple(sorted(set(out), key=lambda i: (i.gpu, i.pid)))


def gpu_states(gpus: Iterable[GpuInfo], apps: Iterable[GpuApp], ownership: Mapping[int, Ownership],
               ours: Mapping[int, str], claimed: Mapping[int, str],
               other_job: Mapping[int, str]) -> dict[int, tuple[str, str]]:
    """Each GPU's state for the daemon's state document, by index, with its reason:
    `busy` (a foreign process on it), `ours` (`ours`: index -> our worker's id there),
    `taken` (another eltctl job's: its claim, `claimed`: index -> the claim described,
    or its processes, `other_job`: pid -> the job their environment names), else `free`."""
    gpus = tuple(gpus)
    by_uuid = {g.uuid: g.index for g in gpus}
    foreign_on: dict[int, list[int]] = {}
    taken_on: dict[int, list[int]] = {}
    for app in apps:
        if ownership.get(app.pid) is Ownership.FOREIGN and app.gpu_uuid in by_uuid:
            foreign_on.setdefault(by_uuid[app.gpu_uuid], []).append(app.pid)
        elif ownership.get(app.pid) is Ownership.TAKEN and app.gpu_uuid in by_uuid:
            taken_on.setdefault(by_uuid[app.gpu_uuid], []).append(app.pid)
    states: dict[int, tuple[str, str]] = {}
    for g in gpus:
        if g.index in foreign_on:
            states[g.index] = ("busy", "used by pid " + ", ".join(map(str, sorted(foreign_on[g.index]))))
        elif g.index in ours:
            states[g.index] = ("ours", f"worker {ours[g.index]}")
        elif g.index in claimed:
            states[g.index] = ("taken", f"taken by {claimed[g.index]}")
        elif g.index in taken_on:
            pids = taken_on[g.index]
            jobs = sorted({other_job[p] for p in pids if p in other_job})
            who = f"job {', '.join(jobs)}" if jobs else "another eltctl job"
            states[g.index] = ("taken", f"taken by {who} (pid {', '.join(map(str, sorted(pids)))})")
        else:
            states[g.index] = ("free", "")
    return states


# ---------------------------------------------------------------------------- the runner


class SmiPoller:
    """Runs both queries every `interval` seconds, each under `timeout`.

    `poll(now)` never blocks: it starts a round when one is due and returns its
    WatchResult once both processes have answered (or the timeout killed them).
    `binary` is what to run (found on PATH by the caller); None: no watch."""

    def __init__(self, binary: str | None, interval: float, timeout: float, env: Mapping[str, str]) -> None:
        self._binary = binary
        self._interval = interval
        self._timeout = timeout
        self._env = dict(env)
        self._procs: list[subprocess.Popen] = []
        self._started = 0.0
        self._next = 0.0

    @property
    def enabled(self) -> bool:
        return self._binary is not None

    def poll(self, now: float) -> WatchResult | None:
        if self._binary is None:
            return None
        if not self._procs:
            if now < self._next:
                return None
            self._start(now)
            if not self._procs:
                self._binary = None  # vanished: from now on a CPU-only host
                return WatchResult(WatchHealth.NONE, reason="nvidia-smi is no longer installed")
            return None
        if all(p.poll() is not None for p in self._procs):
            return self._collect(now)
        if now - self._started >= self._timeout:
            self._kill()
            self._next = now + self._interval
            return WatchResult(WatchHealth.HUNG, reason=f"nvidia-smi did not answer within {self._timeout:g} s",
                               duration_s=now - self._started)
        return None

    def close(self) -> None:
        self._kill()

    def _start(self, now: float) -> None:
        self._started = now
        try:
            for args in (nvsmi.query_gpus(GPU_FIELDS), nvsmi.query_apps(APP_FIELDS)):
                # Own session: a hung nvidia-smi (and anything it started) is killed as a group.
                self._procs.append(subprocess.Popen(
                    [self._binary, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, env=self._env, start_new_session=True))
        except FileNotFoundError:
            self._kill()

    def _collect(self, now: float) -> WatchResult:
        outs = []
        for p in self._procs:
            out, _ = p.communicate()  # already exited: the small output is in the pipe
            outs.append((p.returncode, out.decode(errors="replace")))
        self._procs = []
        self._next = self._started + self._interval
        took = now - self._started
        (gpu_rc, gpu_out), (app_rc, app_out) = outs
        if NOT_FOUND_STATUS in (gpu_rc, app_rc):
            self._binary = None
            return WatchResult(WatchHealth.NONE, reason="nvidia-smi is not installed", duration_s=took)
        if gpu_rc != 0 or app_rc != 0:
            text = (gpu_out if gpu_rc != 0 else app_out).strip().splitlines()
            return WatchResult(WatchHealth.FAILED, duration_s=took,
                               reason=f"nvidia-smi failed (status {gpu_rc if gpu_rc else app_rc}): "
                                      f"{text[0] if text else 'no output'}")
        return WatchResult(WatchHealth.OK, gpus=parse_gpu_query(gpu_out), apps=parse_app_query(app_out),
                           duration_s=took)

    def _kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout is not None:
                p.stdout.close()
        self._procs = []

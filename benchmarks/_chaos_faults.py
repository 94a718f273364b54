"""The faults of benchmarks/chaos.py, and what watches the job while they happen.

Each fault is a function `inject(ctx) -> Injected | None` (None: nothing to inject it on
now, e.g. no worker alive): it does the damage at once and returns how long to hold it
and the `recover` callable that undoes it (a no-op for a kill: eltctl itself must bring
back what was killed). Only processes this benchmark started are touched: the test bed's
hosts and everything running there, the controller `eltctl up` started, its store keeper.

`StepWatch` tails the runtime's audit file (ELTCTL_AUDIT: every worker appends a line per
committed step) and notes when each line arrived, so training progress is seen from the
workers themselves, not through the controller (which is one of the things killed).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Every fault kind, in the order they are printed. KEEPER_KILL breaks the job until the
# controller restarts a dead store keeper (issue 14: "the keeper supervised").
WORKER_KILL, WORKER_HANG = "worker_kill", "worker_hang"
DAEMON_KILL, DAEMON_HANG = "daemon_kill", "daemon_hang"
HOST_CRASH, KEEPER_KILL, CONTROLLER_KILL = "host_crash", "keeper_kill", "controller_kill"
GPU_OWNER, MIRROR_AWAY, DISK_FULL = "gpu_owner", "mirror_away", "disk_full"
KINDS = (WORKER_KILL, WORKER_HANG, DAEMON_KILL, DAEMON_HANG, HOST_CRASH, KEEPER_KILL, CONTROLLER_KILL,
         GPU_OWNER, MIRROR_AWAY, DISK_FULL)
# The faults whose leaves are planned ones (the daemon asks the worker to leave at a step
# boundary): no committed step may be redone because of them.
PLANNED = frozenset({GPU_OWNER})

DISK_SIZE = "16m"  # the tmpfs that stands in for a host's checkpoint disk


# --------------------------------------------------------------------------- watching steps


class StepWatch(threading.Thread):
    """Tails the audit file every `interval` s. `commits`: (monotonic time, step) of every
    audit line as it was seen; `gen_first_seen`: generation -> when its first line came;
    `redone`: (newest generation, step) each time a step is recorded by one more generation
    (soak.py's "lost" steps: committed, then done again)."""

    def __init__(self, audit: Path, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.audit, self.interval = audit, interval
        self.commits: list[tuple[float, int]] = []
        self.gen_first_seen: dict[int, float] = {}
        self.redone: list[tuple[int, int]] = []
        self._times: list[float] = []
        self._gens_of: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def run(self) -> None:
        pos, tail = 0, b""
        while not self._halt.is_set():
            try:
                with open(self.audit, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
            except OSError:
                chunk = b""
            if chunk:
                pos += len(chunk)
                now = time.monotonic()
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
                with self._lock:
                    for line in lines:
                        self._take(line, now)
            self._halt.wait(self.interval)

    def _take(self, line: bytes, now: float) -> None:
        try:
            r = json.loads(line)
            step, gen = int(r["step"]), int(r["generation"])
        except (ValueError, KeyError, TypeError):
            return
        self.commits.append((now, step))
        self._times.append(now)
        self.gen_first_seen.setdefault(gen, now)
        gens = self._gens_of.setdefault(step, set())
        if gens and gen not in gens:  # (a late line of an older generation counts too, by the newest)
            self.redone.append((max(max(gens), gen), step))
        gens.add(gen)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(10)

    def last(self) -> tuple[float, int] | None:
        with self._lock:
            return self.commits[-1] if self.commits else None

    def first_after(self, t: float) -> float | None:
        """When the first audit line after monotonic time `t` was seen (None: none yet)."""
        with self._lock:
            i = bisect.bisect_right(self._times, t)
            return self._times[i] if i < len(self._times) else None

    def times(self, t0: float, t1: float) -> list[float]:
        with self._lock:
            lo, hi = bisect.bisect_right(self._times, t0), bisect.bisect_right(self._times, t1)
            return sorted(set(self._times[lo:hi]))

    def max_step(self) -> int:
        with self._lock:
            return max((s for _, s in self.commits), default=0)


def longest_stall(commit_times: list[float], t0: float, t1: float) -> float:
    """The longest stretch of [t0, t1] without a commit (commit_times sorted, within it)."""
    edges = [t0, *commit_times]
    gaps = [b - a for a, b in zip(edges, edges[1:])]
    gaps.append(t1 - edges[-1])
    return max(gaps)


# --------------------------------------------------------------------------- faults


@dataclass
class Injected:
    kind: str
    where: str
    detail: str
    hold_s: float = 0.0
    recover: Callable[[], str] = lambda: ""  # returns a note ("" when nothing to say)


@dataclass
class Context:
    """What a fault may touch. `eltctl(*args)` runs the CLI on the job's inventory."""

    bed: object
    job: str
    state_dir: Path
    mirror: Path
    root: Path
    rng: object
    eltctl: Callable[..., subprocess.CompletedProcess]
    stopped: dict[int, int | None] = field(default_factory=dict)  # pid -> starttime of what we SIGSTOPped
    mounts: dict[str, Path] = field(default_factory=dict)  # host -> its checkpoint dir, a tmpfs of ours
    owners: dict[int, str] = field(default_factory=dict)  # pid of a foreign GPU process -> host
    crashed: set[str] = field(default_factory=set)

    def host_dir(self, host: str) -> Path:
        from eltctl.hosts.layout import job_dir_in

        return job_dir_in(self.bed.host(host).home, self.job, host)

    def controller_doc(self) -> dict:
        try:
            return json.loads((self.state_dir / "controller.json").read_text())
        except (OSError, ValueError):
            return {}


def _workers(ctx: Context) -> list[tuple[str, int, str, int]]:
    """(worker id, pid, host, slot) of the job's live workers on hosts that are up."""
    from tests.testbed.jobenv import proc_env, worker_pids

    out = []
    for wid, pid in sorted(worker_pids(ctx.job).items()):
        host, slot = wid.split("/")[0], wid.split("/")[1]
        if host not in ctx.crashed and pid not in ctx.stopped and proc_env(pid).get("ELTCTL_JOB") == ctx.job:
            out.append((wid, pid, host, int(slot)))
    return out


def _daemons(ctx: Context) -> list[tuple[str, int]]:
    """(host, pid) of the job's live daemons (their pid files, checked against /proc)."""
    from tests.testbed.jobenv import proc_env

    out = []
    for h in ctx.bed.hosts:
        if h.name in ctx.crashed:
            continue
        try:
            pid = int((ctx.host_dir(h.name) / "daemon.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        env = proc_env(pid)
        if env.get("ELTCTL_JOB") == ctx.job and pid not in ctx.stopped:
            out.append((h.name, pid))
    return out


def _kill(pid: int, sig: int) -> bool:
    """Signal a live process (False: gone, or a zombie nobody reaped yet: the keeper is the
    controller's child)."""
    from tests.testbed.procs import is_alive

    if not is_alive(pid):
        return False
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _stop_for(ctx: Context, kind: str, where: str, pid: int, what: str, hold: float) -> Injected | None:
    from tests.testbed.procs import process_starttime

    start = process_starttime(pid)
    if start is None or not _kill(pid, signal.SIGSTOP):
        return None
    ctx.stopped[pid] = start

    def recover() -> str:
        return cont(ctx, pid)

    return Injected(kind, where, f"SIGSTOP {what} pid {pid} for {hold:.0f} s", hold, recover)


def cont(ctx: Context, pid: int) -> str:
    """SIGCONT a process we stopped, if it is still the same process."""
    from tests.testbed.procs import process_starttime

    start = ctx.stopped.pop(pid, None)
    if start is not None and process_starttime(pid) == start:
        _kill(pid, signal.SIGCONT)
        return ""
    return f"pid {pid} was gone before SIGCONT"


def worker_kill(ctx: Context) -> Injected | None:
    ws = _workers(ctx)
    if not ws:
        return None
    wid, pid, host, _ = ctx.rng.choice(ws)
    _kill(pid, signal.SIGKILL)
    return Injected(WORKER_KILL, host, f"SIGKILL worker {wid} (pid {pid})")


def worker_hang(ctx: Context) -> Injected | None:
    ws = _workers(ctx)
    if not ws:
        return None
    wid, pid, host, _ = ctx.rng.choice(ws)
    return _stop_for(ctx, WORKER_HANG, host, pid, f"worker {wid}", ctx.rng.uniform(3, 15))


def daemon_kill(ctx: Context) -> Injected | None:
    ds = _daemons(ctx)
    if not ds:
        return None
    host, pid = ctx.rng.choice(ds)
    _kill(pid, signal.SIGKILL)
    return Injected(DAEMON_KILL, host, f"SIGKILL daemon pid {pid}")


def daemon_hang(ctx: Context) -> Injected | None:
    ds = _daemons(ctx)
    if not ds:
        return None
    host, pid = ctx.rng.choice(ds)
    return _stop_for(ctx, DAEMON_HANG, host, pid, "daemon", ctx.rng.uniform(5, 25))


def host_crash(ctx: Context) -> Injected | None:
    up = [h for h in ctx.bed.hosts if h.name not in ctx.crashed]
    if len(up) < 2:  # keep one host up: the job must keep min_workers slots
        return None
    host = ctx.rng.choice(up)
    for pid in [p for p in ctx.stopped if p in set(host.pids())]:
        ctx.stopped.pop(pid, None)  # killed with the host
    host.crash()
    ctx.crashed.add(host.name)
    hold = ctx.rng.uniform(10, 40)

    def recover() -> str:
        host.restore()
        ctx.crashed.discard(host.name)
        return ""

    return Injected(HOST_CRASH, host.name, f"host crash (every process, sshd down) for {hold:.0f} s", hold, recover)


def keeper_kill(ctx: Context) -> Injected | None:
    pid = (ctx.controller_doc().get("store") or {}).get("pid")
    if not pid or not _kill(int(pid), signal.SIGKILL):
        return None
    return Injected(KEEPER_KILL, "control", f"SIGKILL store keeper pid {pid}")


def controller_kill(ctx: Context) -> Injected | None:
    pid = ctx.controller_doc().get("pid")
    if not pid or not _kill(int(pid), signal.SIGKILL):
        return None
    hold = ctx.rng.uniform(2, 15)

    def recover() -> str:
        r = ctx.eltctl("up", "--unattended", timeout=420)  # what the crontab entry runs
        if r.returncode != 0:
            return f"`eltctl up --unattended` exited {r.returncode}: {(r.stderr or r.stdout)[-300:].strip()}"
        return ""

    return Injected(CONTROLLER_KILL, "control", f"SIGKILL controller pid {pid}; `up --unattended` after "
                    f"{hold:.0f} s", hold, recover)


def gpu_owner(ctx: Context) -> Injected | None:
    ws = _workers(ctx)
    if not ws:
        return None
    wid, _, host, slot = ctx.rng.choice(ws)  # the GPU of a worker: its owner comes back
    pid = ctx.bed.host(host).start_foreign_process(slot, memory_mib=4000, utilization=80)
    ctx.owners[pid] = host
    hold = ctx.rng.uniform(10, 40)

    def recover() -> str:
        if ctx.owners.pop(pid, None) is not None:
            ctx.bed.host(host).stop_foreign_process(pid)
        return ""

    return Injected(GPU_OWNER, host, f"a process of user eltsim on GPU {slot} (worker {wid}) for {hold:.0f} s",
                    hold, recover)


def mirror_away(ctx: Context) -> Injected | None:
    """The mirror's file system gone: the directory moved away and a plain file in its place,
    so every write under it fails (ENOTDIR) until it comes back."""
    if not ctx.mirror.is_dir():
        return None
    away = ctx.mirror.with_name(ctx.mirror.name + ".away")
    os.rename(ctx.mirror, away)
    ctx.mirror.write_text("the mirror is away (benchmarks/chaos.py)\n")
    hold = ctx.rng.uniform(10, 40)

    def recover() -> str:
        return mirror_back(ctx)

    return Injected(MIRROR_AWAY, "mirror", f"mirror directory away for {hold:.0f} s", hold, recover)


def mirror_back(ctx: Context) -> str:
    away = ctx.mirror.with_name(ctx.mirror.name + ".away")
    if not away.exists():
        return ""
    note = ""
    if ctx.mirror.is_dir() and not ctx.mirror.is_symlink():  # something made a new one meanwhile
        note = f"a new {ctx.mirror} appeared while it was away; replaced by the old one"
        shutil.rmtree(ctx.mirror, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            ctx.mirror.unlink()
    os.rename(away, ctx.mirror)
    return note


def disk_full(ctx: Context) -> Injected | None:
    """One host's checkpoint directory on a small tmpfs of its own, filled up: every write
    there fails with ENOSPC until the filler goes. The host of rank 0 (the writer of
    checkpoints) is taken when known. The tmpfs stays mounted (holding what was written to
    it) until the end of the run."""
    st = _status(ctx)
    members = st.get("members") or []
    hosts = [h.name for h in ctx.bed.hosts if h.name not in ctx.crashed]
    rank0 = members[0].split("/")[0] if members else None
    host = rank0 if rank0 in hosts else (ctx.rng.choice(hosts) if hosts else None)
    if host is None:
        return None
    ck = ctx.host_dir(host) / "checkpoints"
    if not ck.is_dir():
        return None
    if host not in ctx.mounts:
        stage = ctx.root / "disks" / host
        stage.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE},mode=0700", "tmpfs", str(stage)],
                       check=True, capture_output=True, timeout=30)
        subprocess.run(["cp", "-a", f"{ck}/.", str(stage)], check=False, capture_output=True, timeout=60)
        subprocess.run(["mount", "--move", str(stage), str(ck)], check=True, capture_output=True, timeout=30)
        ctx.mounts[host] = ck
    filler = ck / ".chaos-filler"
    logs = _log_sizes(ctx.host_dir(host) / "workers")
    _fill(filler)
    hold = ctx.rng.uniform(10, 40)

    def recover() -> str:
        with contextlib.suppress(OSError):
            filler.unlink()
        failed = _count_new(ctx.host_dir(host) / "workers", logs, (b"No space left", b"Errno 28"))
        return f"{failed} log line(s) of {host}'s workers name the full disk"

    who = "rank 0's host" if host == rank0 else "rank 0 unknown"
    return Injected(DISK_FULL, host, f"checkpoint disk full ({who}; a {DISK_SIZE} tmpfs, filled) for {hold:.0f} s",
                    hold, recover)


def _log_sizes(directory: Path) -> dict[Path, int]:
    return {f: f.stat().st_size for f in directory.glob("*.log")}


def _count_new(directory: Path, before: dict[Path, int], needles: tuple[bytes, ...]) -> int:
    """Lines written to the logs in `directory` since `before` that hold one of `needles`."""
    n = 0
    for f in directory.glob("*.log"):
        try:
            with open(f, "rb") as fh:
                fh.seek(before.get(f, 0))
                n += sum(1 for line in fh.read().splitlines() if any(x in line for x in needles))
        except OSError:
            pass
    return n


def _fill(path: Path) -> None:
    block = b"\0" * (1 << 16)
    with open(path, "ab") as f:
        while True:
            try:
                f.write(block)
                f.flush()
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
    # What a full block left unwritten: fill the last bytes one by one.
    with open(path, "ab", buffering=0) as f:
        for _ in range(1 << 16):
            try:
                f.write(b"\0")
            except OSError:
                break


def unmount_all(ctx: Context) -> list[str]:
    problems = []
    for host, ck in list(ctx.mounts.items()):
        r = subprocess.run(["umount", str(ck)], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            r = subprocess.run(["umount", "-l", str(ck)], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            problems.append(f"{host}: umount {ck}: {r.stderr.strip()}")
        ctx.mounts.pop(host, None)
    return problems


def _status(ctx: Context) -> dict:
    try:
        return json.loads((ctx.state_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


FAULTS: dict[str, Callable[[Context], Injected | None]] = {
    WORKER_KILL: worker_kill, WORKER_HANG: worker_hang, DAEMON_KILL: daemon_kill, DAEMON_HANG: daemon_hang,
    HOST_CRASH: host_crash, KEEPER_KILL: keeper_kill, CONTROLLER_KILL: controller_kill, GPU_OWNER: gpu_owner,
    MIRROR_AWAY: mirror_away, DISK_FULL: disk_full,
}


def undo_everything(ctx: Context) -> None:
    """Whatever is still injected when the run ends (or fails): continue, restore, put back."""
    for pid in list(ctx.stopped):
        cont(ctx, pid)
    for name in list(ctx.crashed):
        with contextlib.suppress(Exception):
            ctx.bed.host(name).restore()
        ctx.crashed.discard(name)
    for pid, host in list(ctx.owners.items()):
        with contextlib.suppress(Exception):
            ctx.bed.host(host).stop_foreign_process(pid)
        ctx.owners.pop(pid, None)
    with contextlib.suppress(OSError):
        mirror_back(ctx)
    for ck in ctx.mounts.values():
        with contextlib.suppress(OSError):
            (ck / ".chaos-filler").unlink()


# --------------------------------------------------------------------------- after `down`


def leftovers(ctx: Context, job_pids: Callable[[str], list[int]], extra_pids: dict[str, int],
              wait_s: float = 15.0) -> list[str]:
    """What still runs after `down`: processes of the job (ELTCTL_JOB), processes started
    on a simulated host over SSH, connections' sshd processes below each host's listener,
    and the controller and keeper pids named in `extra_pids` ({what: pid}). Waits up to
    `wait_s` for SSH sessions that are closing."""
    from tests.testbed import procs as bedprocs

    deadline = time.monotonic() + wait_s
    while True:
        found = [f"job process pid {p}" for p in job_pids(ctx.job)]
        for h in ctx.bed.hosts:
            found += [f"{h.name}: pid {p} started over SSH" for p in bedprocs.host_pids(str(h.state_path))]
            if h.sshd_pid is not None:
                found += [f"{h.name}: sshd connection pid {p}" for p in bedprocs.descendants(h.sshd_pid)
                          if bedprocs.is_alive(p)]
        found += [f"{what} pid {pid}" for what, pid in extra_pids.items() if pid and bedprocs.is_alive(pid)]
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)

"""The reference side of the resize benchmark: a torchrun c10d elastic job and plain DDP.

`measure_torchrun` runs a real torchrun elastic job on this machine (one torchrun
agent per simulated node, all on loopback), training the example model with DDP
and a checkpoint every 20 steps the usual torchrun way, and puts it through
membership events: a planned leave (SIGTERM to one agent), a warm join (a new
agent) and a crash (SIGKILL of one worker). For each event it reports

- pause_s: from the last step completed by the old worker generation to the
  first step completed by the new one (torchrun restarts every worker on any
  change, so "old size" and "new size" are worker generations);
- steps_lost: steps completed before the event and done again after it;
- lost_s: the training time the event cost (`time_lost`: the pause less one steady
  step at the new size, rank 0's median there, plus one such step per step redone);
- the world sizes before and after, and when the new generation started.

`measure_ddp_step_time` runs plain DDP (gloo) at a fixed size on the same model
and global batch and reports the steady-state step time.

Both start real processes, bound every wait, and end every process they started
(agents and workers: torchrun puts each worker in its own session, so killing an
agent's process group does not reach it). Figures are rough on a shared machine.

The workers (benchmarks/baselines/ddp_worker.py) append one JSON line per step:
{"t", "step", "world", "rank", "pid", "restart"}; the analysis below reads those.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "baselines" / "ddp_worker.py"


class Event(str, Enum):
    """A membership event applied to the running torchrun job."""

    LEAVE = "leave"  # SIGTERM to one agent: torchrun's graceful way to take a node out
    JOIN = "join"  # start one more agent
    KILL = "kill"  # SIGKILL one worker process (a crash)


@dataclass(frozen=True)
class StepRecord:
    t: float
    step: int
    world: int
    rank: int
    pid: int
    restart: int = 0

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        d = json.loads(line)
        return cls(float(d["t"]), int(d["step"]), int(d["world"]), int(d["rank"]), int(d["pid"]), int(d.get("restart", 0)))


# ---------------------------------------------------------------------------
# Pure analysis (no I/O): figures from step records


def event_figures(records: Sequence[StepRecord], t_event: float, old_pids: Iterable[int]) -> dict[str, Any]:
    """Pause and steps lost for one event, from the step records around it.

    `old_pids` are the worker processes that were training when the event was
    applied at `t_event`; every other process that logs a step after `t_event`
    belongs to the new generation.
    """
    old_pids = set(old_pids)
    old = [r for r in records if r.pid in old_pids]
    new = [r for r in records if r.pid not in old_pids and r.t >= t_event]
    out: dict[str, Any] = {"resumed": bool(new)}
    if old:
        last_old = max(old, key=lambda r: r.t)
        out |= {
            "old_world": last_old.world,
            "last_old_step": max(r.step for r in old),
            "old_kept_stepping_s": round(max(0.0, last_old.t - t_event), 3),
        }
    if not new:
        return out
    first_new = min(new, key=lambda r: r.t)
    new_steps = sorted({r.step for r in new if r.world == first_new.world})
    out |= {
        "new_world": first_new.world,
        "first_new_step": new_steps[0],
        "event_to_first_new_step_s": round(first_new.t - t_event, 3),
    }
    if old:
        last_old_t = max(r.t for r in old)
        out["pause_s"] = round(first_new.t - last_old_t, 3)
        # The new generation restarts at first_new_step and redoes everything up to
        # the old generation's last step (it may not have got that far yet).
        out["steps_lost"] = max(0, out["last_old_step"] - new_steps[0] + 1)
    return out


def step_time_stats(records: Sequence[StepRecord], *, rank: int = 0, skip_steps: int = 0) -> dict[str, Any]:
    """Steady-state step time of one rank: intervals between consecutive completed steps.

    Intervals are taken within one process only (a restart is not a step), and
    the first `skip_steps` steps of each process are warm-up and discarded.
    """
    by_pid: dict[int, list[StepRecord]] = {}
    for r in records:
        if r.rank == rank:
            by_pid.setdefault(r.pid, []).append(r)
    dts: list[float] = []
    for recs in by_pid.values():
        recs.sort(key=lambda r: r.step)
        first = recs[0].step
        for a, b in zip(recs, recs[1:]):
            if b.step == a.step + 1 and a.step - first >= skip_steps:
                dts.append(b.t - a.t)
    if not dts:
        return {"steps_measured": 0}
    dts.sort()
    mean = statistics.fmean(dts)
    return {
        "steps_measured": len(dts),
        "mean_step_s": round(mean, 5),
        "median_step_s": round(statistics.median(dts), 5),
        "p90_step_s": round(dts[min(len(dts) - 1, int(0.9 * len(dts)))], 5),
        "steps_per_s": round(1.0 / mean, 2) if mean > 0 else None,
    }


def step_s_by_world(steps: Iterable[tuple[Any, int, int, float]], *, skip: int = 1) -> dict[int, float]:
    """The median step interval at each world size, from `(run, step, world, t)` tuples.

    A run is one worker generation (or one process): intervals are taken between
    consecutive steps of one run only, and each run's first `skip` intervals are left
    out (a new generation's first steps are its warm-up, part of the pause). Where
    several tuples give one run's step (one per worker), the earliest counts, as the
    pauses count a step done when its first worker logs it."""
    first: dict[tuple[Any, int], tuple[float, int]] = {}
    for run, step, world, t in steps:
        key = (run, step)
        if key not in first or t < first[key][0]:
            first[key] = (t, world)
    by_run: dict[Any, list[tuple[int, float, int]]] = {}
    for (run, step), (t, world) in first.items():
        by_run.setdefault(run, []).append((step, t, world))
    dts: dict[int, list[float]] = {}
    for recs in by_run.values():
        recs.sort()
        pairs = [(a, b) for a, b in zip(recs, recs[1:]) if b[0] == a[0] + 1 and a[2] == b[2]]
        for a, b in pairs[skip:]:
            dts.setdefault(b[2], []).append(b[1] - a[1])
    return {w: round(statistics.median(v), 4) for w, v in sorted(dts.items())}


def time_lost(pause_s: float | None, steps_redone: int | None, step_s: float | None) -> float | None:
    """What an event cost the job in training time: from the last step at the old size
    until the new size has done the step after it, less one step at the new size (the
    step that would have taken that long anyway). That is the pause (the gap between the
    last step at the old size and the first at the new), less the first step's own time,
    plus each step redone: pause + (redone - 1) x step. None where a figure is missing."""
    if pause_s is None or step_s is None or steps_redone is None:
        return None
    return round(pause_s + (steps_redone - 1) * step_s, 4)


# ---------------------------------------------------------------------------
# Processes and logs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


class StepLog:
    """Reads the workers' per-process JSONL files incrementally (complete lines only)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.records: list[StepRecord] = []
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[StepRecord]:
        fresh: list[StepRecord] = []
        if not self.directory.exists():
            return fresh
        for p in sorted(self.directory.glob("worker-*.jsonl")):
            off = self._offsets.get(p, 0)
            with open(p, "rb") as f:
                f.seek(off)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            if end == 0:
                continue
            self._offsets[p] = off + end
            for line in chunk[:end].decode().splitlines():
                if line.strip():
                    fresh.append(StepRecord.from_json(line))
        self.records.extend(fresh)
        return fresh

    def pids_since(self, t: float) -> set[int]:
        return {r.pid for r in self.records if r.t >= t}


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class _Job:
    """The processes of one torchrun job: agents (own sessions) and the workers they spawned."""

    workdir: Path
    port: int
    run_id: str
    nnodes: str
    ckpt_every: int
    threads: int
    share_tcp_store: bool
    rdzv_conf: str
    agents: list[subprocess.Popen] = field(default_factory=list)
    worker_pids: set[int] = field(default_factory=set)
    _logs: list[Any] = field(default_factory=list)

    def start_agent(self) -> subprocess.Popen:
        i = len(self.agents)
        env = dict(os.environ, PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
        # torch 2.13's default shares the rendezvous TCPStore with the workers and
        # keeps it across rounds, so a restarted generation reads the previous
        # generation's gloo addresses (no per-round prefix): after a leave the new
        # workers fail "connectFullMesh ... Connection refused" and then hang. The
        # documented opt-out gives every round a fresh store (pytorch#135712, closed,
        # still seen with 2.13: a join was never admitted with the default).
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        if not self.share_tcp_store:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.run_id}",
            "--max-restarts=100", "--local-addr=127.0.0.1",
        ]
        if self.rdzv_conf:
            cmd.append(f"--rdzv-conf={self.rdzv_conf}")
        cmd += [
            str(WORKER), "--mode", "elastic",
            "--log-dir", str(self.workdir / "steps"), "--ckpt-dir", str(self.workdir / "ckpt"),
            "--ckpt-every", str(self.ckpt_every), "--threads", str(self.threads),
        ]
        log = open(self.workdir / f"agent-{i}.log", "wb")
        self._logs.append(log)
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        self.agents.append(p)
        return p

    def live_agents(self) -> list[subprocess.Popen]:
        return [a for a in self.agents if a.poll() is None]

    def scan_workers(self) -> dict[int, int]:
        """Current workers: {worker pid: agent index}; remembers every pid seen for cleanup."""
        out = {}
        for i, a in enumerate(self.agents):
            if a.poll() is None:
                for c in _children(a.pid):
                    if str(WORKER) in _cmdline(c):
                        out[c] = i
        self.worker_pids |= set(out)
        return out

    def stop(self) -> None:
        """End every agent and worker this job started, gracefully first."""
        self.scan_workers()
        for a in self.live_agents():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for a in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.wait(max(0.1, deadline - time.monotonic()))
        for a in self.agents:
            if a.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(a.pid, signal.SIGKILL)
                a.wait()
        # Workers live in their own sessions; only kill pids still running our worker script.
        marker = str(self.workdir)
        for pid in self.worker_pids:
            if marker in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for log in self._logs:
            log.close()


def _wait_generation(job: _Job, steps: StepLog, *, since: float, exclude: set[int], world: int | None,
                     min_steps: int, cap_s: float) -> bool:
    """Wait until a worker generation started after `since` (pids not in `exclude`) has done
    `min_steps` distinct steps at world size `world` (any world if None); False at the cap."""
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline:
        steps.poll()
        job.scan_workers()
        gen = [r for r in steps.records if r.t >= since and r.pid not in exclude and (world is None or r.world == world)]
        if len({r.step for r in gen}) >= min_steps:
            return True
        if not job.live_agents():
            return False
        time.sleep(0.2)
    return False


def _wait_phase(steps: StepLog, phase: int, period: int, *, cap_s: float) -> bool:
    """Wait until the newest completed step is `phase` steps past a multiple of `period`."""
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline:
        fresh = steps.poll()
        if fresh and max(fresh, key=lambda r: r.t).step % period == phase:
            return True
        time.sleep(0.005)
    return False


def measure_torchrun(
    events: Sequence[str] = ("leave", "join", "kill"),
    *,
    nodes: int = 3,
    min_nodes: int = 1,
    max_nodes: int = 3,
    ckpt_every: int = 20,
    event_cap_s: float = 120.0,
    settle_steps: int = 30,
    steady_steps: int = 100,
    resumed_steps: int = 5,
    event_phase: int | None = 10,
    threads: int = 1,
    share_tcp_store: bool = False,
    rdzv_conf: str = "",
    workdir: Path | None = None,
    keep_workdir: bool = False,
) -> dict[str, Any]:
    """Run a torchrun c10d elastic job through `events` and measure each one (see module docstring).

    The job starts with `nodes` agents and trains `steady_steps` steps (the
    steady-state figures) before the first event; later events wait for
    `settle_steps` steps of the new generation. Each event fires right after a
    step whose number is `event_phase` past a checkpoint (10 of 20: the mean
    position of an event at a random time), so that steps lost compare across
    runs; None fires at whatever step it is. Each wait is capped at `event_cap_s`.
    """
    evs = [Event(e) for e in events]
    own_dir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="eltctl-torchrun-")) if own_dir else Path(workdir)
    (wd / "ckpt").mkdir(parents=True, exist_ok=True)
    job = _Job(wd, free_port(), f"bench-{uuid.uuid4().hex[:8]}", f"{min_nodes}:{max_nodes}",
               ckpt_every, threads, share_tcp_store, rdzv_conf)
    steps = StepLog(wd / "steps")
    result: dict[str, Any] = {
        "system": "torchrun c10d elastic",
        "settings": {
            "nnodes": job.nnodes, "start_nodes": nodes, "nproc_per_node": 1, "ckpt_every": ckpt_every,
            "threads_per_worker": threads, "share_rdzv_tcp_store": share_tcp_store,
            "rdzv_conf": rdzv_conf or "defaults", "event_cap_s": event_cap_s, "global_batch": 64,
        },
        "events": [],
    }
    try:
        t0 = time.time()
        job.start_agent()
        deadline = time.monotonic() + 60
        while not _port_open(job.port) and time.monotonic() < deadline:
            time.sleep(0.1)  # agent 0 hosts the rendezvous store; the others need it up
        for _ in range(nodes - 1):
            job.start_agent()
        if not _wait_generation(job, steps, since=t0, exclude=set(), world=nodes, min_steps=steady_steps,
                                cap_s=event_cap_s + 60):
            result["error"] = f"the job did not reach {nodes} nodes and {steady_steps} steps within {event_cap_s + 60:.0f} s"
            return result
        result["startup_s"] = round(min(r.t for r in steps.records) - t0, 3)
        world = nodes
        first_event_t: float | None = None
        prev: tuple[float, set[int]] | None = None
        for ev in evs:
            if prev is not None:  # let the current generation settle before the next event
                _wait_generation(job, steps, since=prev[0], exclude=prev[1], world=world,
                                 min_steps=settle_steps, cap_s=event_cap_s)
            if event_phase is not None:
                _wait_phase(steps, event_phase, ckpt_every, cap_s=30.0)
            steps.poll()
            t_event = time.time()
            first_event_t = first_event_t or t_event
            # Every worker that logged since the previous event (or the start) is of the old
            # generation: a window of the last second missed ranks whose step took longer
            # (world 4 of the 50 M-parameter model on 2 cores: about 1.2 s), and their next
            # step of the same generation read as the first of a new one.
            old_pids = steps.pids_since(prev[0] if prev is not None else t0)
            workers = job.scan_workers()
            host = job.agents[0]  # hosts the rendezvous store: never the one to go
            fig: dict[str, Any] = {"event": ev.value}
            if ev is Event.LEAVE:
                victims = [a for a in job.live_agents() if a is not host]
                if not victims:
                    fig["error"] = "no agent to take out besides the rendezvous host"
                    result["events"].append(fig)
                    continue
                victims[-1].send_signal(signal.SIGTERM)
                expect = max(min_nodes, world - 1)
            elif ev is Event.JOIN:
                job.start_agent()
                expect = min(max_nodes, world + 1)
            else:
                candidates = sorted(workers, key=lambda pid: workers[pid])
                if not candidates:
                    fig["error"] = "no worker process found to kill"
                    result["events"].append(fig)
                    continue
                os.kill(candidates[-1], signal.SIGKILL)
                expect = world
            ok = _wait_generation(job, steps, since=t_event, exclude=old_pids, world=expect,
                                  min_steps=resumed_steps, cap_s=event_cap_s)
            prev = (t_event, old_pids) if ok else None
            steps.poll()
            fig |= event_figures(steps.records, t_event, old_pids)
            fig["expected_new_world"] = expect
            if not ok:
                fig["error"] = (f"not admitted within {event_cap_s:.0f} s" if ev is Event.JOIN
                                else f"no generation of {expect} workers within {event_cap_s:.0f} s")
            if fig.get("new_world"):
                world = fig["new_world"]
            result["events"].append(fig)
            if not ok and not job.live_agents():
                break
        # Steady state of the torchrun job before the first event, including its checkpoints.
        steps.poll()
        cut = first_event_t if first_event_t is not None else time.time()
        pre = [r for r in steps.records if r.t < cut and r.world == nodes]
        result["steady_state_at_start"] = step_time_stats(pre, skip_steps=10) | {"world": nodes, "includes_checkpoints": True}
        # Rank 0's process is one generation (torchrun restarts every worker on a change).
        by_world = step_s_by_world((r.pid, r.step, r.world, r.t) for r in steps.records if r.rank == 0)
        result["step_s_by_world"] = by_world
        for fig in result["events"]:
            fig["step_at_new_world_s"] = by_world.get(fig.get("new_world"))
            fig["lost_s"] = time_lost(fig.get("pause_s"), fig.get("steps_lost"), fig["step_at_new_world_s"])
        return result
    finally:
        job.stop()
        result["workdir"] = str(wd) if keep_workdir or not own_dir else None
        if own_dir and not keep_workdir:
            shutil.rmtree(wd, ignore_errors=True)


def measure_ddp_step_time(
    world_size: int = 2,
    steps: int = 300,
    warmup: int = 30,
    *,
    threads: int = 1,
    timeout_s: float = 300.0,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Plain DDP (gloo, loopback) at a fixed size: steady-state step time of rank 0 after `warmup` steps.
    `extra_args` go to the worker (e.g. "--loader-workers", "4", "--io-ms", "1")."""
    wd = Path(tempfile.mkdtemp(prefix="eltctl-ddp-"))
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs: list[Any] = []
    try:
        for rank in range(world_size):
            logs.append(open(wd / f"rank-{rank}.log", "wb"))
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--mode", "fixed", "--log-dir", str(wd / "steps"),
                 "--max-steps", str(steps), "--threads", str(threads), *extra_args],
                stdin=subprocess.DEVNULL, stdout=logs[-1], stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            ))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        log = StepLog(wd / "steps")
        log.poll()
        out: dict[str, Any] = {
            "system": "plain DDP (gloo)",
            "world": world_size, "steps": steps, "warmup_discarded": warmup,
            "threads_per_worker": threads, "global_batch": 64,
        }
        if failed:
            out["error"] = f"ranks {failed} exited non-zero: " + (wd / f"rank-{failed[0]}.log").read_text()[-800:]
        return out | step_time_stats(log.records, skip_steps=warmup)
    except subprocess.TimeoutExpired:
        return {"system": "plain DDP (gloo)", "world": world_size, "error": f"did not finish {steps} steps in {timeout_s:.0f} s"}
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs:
            f.close()
        shutil.rmtree(wd, ignore_errors=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", default="leave,join,kill")
    ap.add_argument("--cap", type=float, default=120.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--share-tcp-store", action="store_true", help="torch's default (see _Job.start_agent)")
    ap.add_argument("--rdzv-conf", default="", help="e.g. last_call_timeout=1 (torchrun's default is 30 s)")
    ap.add_argument("--skip-torchrun", action="store_true")
    ap.add_argument("--skip-ddp", action="store_true")
    ap.add_argument("--ddp-world", type=int, default=2)
    ap.add_argument("--ddp-steps", type=int, default=300)
    ap.add_argument("--keep", action="store_true", help="keep the torchrun work directory (logs)")
    a = ap.parse_args()
    if not a.skip_ddp:
        print(json.dumps({"ddp": measure_ddp_step_time(a.ddp_world, a.ddp_steps, threads=a.threads)}, indent=1), flush=True)
    if not a.skip_torchrun:
        evs = [e for e in a.events.split(",") if e]
        print(json.dumps({"torchrun": measure_torchrun(evs, event_cap_s=a.cap, threads=a.threads,
                                                       share_tcp_store=a.share_tcp_store, rdzv_conf=a.rdzv_conf,
                                                       keep_workdir=a.keep)},
                         indent=1), flush=True)

"""The restart-mode side of the resize benchmark: torchrun's own script under eltctl.

`measure_restart` hosts a job store here and starts one restart-mode supervisor
(`python -m eltctl_runtime.restart`) per simulated node, each running the very
script the torchrun baseline runs (benchmarks/baselines/ddp_worker.py in its
elastic mode: DDP, rank 0 saves a checkpoint every 20 steps, a restarted worker
loads the newest one; it knows nothing of eltctl), with its checkpoint directory
given as `{checkpoint_dir}`. The events are the torchrun side's: a planned leave
(SIGTERM to one supervisor, as the host daemon sends it), a join (one more
supervisor) and a crash (SIGKILL of one worker process, the script). Each event
fires 10 steps past a checkpoint, as on the torchrun side, and the figures are
the same (`_baselines.event_figures`: pause from the last step of the old
worker processes to the first step of the new ones, steps lost).

The script does not save on SIGTERM (torchrun users' scripts often do not), so
a planned leave goes back to its last checkpoint here as it does under torchrun;
examples/ddp_restart.py, which saves on SIGTERM, loses nothing (tests/runtime/
test_restart_mode.py).

Each event fires at least `min_gap_s` (10 s) after the previous one's first new
step: a supervisor starts its next warm interpreter (torch imported ahead, see
runtime/warmstart.py) 3 s after a restart, and it takes a few seconds to be
ready; events a few seconds apart would measure a cold start (membership
changes on a lab's machines are minutes apart).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

from _baselines import WORKER, StepLog, _wait_phase, event_figures


class _Supervisors:
    """A store and restart-mode supervisors (own sessions), with a death reporter."""

    def __init__(self, wd: Path, threads: int, ckpt_every: int, min_workers: int, stop_grace: float) -> None:
        import torch.distributed as dist

        import eltctl_runtime as elt

        self.elt = elt
        self.wd = wd
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        self.job = f"bench-restart-{uuid.uuid4().hex[:8]}"
        self.threads, self.ckpt_every, self.min_workers, self.stop_grace = threads, ckpt_every, min_workers, stop_grace
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._logs: list[Any] = []
        self._reported: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def start(self) -> subprocess.Popen:
        i = len(self.procs)
        wid = f"node{i}/0/{os.getpid()}"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads), ELTCTL_JOB=self.job,
                   ELTCTL_STORE=f"127.0.0.1:{self.store.port}", ELTCTL_WORKER_ID=wid, ELTCTL_DEVICE="cpu",
                   ELTCTL_CHECKPOINT_DIR=str(self.wd / "eltctl-ckpt"), ELTCTL_MIN_WORKERS=str(self.min_workers))
        cmd = [sys.executable, "-m", "eltctl_runtime.restart", "--stop-grace", f"{self.stop_grace:g}",
               "--script-dir", str(self.wd / f"script-{i}"), "--",
               sys.executable, str(WORKER), "--mode", "elastic", "--log-dir", str(self.wd / "steps"),
               "--ckpt-dir", "{checkpoint_dir}", "--ckpt-every", str(self.ckpt_every), "--threads", str(self.threads)]
        log = open(self.wd / f"supervisor-{i}.log", "wb")
        self._logs.append(log)
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append((wid, p))
        return p

    def live(self) -> list[subprocess.Popen]:
        return [p for _w, p in self.procs if p.poll() is None]

    def _watch(self) -> None:  # the host daemon's part: a supervisor that died is reported dead
        while not self._stop.is_set():
            for wid, p in self.procs:
                if p.poll() not in (None, 0) and wid not in self._reported:
                    self._reported.add(wid)
                    self.elt.report_dead(self.store, self.job, wid)
            self._stop.wait(0.05)

    def scripts(self) -> list[int]:
        """The processes under live supervisors, at any depth (a script is forked by the
        supervisor's warm interpreter, its fork server: a grandchild), any of whose
        threads started them; the caller keeps those that log steps."""
        out, todo = [], [p.pid for p in self.live()]
        while todo:
            pid = todo.pop()
            for children in Path(f"/proc/{pid}/task").glob("*/children"):
                try:
                    kids = [int(x) for x in children.read_text().split()]
                except OSError:
                    continue
                out += kids
                todo += kids
        return out

    def close(self) -> None:
        self._stop.set()
        for p in self.live():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the scripts die with their supervisor (PDEATHSIG)
        for _w, p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        for f in self._logs:
            f.close()


def _wait_new(sup: _Supervisors, steps: StepLog, *, since: float, exclude: set[int], world: int, min_steps: int,
              cap_s: float) -> bool:
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline:
        steps.poll()
        got = {r.step for r in steps.records if r.t >= since and r.pid not in exclude and r.world == world}
        if len(got) >= min_steps:
            return True
        if not sup.live():
            return False
        time.sleep(0.1)
    return False


def measure_restart(
    events: Sequence[str] = ("leave", "join", "kill"),
    *,
    nodes: int = 3,
    ckpt_every: int = 20,
    event_cap_s: float = 120.0,
    settle_steps: int = 30,
    start_steps: int = 60,
    resumed_steps: int = 5,
    threads: int = 1,
    stop_grace: float = 30.0,
    min_gap_s: float = 10.0,
    keep_workdir: bool = False,
) -> dict[str, Any]:
    """Run the baseline script under restart mode through `events` (see the module docstring)."""
    wd = Path(tempfile.mkdtemp(prefix="eltctl-restart-"))
    sup = _Supervisors(wd, threads, ckpt_every, min_workers=nodes, stop_grace=stop_grace)
    steps = StepLog(wd / "steps")
    result: dict[str, Any] = {"system": "eltctl restart mode",
                              "settings": {"nodes": nodes, "ckpt_every": ckpt_every, "stop_grace_s": stop_grace,
                                           "threads_per_worker": threads, "min_gap_s": min_gap_s},
                              "events": []}
    try:
        t0 = time.time()
        for _ in range(nodes):
            sup.start()
        if not _wait_new(sup, steps, since=t0, exclude=set(), world=nodes, min_steps=start_steps,
                         cap_s=event_cap_s + 60):
            result["error"] = f"the job did not reach {nodes} workers and {start_steps} steps"
            return result
        world = nodes
        prev: tuple[float, set[int]] | None = None
        for ev in events:
            if prev is not None:
                _wait_new(sup, steps, since=prev[0], exclude=prev[1], world=world, min_steps=settle_steps,
                          cap_s=event_cap_s)
            if prev is not None:  # the warm interpreters of the new generation are ready by then
                firsts = [r.t for r in steps.records if r.t >= prev[0] and r.pid not in prev[1]]
                if firsts:
                    time.sleep(max(0.0, min(firsts) + min_gap_s - time.time()))
            else:
                time.sleep(min_gap_s)
            _wait_phase(steps, 10, ckpt_every, cap_s=30.0)
            steps.poll()
            t_event = time.time()
            old_pids = steps.pids_since(t_event - 1.0)
            fig: dict[str, Any] = {"event": ev}
            if ev == "leave":
                sup.live()[-1].send_signal(signal.SIGTERM)
                expect = world - 1
            elif ev == "join":
                sup.start()
                expect = world + 1
            else:
                # A supervisor's children are its script and, ahead of the next restart, an idle
                # warm interpreter: kill a process that is training (it logs steps).
                scripts = [pid for pid in sup.scripts() if pid in old_pids]
                if not scripts:
                    fig["error"] = "no script process found to kill"
                    result["events"].append(fig)
                    continue
                os.kill(scripts[-1], signal.SIGKILL)
                expect = world
            ok = _wait_new(sup, steps, since=t_event, exclude=old_pids, world=expect, min_steps=resumed_steps,
                           cap_s=event_cap_s)
            prev = (t_event, old_pids) if ok else None
            steps.poll()
            fig |= event_figures(steps.records, t_event, old_pids)
            fig["expected_new_world"] = expect
            if not ok:
                fig["error"] = f"no generation of {expect} workers within {event_cap_s:.0f} s"
            if fig.get("new_world"):
                world = fig["new_world"]
            result["events"].append(fig)
        result["runtime_events"] = [e for e in sup.elt.read_events(sup.store, sup.job) if e.get("mode") == "restart"]
        return result
    finally:
        sup.close()
        result["workdir"] = str(wd) if keep_workdir else None
        if not keep_workdir:
            shutil.rmtree(wd, ignore_errors=True)


if __name__ == "__main__":
    import json

    print(json.dumps(measure_restart(keep_workdir="--keep" in sys.argv), indent=1))

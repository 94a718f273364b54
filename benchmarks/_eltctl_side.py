"""The eltctl side of the resize benchmark: pauses of eltctl's runtime.

`measure_eltctl` hosts a job store here, starts `examples/train.py` workers with
the runtime's environment contract (3 workers, the ~3 M parameter toy model,
global batch 64, SGD, one thread each: the same work as the torchrun/DDP
baseline in _baselines.py), and applies a planned leave (a leave request
through the store), a warm join (a new worker; it registers only once it is
imported and built) and a crash (SIGKILL of a worker, reported dead by this
launcher as the host daemon would). For each event:

- pause_s: from the last step completed at the old size to the first step
  completed at the new size (over every worker's per-step log);
- runtime_pause_s: the same interval as the runtime itself measures it (rank 0,
  in its membership event);
- steps_lost: steps committed at the old size and committed again at the new one;
- lost_s: the training time the event cost: pause_s less one steady step at the new
  size (`step_at_new_world_s`, the median over the run's generations at that size,
  each generation's first interval left out), plus one such step per step redone
  (_baselines.time_lost);
- phases: per worker, what its log said of the change: the pause's phases
  (ElasticJob's "pause phases" line at the new generation's first commit) and,
  sharded, each move of the shards ("sharded: hand_over / reshard" lines).

`measure_eltctl_step_time` runs a fixed-size job and reports the steady-state
step time of rank 0 (compare with `measure_ddp_step_time`). Figures are rough
on a shared machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

from _baselines import step_s_by_world, time_lost  # beside this file (its importers put it on sys.path)

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"


_RANK_LINE = re.compile(r": rank (\d+) of \d+ in generation (\d+) ")


def catching_up(lines: Sequence[str]) -> bool:
    """A worker's log says it is catching up in the background (a synchronous joiner
    that takes the state while the job trains on, train/catchup.py): its last "catching
    up at step" line has no "caught up at step" after it. A tree without that catch-up
    never logs either line."""
    began = max((n for n, line in enumerate(lines) if ": catching up at step " in line), default=-1)
    return began >= 0 and not any(": caught up at step " in line for line in lines[began:])


def rank_in(lines: Sequence[str]) -> tuple[int, int] | None:
    """(generation, rank) of the last "rank R of N in generation G" line of a worker's log."""
    for line in reversed(lines):
        m = _RANK_LINE.search(line)
        if m:
            return int(m.group(2)), int(m.group(1))
    return None


class _Launcher:
    """A store, worker processes (own sessions) and a death reporter."""

    def __init__(self, workdir: Path, worker_args: list[str], min_workers: int, threads: int,
                 store: str = "c10d") -> None:
        """`store`: "c10d" (a TCPStore here, unsigned: this benchmark's historical setup) or
        "socket" (as under eltctl's controller: the keeper's Unix-socket store, every value
        signed with a secret in a run, the process groups' rendezvous signed)."""
        import torch.distributed as dist

        import eltctl_runtime as elt

        self.elt = elt
        self.wd = workdir
        self.job = f"bench-{uuid.uuid4().hex[:8]}"
        self.kind = store
        self._env: dict[str, str] = {}
        if store == "c10d":
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=60))
            self.spec = f"127.0.0.1:{self.store.port}"
            self.js = elt.protocol.scope(self.store, self.job)
        elif store in ("socket", "c10d-signed"):
            from eltctl_runtime.store import auth, client as storeclient
            from eltctl_runtime import protocol
            if store == "socket":  # served by a process of its own, as the store keeper is
                sock = workdir / "state" / "store.sock"
                self._server = _serve_in_a_process(sock)
                self.spec = f"unix:{sock}"
            else:  # the previous production setup: a c10d TCPStore, every value signed
                self._tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                          timeout=timedelta(seconds=60))
                self.spec = f"127.0.0.1:{self._tcp.port}"
            secret, run = auth.new_secret(), uuid.uuid4().hex
            auth.write_secret(workdir / "secret", secret)
            (workdir / "run").write_text(run + "\n")
            os.chmod(workdir / "run", 0o600)
            self.store = storeclient.connect(self.spec, 60)
            self.js = auth.signed(protocol.scope(self.store, self.job), protocol.job_prefix(self.job), secret,
                                  run=run)
            self._env = {auth.ENV_SECRET_FILE: str(workdir / "secret"), auth.ENV_RUN_FILE: str(workdir / "run")}
        else:
            raise ValueError(f"store must be c10d, c10d-signed or socket, not {store!r}")
        self.args = worker_args
        self.min_workers = min_workers
        self.threads = threads
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self._reported: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def start(self, extra: Sequence[str] = (), env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen, Path]:
        """Start one more worker; `extra` arguments and `env` variables for it alone."""
        i = len(self.procs)
        wid = f"bench{i}/cpu/{os.getpid()}"
        progress = self.wd / f"w{i}.progress"
        env = dict(os.environ, **self._env, ELTCTL_STORE=self.spec, ELTCTL_JOB=self.job,
                   ELTCTL_WORKER_ID=wid, ELTCTL_DEVICE="cpu", ELTCTL_MIN_WORKERS=str(self.min_workers),
                   OMP_NUM_THREADS=str(self.threads), **(env or {}))
        log = (self.wd / f"w{i}.log").open("w")
        p = subprocess.Popen([sys.executable, str(TRAIN), *self.args, *extra, "--progress", str(progress)], env=env,
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=REPO)
        self.procs.append((wid, p, progress))
        return self.procs[-1]

    def _watch(self) -> None:
        while not self._stop.is_set():
            for wid, p, _ in list(self.procs):
                if p.poll() not in (None, 0) and wid not in self._reported:
                    self._reported.add(wid)
                    self.elt.protocol.put_dead(self.js, wid)
            self._stop.wait(0.02)

    def records(self) -> list[tuple[float, int, int, int]]:
        """(time, step, generation, world_size) of every committed step of every worker."""
        out = []
        for _, _, path in self.procs:
            try:
                for line in path.read_text().splitlines():
                    step, gen, world, t, _loss = line.split()
                    out.append((float(t), int(step), int(gen), int(world)))
            except FileNotFoundError:
                pass
        return out

    def log_lines(self) -> dict[int, int]:
        """How many lines each worker's log has now (where an event's lines start)."""
        return {i: len(self._log(i)) for i in range(len(self.procs))}

    def phases_since(self, marks: dict[int, int]) -> dict[str, list]:
        """Per worker: the pause-phase and shard-move lines its log wrote after `marks`."""
        out: dict[str, list] = {}
        for i in range(len(self.procs)):
            lines = self._log(i)[marks.get(i, 0):]
            got = []
            for line in lines:
                for tag, key in ((" pause phases ", "pause"), ("sharded: hand_over ", "hand_over"),
                                 ("sharded: reshard ", "reshard")):
                    if tag in line:
                        try:
                            got.append({key: json.loads(line[line.index("{"):])})
                        except ValueError:
                            pass
            if got:
                out[f"w{i}"] = got
        return out

    def members_at(self) -> set[int]:
        """The newest committed step of each live worker that has committed one (a joiner
        not admitted yet has none): one step when they all stand at the same boundary."""
        steps = set()
        for _, p, path in self.procs:
            if p.poll() is not None:
                continue
            try:
                lines = path.read_text().splitlines()
            except FileNotFoundError:
                continue
            if lines:
                steps.add(int(lines[-1].split()[0]))
        return steps

    def _log(self, i: int) -> list[str]:
        try:
            return (self.wd / f"w{i}.log").read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []

    def settled(self) -> bool:
        """No live worker is catching up in the background (`catching_up`): the join
        it came in with is over."""
        return not any(catching_up(self._log(i)) for i, (_, p, _) in enumerate(self.procs) if p.poll() is None)

    def by_rank(self) -> list[tuple[str, subprocess.Popen, Path]]:
        """The live workers in the order of their ranks in the newest generation any of
        them logged (`rank_in`); a worker with no such line last."""
        ranked = []
        for i, w in enumerate(self.procs):
            if w[1].poll() is None:
                gen, rank = rank_in(self._log(i)) or (-1, 1 << 30)
                ranked.append((-gen, rank, i, w))
        return [w for *_key, w in sorted(ranked, key=lambda x: x[:3])]

    def latest(self) -> tuple[int, int, int]:
        recs = self.records()
        if not recs:
            return (0, -1, 0)
        t, step, gen, world = max(recs, key=lambda r: (r[1], r[0]))
        return step, gen, world

    def wait(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.05)
        raise TimeoutError(f"eltctl benchmark: timed out waiting for {what}")

    def close(self) -> None:
        self._stop.set()
        if self.kind == "socket":
            self._thread.join(5)
        for _, p, _ in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.kind == "socket":
            self._server.terminate()
            self._server.wait(10)


_SERVE = """
import signal, sys, threading
from eltctl_runtime.store.server import StoreServer
srv = StoreServer()
srv.listen_unix(sys.argv[1])
srv.start()
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
stop.wait()
srv.stop()
"""


def _serve_in_a_process(sock: Path) -> subprocess.Popen:
    """eltctl_runtime.store.server's server on `sock`, in a child process (as the keeper serves
    it: not sharing this launcher's GIL); returned once it answers."""
    from eltctl_runtime.store.server import answers

    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(sock)], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not answers(str(sock), 1.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the store server for the benchmark did not start at {sock}")
        time.sleep(0.05)
    return proc


def _event_figures(records, old_gen: int) -> dict[str, Any]:
    old = [r for r in records if r[2] == old_gen]
    new = [r for r in records if r[2] > old_gen]
    if not old or not new:
        return {"resumed": bool(new)}
    last_old = max(old)
    first_new = min(new)
    last_old_step = max(r[1] for r in old)
    new_steps = {r[1] for r in new}
    return {
        "resumed": True,
        "old_world": last_old[3],
        "new_world": first_new[3],
        "last_old_step": last_old_step,
        "first_new_step": min(new_steps),
        "pause_s": round(first_new[0] - last_old[0], 4),
        "steps_lost": sum(1 for s in new_steps if s <= last_old_step),
    }


def measure_eltctl(
    events: Sequence[str] = ("leave", "join", "kill"),
    *,
    nodes: int = 3,
    settle_steps: int = 30,
    resumed_steps: int = 5,
    threads: int = 1,
    event_cap_s: float = 120.0,
    worker_args: Sequence[str] = ("--batch", "64", "--optimizer", "sgd", "--lr", "0.01", "--steps", "1000000"),
    workdir: Path | None = None,
    store: str = "c10d",
    env: dict[str, str] | None = None,
    event_phase: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Run an eltctl job through `events` ("leave", "join", "kill") and measure each one
    (`store`: _Launcher's; `env`: extra variables for every worker, e.g. ELTCTL_CHECKPOINT_DIR; `event_phase` (every, phase): each event fires once the
    latest committed step is `phase` past a multiple of `every`, as _baselines' events do
    past a checkpoint, so the steps redone compare). Each event fires once the job has
    settled (no joiner still catching up in the background: `catching_up`), and a leave
    or a SIGKILL hits the middle member by rank (`rank_in`), the same one on every run."""
    wd = Path(workdir or tempfile.mkdtemp(prefix="eltctl-bench-"))
    wd.mkdir(parents=True, exist_ok=True)
    la = _Launcher(wd, [*worker_args, "--threads", str(threads)], min_workers=nodes, threads=threads, store=store)
    out: dict[str, Any] = {"system": "eltctl", "store": store, "nodes": nodes, "events": []}
    try:
        for _ in range(nodes):
            la.start(env=env)
        la.wait(lambda: la.latest()[0] >= settle_steps, event_cap_s, f"{settle_steps} steps")
        for ev in events:
            # From a settled job: a synchronous joiner of the last event that still takes its
            # state in the background (train/catchup.py) is part of that join, not of this event.
            la.wait(la.settled, event_cap_s, "the last joiner to catch up")
            if event_phase:
                # Once EVERY member has committed that step: when the first commit fired it, a
                # replicated job's others were still in their optimizer step (0.14-0.34 s at world
                # 4 here), which then fell outside the measured pause, while a sharded step ends
                # in a collective (all commit together): the same event hit another phase of the step.
                every, phase = event_phase

                def at_phase() -> bool:
                    steps = la.members_at()
                    return len(steps) == 1 and next(iter(steps)) % every == phase

                la.wait(at_phase, event_cap_s, f"every member at a step {phase} past a multiple of {every}")
            step0, gen0, world0 = la.latest()
            # The victim by rank, the middle one (never rank 0 of 2 or 3, which writes the
            # checkpoints): by start order, whether the leaver was the rank writing a checkpoint
            # in the background decided a leave's pause by a factor of two here.
            members = la.by_rank()
            marks = la.log_lines()
            t_event = time.time()
            if ev == "leave":
                victim = members[len(members) // 2]
                la.elt.protocol.put_leave(la.js, victim[0])
            elif ev == "join":
                la.start(env=env)
            elif ev == "kill":
                victim = members[len(members) // 2]
                os.kill(victim[1].pid, signal.SIGKILL)
            else:
                raise ValueError(f"unknown event {ev!r}")
            la.wait(lambda: len({r[1] for r in la.records() if r[2] > gen0}) >= resumed_steps, event_cap_s,
                    f"the job to resume after {ev}")
            figs = _event_figures(la.records(), gen0) | {"event": ev, "applied_at_step": step0,
                                                          "event_to_first_new_step_s": None}
            runtime_events = [e for e in la.elt.protocol.get_events(la.js) if e["generation"] > gen0]
            if runtime_events:
                figs["runtime_pause_s"] = runtime_events[0].get("pause_s")
                figs["runtime_kind"] = runtime_events[0].get("kind")
                if "redone_steps" in runtime_events[0]:  # sharded: steps redone after lost shards, job total
                    figs["runtime_redone_steps"] = runtime_events[0]["redone_steps"]
            first_new = min((r[0] for r in la.records() if r[2] > gen0), default=None)
            figs["event_to_first_new_step_s"] = round(first_new - t_event, 4) if first_new else None
            figs["phases"] = la.phases_since(marks)
            out["events"].append(figs)
            time.sleep(0.5)
        by_world = step_s_by_world((g, s, w, t) for t, s, g, w in la.records())
        out["step_s_by_world"] = by_world
        for figs in out["events"]:
            figs["step_at_new_world_s"] = by_world.get(figs.get("new_world"))
            figs["lost_s"] = time_lost(figs.get("pause_s"), figs.get("steps_lost"), figs["step_at_new_world_s"])
        la.elt.protocol.put_stop(la.js)
        la.wait(lambda: all(p.poll() is not None for _, p, _ in la.procs), 60, "workers to stop")
    finally:
        la.close()
    return out


def base_env(base: Path | None) -> dict[str, str] | None:
    """The workers' environment that runs another revision's runtime: `base` is a checkout of
    it (e.g. `git worktree add /tmp/base <rev>`); its runtime/ is put first on PYTHONPATH as
    `eltctl_runtime` (an overlay of links, beside the checkout). The store, the launcher and
    examples/train.py stay this tree's: the store's protocol is the same on both sides."""
    if base is None:
        return None
    base = Path(base).resolve()
    if not (base / "runtime" / "__init__.py").is_file():
        raise SystemExit(f"--base {base}: not a checkout of eltctl (no runtime/__init__.py)")
    overlay = base.parent / f"{base.name}.overlay"
    overlay.mkdir(exist_ok=True)
    link = overlay / "eltctl_runtime"
    if not link.is_symlink():
        link.symlink_to(base / "runtime")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(overlay), os.environ.get("PYTHONPATH")) if p)}


def measure_eltctl_step_time(world_size: int = 2, steps: int = 300, warmup: int = 30, *, threads: int = 1,
                             timeout_s: float = 300.0, extra_args: Sequence[str] = (),
                             store: str = "c10d", env: dict[str, str] | None = None) -> dict[str, Any]:
    """A fixed-size eltctl job: steady-state step time of rank 0 after `warmup` steps.
    `extra_args` go to examples/train.py (e.g. "--bucket-mb", "0"); `env`: extra variables
    for every worker (e.g. a PYTHONPATH that puts another revision's runtime first)."""
    wd = Path(tempfile.mkdtemp(prefix="eltctl-steady-"))
    la = _Launcher(wd, ["--batch", "64", "--optimizer", "sgd", "--lr", "0.01", "--steps", str(steps),
                        "--threads", str(threads), *extra_args], min_workers=world_size, threads=threads,
                   store=store)
    try:
        for _ in range(world_size):
            la.start(env=env)
        la.wait(lambda: all(p.poll() is not None for _, p, _ in la.procs), timeout_s, f"{steps} steps")
        _, p0, path0 = la.procs[0]
        times = []
        for line in path0.read_text().splitlines():
            step, _gen, _world, t, _loss = line.split()
            times.append((int(step), float(t)))
        dts = sorted(b[1] - a[1] for a, b in zip(times, times[1:]) if a[0] >= warmup and b[0] == a[0] + 1)
        if not dts:
            return {"system": "eltctl", "store": store, "world": world_size, "steps_measured": 0}
        mean = statistics.fmean(dts)
        return {"system": "eltctl", "store": store, "world": world_size, "steps_measured": len(dts), "mean_step_s": round(mean, 5),
                "median_step_s": round(statistics.median(dts), 5),
                "p90_step_s": round(dts[min(len(dts) - 1, int(0.9 * len(dts)))], 5),
                "steps_per_s": round(1.0 / mean, 2)}
    finally:
        la.close()


if __name__ == "__main__":
    print(json.dumps({"events": measure_eltctl(), "steady": measure_eltctl_step_time()}, indent=2))

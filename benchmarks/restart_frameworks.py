"""The frameworks' restart pause under restart mode: HF Trainer and Lightning.

`python benchmarks/restart_frameworks.py [--framework hf|lightning] [--gap S] [--json]`

For each framework: a store here and two restart-mode supervisors (`python -m
eltctl_runtime.restart`) of examples/hf_trainer.py or
examples/lightning_train.py (run by the torch-only host interpreter, .venv-host,
as on a host; the script, with eltctl_runtime.integrations' callback, by
the frameworks' interpreter, .venv-host-frameworks; ELTCTL_BENCH_FRAMEWORKS_PYTHON
names another). Then:

- leave: SIGTERM to the second supervisor (what its host daemon sends on an
  owner yield); the job restarts at 1;
- join: a third supervisor starts; the job restarts at 2.

Printed per event: `pause_s`, from the last step line of the old scripts to the
first of the new ones (for the leave also `from_sigterm_s`, from the SIGTERM),
`stop_s`, from the supervisors' `stopping the script` to the last script's
exit (the SIGTERM save), and `redone`/`skipped` steps by the script's own step log (0 and 0: the
callback's SIGTERM save). Each event fires `--gap` seconds (default 10) after
the previous generation's first step, so the supervisors' warm interpreters
(torch imported ahead; the framework is not) are ready, as they would be for
changes minutes apart. No targets: figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.testbed.hostpython import HOST_PYTHON, runtime_path  # noqa: E402
FRAMEWORKS_PYTHON = (os.environ.get("ELTCTL_BENCH_FRAMEWORKS_PYTHON")
                     or str(ROOT / ".venv-host-frameworks" / "bin" / "python"))
SCRIPTS = {"hf": "hf_trainer.py", "lightning": "lightning_train.py"}
LOGTIME = re.compile(rb"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO supervisor \S+: (?:generation \d+ changes.*stopping"
                     rb"|the script exited \((-?\d+)\))", re.M)
STEP = re.compile(rb"^step (\d+) world (\d+) restart (\d+)", re.M)
RESUMED = re.compile(rb"^resumed at step (\d+) world (\d+) restart (\d+)", re.M)


class Lines:
    """Rank 0's step lines from the supervisors' logs, each with the time it was first seen."""

    def __init__(self, logs: list[Path]) -> None:
        self.logs = logs
        self.steps: list[tuple[float, int, int, int]] = []  # (seen, step, world, restart)
        self.resumed: dict[int, int] = {}
        self._seen: dict[Path, int] = {}

    def poll(self) -> None:
        now = time.time()
        for log in list(self.logs):
            try:
                data = log.read_bytes()
            except OSError:
                continue
            start = self._seen.get(log, 0)
            end = data.rfind(b"\n") + 1
            if end <= start:
                continue
            chunk = data[start:end]
            self._seen[log] = end
            self.steps += [(now, int(s), int(w), int(r)) for s, w, r in STEP.findall(chunk)]
            self.resumed.update({int(r): int(s) for s, _w, r in RESUMED.findall(chunk)})

    def wait(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            got = pred()
            if got:
                return got
            time.sleep(0.02)
        raise TimeoutError(what)

    def restart_of_world(self, world: int, after: int, n: int = 1):
        got = [r for _t, _s, w, r in self.steps if w == world and r > after]
        return max(got) if len(got) >= n else None


def _stop_s(logs: list[Path], since: float) -> float | None:
    """From the first supervisor's `stopping the script` after `since` to the last
    `the script exited` (143: it saved) that followed it: the SIGTERM save and exit."""
    from datetime import datetime

    per_log = []
    for log in logs:
        marks = [(datetime.strptime(stamp.decode(), "%Y-%m-%d %H:%M:%S,%f").timestamp(), bool(code))
                 for stamp, code in LOGTIME.findall(log.read_bytes())]
        per_log.append([m for m in marks if m[0] >= since - 0.5])
    stops = [t for marks in per_log for t, is_exit in marks if not is_exit]
    if not stops:
        return None
    first = min(stops)
    # Each supervisor's first exit after the change: the script it was running then.
    done = [min((t for t, is_exit in marks if is_exit and t >= first), default=None) for marks in per_log]
    done = [t for t in done if t is not None]
    return round(max(done) - first, 2) if done else None


def measure(framework: str, gap: float, stop_grace: float) -> dict:
    import torch.distributed as dist

    import eltctl_runtime as elt

    wd = Path(tempfile.mkdtemp(prefix=f"eltctl-fw-{framework}-"))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    job = f"bench-fw-{os.getpid()}"
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    lines = Lines(logs)

    def start() -> subprocess.Popen:
        i = len(procs)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", ELTCTL_JOB=job,
                   ELTCTL_STORE=f"127.0.0.1:{store.port}", ELTCTL_WORKER_ID=f"node{i}/0/{os.getpid()}",
                   ELTCTL_DEVICE="cpu", ELTCTL_CHECKPOINT_DIR=str(wd / "eltctl-ckpt"), ELTCTL_MIN_WORKERS="1",
                   PYTHONPATH=runtime_path())
        cmd = [HOST_PYTHON, "-m", "eltctl_runtime.restart", "--stop-grace", f"{stop_grace:g}", "--script-dir",
               str(wd / f"script-{i}"), "--", FRAMEWORKS_PYTHON, str(ROOT / "examples" / SCRIPTS[framework]),
               "--max-steps", "1000000", "--save-steps", "1000", "--step-sleep", "0.05"]
        log = wd / f"supervisor-{i}.log"
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=ROOT)
        procs.append(p)
        logs.append(log)
        return p

    def event(name: str, act, world: int, prev_restart: int) -> tuple[dict, int]:
        time.sleep(max(0.0, min(t for t, _s, w, r in lines.steps if r == prev_restart) + gap - time.time()))
        lines.poll()
        t_event = time.time()
        act()
        restart = lines.wait(lambda: lines.restart_of_world(world, prev_restart), 180, f"{name}: world {world}")
        old = [(t, s) for t, s, _w, r in lines.steps if r <= prev_restart]
        new = sorted((t, s) for t, s, _w, r in lines.steps if r == restart)
        last_t, last_s = max(old, key=lambda x: x[1])
        fig = {"event": name, "pause_s": round(new[0][0] - last_t, 2),
               "resumed_at": lines.resumed.get(restart), "last_step_before": last_s, "first_step_after": new[0][1],
               "redone": max(0, last_s - new[0][1] + 1), "skipped": max(0, new[0][1] - last_s - 1)}
        if name == "leave":
            fig["from_sigterm_s"] = round(new[0][0] - t_event, 2)
        fig["stop_s"] = _stop_s(logs, t_event)
        return fig, restart

    result = {"framework": framework, "events": []}
    try:
        start()
        start()
        r = lines.wait(lambda: lines.restart_of_world(2, -1, n=5), 240, "the first steps at world size 2")
        fig, r = event("leave", lambda: procs[1].send_signal(signal.SIGTERM), 1, r)
        result["events"].append(fig)
        fig, r = event("join", start, 2, r)
        result["events"].append(fig)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the scripts die with their supervisor (PDEATHSIG)
            p.wait()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--framework", choices=sorted(SCRIPTS), action="append")
    ap.add_argument("--gap", type=float, default=10.0)
    ap.add_argument("--stop-grace", type=float, default=30.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not os.path.exists(FRAMEWORKS_PYTHON):
        sys.exit(f"no {FRAMEWORKS_PYTHON}: run `bash scripts/setup.sh`")
    results = [measure(fw, args.gap, args.stop_grace) for fw in (args.framework or ["hf", "lightning"])]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'framework':<10} {'event':<6} {'pause_s':>8} {'from_sigterm_s':>15} {'stop_s':>7} {'resumed_at':>10} "
          f"{'last_before':>11} {'redone':>6} {'skipped':>7}")
    for res in results:
        for e in res["events"]:
            print(f"{res['framework']:<10} {e['event']:<6} {e['pause_s']:>8} {e.get('from_sigterm_s', '-'):>15} "
                  f"{e['stop_s']!s:>7} {e['resumed_at']!s:>10} {e['last_step_before']:>11} {e['redone']:>6} "
                  f"{e['skipped']:>7}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

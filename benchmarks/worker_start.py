"""What a worker's start costs, forked from the daemon's fork server or started plainly.

    .venv/bin/python benchmarks/worker_start.py [--workers 4] [--rounds 3] [--restart] [--json]

Each round starts `--workers` copies of a script that does what a training script does
before its first step (imports torch, builds a model and a torch optimizer, which
imports torch._dynamo) and then reports, with the host interpreter (.venv-host: Python
and torch only), both ways side by side: plainly (`procs.start_worker`, what the daemon
did before the fork server and still does for other commands) and forked
(`ForkServer.spawn`; the zygote is started once, before the rounds, as a daemon starts
it at its first worker, and its own start is reported apart). Figures: the seconds from
the start call to the script being ready (median over the workers and rounds), and the
CPU seconds the workers (and, forked, the zygote) used until then.

`--restart`: restart mode's warm interpreter instead (restart/launch.py's `Warm.start`, one
per generation and slot, before the script is known): plainly (`python -m
eltctl_runtime.restart.warmstart`, what the supervisor did before) and forked from the
supervisor's fork server; figures as above, until it says it is ready.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eltctl_runtime.daemon import procs  # noqa: E402
from eltctl_runtime.daemon.forkserver import ForkServer  # noqa: E402
from eltctl_runtime.restart.launch import Warm  # noqa: E402
from eltctl_runtime.restart.watch import OutputPump  # noqa: E402
from tests.testbed.hostpython import HOST_PYTHON, host_env  # noqa: E402

SCRIPT = r'''
import os, sys, time
import torch
model = torch.nn.Linear(32, 32)
torch.optim.AdamW(model.parameters())  # torch's optimizers import torch._dynamo here
t = time.process_time()
with open(sys.argv[1], "w") as f:
    f.write(f"{time.time()} {t}")
time.sleep(60)
'''


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def round_of(start, n: int, tmp: Path, tag: str) -> tuple[list[float], float]:
    marks = [tmp / f"{tag}-{i}.ready" for i in range(n)]
    t0 = time.time()
    procs_ = [start(i, m) for i, m in enumerate(marks)]
    while not all(m.exists() and m.read_text() for m in marks):
        time.sleep(0.01)
    took = [float(m.read_text().split()[0]) - t0 for m in marks]
    cpu = sum(cpu_s(p.pid) for p in procs_)
    for p in procs_:
        try:
            os.killpg(p.pid, 9)
        except ProcessLookupError:
            pass
        p.wait()
    for m in marks:
        m.unlink()
    return took, cpu


def restart_rounds(n: int, rounds: int, env: dict[str, str], server: ForkServer) -> dict[str, tuple[list, list]]:
    """Restart mode's warm interpreters, `n` at once, plainly and forked, alternating."""
    rows: dict[str, tuple[list, list]] = {"plain": ([], []), "forked": ([], [])}
    for r in range(rounds):
        for tag in ("plain", "forked") if r % 2 == 0 else ("forked", "plain"):
            t0 = time.monotonic()
            warm = [Warm.start(HOST_PYTHON, env, OutputPump(), server if tag == "forked" else None) for _ in range(n)]
            for w in warm:
                if not w.wait_ready(300):
                    raise SystemExit(f"a {tag} warm interpreter was not ready")
                rows[tag][0].append(time.monotonic() - t0)
            rows[tag][1].append(sum(cpu_s(w.proc.pid) for w in warm))
            for w in warm:
                w.discard()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--restart", action="store_true", help="restart mode's warm interpreters instead")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eltctl-start-"))
    (tmp / "w.py").write_text(SCRIPT)
    env = host_env({"PATH": os.environ.get("PATH", os.defpath), "HOME": os.environ.get("HOME", "/"),
                    "OMP_NUM_THREADS": "1", "ELTCTL_JOB": "bench"})
    log = tmp / "w.log"
    server = ForkServer("bench", "bench")
    t0 = time.monotonic()
    first = server.spawn([HOST_PYTHON, "w.py", str(tmp / "warm.ready")], dict(env, ELTCTL_WORKER_ID="x"), tmp, log)
    if first is None:
        print("the fork server did not start; see", log, file=sys.stderr)
        return 1
    while not (tmp / "warm.ready").exists():
        time.sleep(0.01)
    zygote_s = time.monotonic() - t0
    zygote_cpu = cpu_s(server._proc.pid)  # noqa: SLF001 - its import, once
    os.killpg(first.pid, 9)
    first.wait()

    def plain(i: int, mark: Path):
        return procs.start_worker([HOST_PYTHON, "w.py", str(mark)], dict(env, ELTCTL_WORKER_ID=f"p{i}"), tmp, log)

    def forked(i: int, mark: Path):
        return server.spawn([HOST_PYTHON, "w.py", str(mark)], dict(env, ELTCTL_WORKER_ID=f"f{i}"), tmp, log)

    rows = {"plain": ([], []), "forked": ([], [])}
    if a.restart:
        rows = restart_rounds(a.workers, a.rounds, env, server)
    else:
        for r in range(a.rounds):
            for tag, start in ((("plain", plain), ("forked", forked)) if r % 2 == 0 else
                               (("forked", forked), ("plain", plain))):
                took, cpu = round_of(start, a.workers, tmp, tag)
                rows[tag][0].extend(took)
                rows[tag][1].append(cpu)
    server.close()
    out = {
        "what": "restart mode's warm interpreters" if a.restart else "workers",
        "workers": a.workers, "rounds": a.rounds, "zygote_start_s": round(zygote_s, 2),
        "zygote_cpu_s": round(zygote_cpu, 2),
        **{f"{tag}_ready_s_median": round(statistics.median(v[0]), 3) for tag, v in rows.items()},
        **{f"{tag}_cpu_s_per_worker": round(sum(v[1]) / (a.workers * a.rounds), 3) for tag, v in rows.items()},
    }
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{a.workers} {out['what']} at once, {a.rounds} rounds each way, alternating; host interpreter {HOST_PYTHON}")
        print(f"  fork server start (once, as at a daemon's first worker): {out['zygote_start_s']} s, "
              f"{out['zygote_cpu_s']} CPU-s")
        for tag in ("plain", "forked"):
            print(f"  {tag:6}: ready after {out[f'{tag}_ready_s_median']} s (median), "
                  f"{out[f'{tag}_cpu_s_per_worker']} CPU-s per worker")
    return 0


if __name__ == "__main__":
    sys.exit(main())

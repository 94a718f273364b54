"""Soak: owners coming and going at random for a long run, on the real-sshd test bed.

`eltctl up` runs examples/train.py (CPU workers on simulated GPUs) on --hosts simulated
hosts of --gpus GPUs each, every host a real sshd on its own loopback address (the
test bed of tests/testbed). For --minutes, at random moments (seeded: --seed):

- a GPU owner arrives: a real process of another user is put on a random GPU (the
  stand-in nvidia-smi lists it, as a driver would), and leaves again after 10-60 s;
- a person logs in on a host (a real utmp record in that host's own utmp file and a
  tty whose atime moves while she types, tests/testbed/owner.py; the inventory watches
  the `login` owner signal), and logs out after a while;
- an admin cordons a host for a while (`eltctl cordon` / `uncordon`).

At most half the GPUs are taken at once, so the job keeps training. At the end the
owners leave and `eltctl down` runs. Then it checks, and prints:

- lost steps: every leave here is a planned one (an owner's GPU, a login, a cordon), so
  no step may be committed twice (the runtime's audit, ELTCTL_AUDIT: a step recorded by
  two generations was lost and redone);
- exactly-once: every committed step took a full global batch, no sample twice within
  an epoch, every completed epoch used every sample (tests/runtime/runtime_cluster.py's
  assert_exactly_once);
- the usage ledger (usage.db): one row per worker that ever ran, none twice, and its
  GPU-seconds within 2 % of the workers' lifetimes measured here (their pids sampled
  every 0.25 s from /proc, independently of eltctl);
- nothing left running: no process of the job (ELTCTL_JOB in its environment) and no
  process started on a simulated host survives `down`.

    .venv/bin/python benchmarks/soak.py [--minutes 20] [--hosts 3] [--gpus 2] [--seed 1] [--json] [--keep]

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests" / "runtime"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

ELTCTL = [sys.executable, "-m", "eltctl"]
# The fast policy of the soak and chaos benchmarks (chaos.py has no owner signals).
FAST_POLICY = """\
[policy]
idle_for = "1s"
cooldown = "3s"
probe_interval = "1s"
watch_interval = "0.5s"
hang_timeout = "6s"
nvidia_smi_timeout = "5s"
bench_after = 5
"""
POLICY = FAST_POLICY + """\
owner_signals = ["login"]
owner_idle_to_start = "5s"
owner_active_within = "60s"
"""
SAMPLES, BATCH = 4096, 24
LEDGER_TOLERANCE = 0.02
TTY = "pts/3"


def log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Lifetimes(threading.Thread):
    """Samples the job's live workers (ELTCTL_WORKER_ID of each process with
    ELTCTL_JOB=<job>) from /proc every `interval` s: worker id -> [first, last] seen."""

    def __init__(self, job: str, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.job, self.interval = job, interval
        self.seen: dict[str, list[float]] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        from tests.testbed.jobenv import worker_pids

        while not self._halt.is_set():
            now = time.time()
            for wid in worker_pids(self.job):
                span = self.seen.setdefault(wid, [now, now])
                span[1] = now
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(10)

    def seconds(self) -> float:
        return sum(last - first for first, last in self.seen.values())


def audit_figures(audit: Path, final_step: int) -> dict:
    """Lost (redone) steps and the exactly-once check of the runtime's audit."""
    from runtime_cluster import assert_exactly_once, committed_lineage

    gens_of: dict[int, set[int]] = {}
    for line in audit.read_text().splitlines():
        r = json.loads(line)
        gens_of.setdefault(r["step"], set()).add(r["generation"])
    redone = sorted(s for s, g in gens_of.items() if len(g) > 1)
    lineage = committed_lineage(audit)
    out = {"committed_steps": len(lineage), "generations": len({g for gs in gens_of.values() for g in gs}),
           "steps_lost": len(redone), "lost_examples": redone[:10]}
    try:
        epochs = assert_exactly_once(audit, SAMPLES, BATCH, max(lineage) if lineage else final_step)
        out.update(exactly_once=True, epochs=len(epochs))
    except AssertionError as e:
        out.update(exactly_once=False, exactly_once_error=str(e)[:500])
    return out


def ledger_figures(state_dir: Path, lifetimes: Lifetimes) -> dict:
    """The ledger's worker intervals against the lifetimes sampled from /proc."""
    db = state_dir / "usage.db"
    if not db.exists():
        return {"ledger": "missing", "ledger_ok": False}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT worker_id, start, end, how FROM intervals").fetchall()
    finally:
        con.close()
    ids = [r[0] for r in rows]
    open_rows = [r[0] for r in rows if r[2] is None]
    total = sum((r[2] - r[1]) for r in rows if r[2] is not None)
    measured = lifetimes.seconds()
    missing = sorted(set(lifetimes.seen) - set(ids))
    ratio = total / measured if measured else None
    hows: dict[str, int] = {}
    for r in rows:
        hows[str(r[3])] = hows.get(str(r[3]), 0) + 1
    ok = (len(ids) == len(set(ids)) and not open_rows and not missing and ratio is not None
          and abs(ratio - 1.0) <= LEDGER_TOLERANCE)
    return {"ledger_rows": len(rows), "ledger_duplicates": len(ids) - len(set(ids)), "ledger_open": len(open_rows),
            "workers_measured": len(lifetimes.seen), "workers_missing_from_ledger": missing[:10],
            "ledger_gpu_s": round(total, 1), "measured_gpu_s": round(measured, 1),
            "ledger_ratio": None if ratio is None else round(ratio, 4), "ended_how": hows, "ledger_ok": ok}


def run(minutes: float, n_hosts: int, gpus: int, seed: int, keep: bool, quiet: bool) -> dict:
    from tests.testbed import make_testbed
    from tests.testbed import procs as bedprocs
    from tests.testbed.jobenv import job_pids, wait_for

    from tests.testbed.owner import OwnerStandIn
    rng = random.Random(seed)
    job = f"soak{uuid.uuid4().hex[:6]}"
    root = Path(tempfile.mkdtemp(prefix="eltsoak-", dir="/tmp"))
    workdir = root / "code"
    workdir.mkdir()
    for f in ("train.py", "toy.py"):
        shutil.copy(ROOT / "examples" / f, workdir / f)
    audit = root / "audit.jsonl"
    state_home = root / "state"
    env = {**os.environ, "XDG_STATE_HOME": str(state_home), "PYTHONUNBUFFERED": "1"}
    state_dir = state_home / "eltctl" / job
    events: list[dict] = []
    counts = {"gpu_owner": 0, "login": 0, "cordon": 0}
    started = time.monotonic()
    result: dict = {"benchmark": "soak", "minutes": minutes, "hosts": n_hosts, "gpus_per_host": gpus,
                    "seed": seed}

    def eltctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*ELTCTL, "-i", str(inventory), *args], env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def status() -> dict:
        try:
            return json.loads((state_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    (root / "bed").mkdir()
    with make_testbed(root=root / "bed") as bed:
        names = [f"h{i + 1}" for i in range(n_hosts)]
        consoles = {n: OwnerStandIn(root / "owner" / n) for n in names}  # each host's utmp and /dev
        # The audit file reaches the workers through the hosts' session environment (the
        # inventory refuses ELTCTL_* variables: they are eltctl's to set).
        hosts = bed.add_hosts(n_hosts, gpus=gpus, names=names,
                              envs=[{**consoles[n].env(), "ELTCTL_AUDIT": str(audit)} for n in names])
        command = ["python", "train.py", "--steps", "100000000", "--hidden", "16", "--layers", "1",
                   "--samples", str(SAMPLES), "--batch", str(BATCH), "--step-sleep", "0.05",
                   "--checkpoint-every", "50"]
        inventory = bed.write_inventory(root / "hosts.toml", job={
            "name": job, "command": command, "workdir": str(workdir), "device": "cpu", "min_workers": 1,
            "env": {"OMP_NUM_THREADS": "1"}}, extra=POLICY)
        lifetimes = Lifetimes(job)
        gpu_owners: dict[tuple[str, int], tuple[int, float]] = {}  # (host, gpu) -> (pid, leaves at)
        logins: dict[str, float] = {}  # host -> when alice logs out
        cordoned: dict[str, float] = {}
        total = n_hosts * gpus
        try:
            log(f"eltctl up: job {job}, {n_hosts} hosts x {gpus} GPUs (files in {root})", quiet)
            lifetimes.start()  # before `up`: its first workers start while it waits for training
            up = eltctl("up")
            if up.returncode != 0:
                raise RuntimeError(f"eltctl up exited {up.returncode}: {up.stdout[-800:]}{up.stderr[-800:]}")
            wait_for(lambda: status().get("world_size") == total and status().get("state") == "training", 180,
                     f"training at {total}")
            deadline = time.monotonic() + minutes * 60
            last_report = time.monotonic()
            while time.monotonic() < deadline:
                now = time.monotonic()
                for key, (pid, until) in list(gpu_owners.items()):
                    if now >= until:
                        bed.host(key[0]).stop_foreign_process(pid)
                        del gpu_owners[key]
                        events.append({"t": round(now - started, 1), "what": "gpu owner leaves", "where": key})
                for name, until in list(logins.items()):
                    if now >= until:
                        consoles[name].logout(TTY)
                        del logins[name]
                        events.append({"t": round(now - started, 1), "what": "logout", "where": name})
                for name, until in list(cordoned.items()):
                    if now >= until:
                        eltctl("uncordon", name, timeout=120)
                        del cordoned[name]
                        events.append({"t": round(now - started, 1), "what": "uncordon", "where": name})
                taken = len(gpu_owners) + gpus * (len(logins) + len(cordoned))
                kind = rng.choices(("gpu", "login", "cordon", "none"), weights=(4, 3, 2, 1))[0]
                free_hosts = [h.name for h in hosts if h.name not in logins and h.name not in cordoned
                              and not any(k[0] == h.name for k in gpu_owners)]
                if kind == "gpu" and taken + 1 <= total // 2:
                    choices = [(h.name, g) for h in hosts for g in range(gpus)
                               if (h.name, g) not in gpu_owners and h.name not in logins and h.name not in cordoned]
                    if choices:
                        h, g = rng.choice(choices)
                        pid = bed.host(h).start_foreign_process(g, memory_mib=4000, utilization=80)
                        gpu_owners[(h, g)] = (pid, now + rng.uniform(10, 60))
                        counts["gpu_owner"] += 1
                        events.append({"t": round(now - started, 1), "what": "gpu owner arrives", "where": [h, g]})
                elif kind == "login" and taken + gpus <= total // 2 and free_hosts:
                    h = rng.choice(free_hosts)
                    consoles[h].login("alice", TTY)
                    logins[h] = now + rng.uniform(15, 60)
                    counts["login"] += 1
                    events.append({"t": round(now - started, 1), "what": "login", "where": h})
                elif kind == "cordon" and taken + gpus <= total // 2 and free_hosts:
                    h = rng.choice(free_hosts)
                    r = eltctl("cordon", h, timeout=120)
                    if r.returncode == 0:
                        cordoned[h] = now + rng.uniform(10, 40)
                        counts["cordon"] += 1
                        events.append({"t": round(now - started, 1), "what": "cordon", "where": h})
                for name in logins:
                    consoles[name].set_idle(TTY, 0.0)  # alice types: her tty's atime moves
                if now - last_report >= 60:
                    st = status()
                    log(f"{(now - started) / 60:.0f} min: step {st.get('step')}, world {st.get('world_size')}, "
                        f"{len(gpu_owners)} GPU owner(s), {len(logins)} login(s), {len(cordoned)} cordoned", quiet)
                    last_report = now
                time.sleep(rng.uniform(3, 12))
            log("the owners leave; eltctl down", quiet)
            for (h, _g), (pid, _) in list(gpu_owners.items()):
                bed.host(h).stop_foreign_process(pid)
            for name in logins:
                consoles[name].logout(TTY)
            for h in list(cordoned):
                eltctl("uncordon", h, timeout=120)
            final = status()
            down = eltctl("down", timeout=300)
            lifetimes.stop()
            time.sleep(1.0)
            left = job_pids(job)
            on_hosts = sorted({p for h in hosts for p in bedprocs.host_pids(str(h.state_path))})
            result.update({
                "events": counts, "final_step": final.get("step"),
                "down_exit": down.returncode, "left_running": left + on_hosts,
                "yield_events": sum(1 for e in final.get("events") or () if e.get("kind") == "yield"),
            })
            result.update(audit_figures(audit, int(final.get("step") or 0)))
            result.update(ledger_figures(state_dir, lifetimes))
        finally:
            lifetimes.stop()
            with contextlib.suppress(Exception):
                if job_pids(job):
                    eltctl("down", "--force", timeout=180)
            for pid in job_pids(job):
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
    result["total_s"] = round(time.monotonic() - started, 1)
    result["timeline"] = events
    result["ok"] = bool(result.get("down_exit") == 0 and not result.get("left_running")
                        and result.get("steps_lost") == 0 and result.get("exactly_once")
                        and result.get("ledger_ok"))
    if keep:
        result["kept"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--keep", action="store_true", help="keep the run's directory (logs, audit, ledger)")
    args = ap.parse_args(argv)
    r = run(args.minutes, args.hosts, args.gpus, args.seed, args.keep, quiet=args.json)
    if args.json:
        print(json.dumps({k: v for k, v in r.items() if k != "timeline"}))
        return 0 if r["ok"] else 1
    print(f"soak: {r['minutes']:g} min on {r['hosts']} hosts x {r['gpus_per_host']} GPUs (seed {r['seed']}), "
          f"{r['total_s']:.0f} s in all")
    print(f"  events: {r.get('events')}; yield events among the final status's recent events: "
          f"{r.get('yield_events')}")
    print(f"  steps committed: {r.get('committed_steps')} in {r.get('generations')} generations; "
          f"lost on planned leaves: {r.get('steps_lost')}; exactly-once: {r.get('exactly_once')}")
    print(f"  ledger: {r.get('ledger_rows')} intervals, {r.get('ledger_duplicates')} twice, {r.get('ledger_open')} "
          f"open; {r.get('ledger_gpu_s')} GPU-s vs {r.get('measured_gpu_s')} measured (ratio "
          f"{r.get('ledger_ratio')}, within {LEDGER_TOLERANCE:.0%}: {r.get('ledger_ok')}); ended: {r.get('ended_how')}")
    print(f"  down exit {r.get('down_exit')}; left running: {r.get('left_running') or 'nothing'}")
    print(f"  {'PASS' if r['ok'] else 'FAIL'}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

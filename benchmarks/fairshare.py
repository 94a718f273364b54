"""Fair share between two users' jobs, owners coming and going, on the real-sshd test bed.

Three simulated hosts of two GPUs each, every host a real sshd on its own loopback
address (tests/testbed), two jobs of equal priority running examples/train.py (the
tiny model of the sshd tests: CPU workers on simulated GPUs, a 16-wide layer):

- job A logs in as the test bed's account; it starts alone and takes all six GPUs;
- job B logs in as each host's own account (another unix user); when it starts, A
  releases GPUs in the planned way (docs/fairshare.md) until each holds three;
- for --minutes after that, GPU owners come and go at random (seeded: --seed): a real
  process of another account is put on a random GPU (the stand-in nvidia-smi lists
  it, as a driver would) and leaves again 20-90 s later, at most two at once; the job
  on that GPU yields it, and the GPUs that come back are shared again;
- at the end the owners leave and job C (the test bed's account, `priority = 1`,
  `min_workers = max_workers = 2`) starts: A and B give it one GPU each.

It prints, from what it measured itself (the GPU claims on the hosts, read every
second; job A's runtime audit, ELTCTL_AUDIT):

- `jain`: Jain's fairness index of the two jobs' GPU-time from B's start to the end of
  the owners' phase, (xA + xB)^2 / (2 (xA^2 + xB^2)), target >= 0.95;
- `moves`: GPUs handed from one job to the other (a GPU whose claim goes from A to B
  or back, with no owner on it in between), against `moves_min`, the fewest the rule
  needs (`moves_needed`): 3 when B starts (6-0 to 3-3), then at each owner's arrival,
  from the holdings seen just before it, the arrival's GPU taken from the job that
  held it and the free GPUs given to the job holding fewer, floor((|A - B| - free) / 2)
  more (an owner's return frees a GPU: no move is needed for it);
- `halves_s`: seconds from `eltctl up` of B until each holds three GPUs (target <= 120);
- `steps_lost_a`: steps job A committed twice (its audit: a step recorded by two
  generations was lost and redone), target 0; `exactly_once_a` the audit's exactly-once
  check;
- `third_claims_s`: seconds from `eltctl up` of C until its daemons hold (claim) its
  `min_workers` GPUs (target <= 60), and `third_min_workers_s` until it trains on them
  (its workers' start, torch's import and the rendezvous added).

    nice .venv/bin/python benchmarks/fairshare.py [--minutes 20] [--seed 1] [--hold 30s] [--json] [--keep]
    nice .venv/bin/python benchmarks/fairshare.py --third-only [--json] [--keep]

`--third-only` measures the third job alone: A, then B until each holds three, then C
at once (no owners' phase; Jain's index and the moves are not judged). It also prints
`third_up_s` (C's `eltctl up --detach` until it returned: the checks and the
controller's start) and `third_released_s` (until A and B released a GPU each, from their
`fairshare` events).

Exit status 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks", ROOT / "tests" / "runtime"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

N_HOSTS, GPUS = 3, 2
MAX_OWNERS = 2
TARGET_JAIN, TARGET_HALVES_S, TARGET_THIRD_S = 0.95, 120.0, 60.0


def log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def jain(xs: list[float]) -> float | None:
    s, q = sum(xs), sum(x * x for x in xs)
    return None if q <= 0 else s * s / (len(xs) * q)


def moves_needed(timeline: list[dict]) -> int:
    """The fewest GPU moves the rule needs over the run: 3 when B starts (6-0 to 3-3),
    then, at each owner's arrival, from the holdings seen just before it (`held`, the
    owners then present): the arrival's GPU taken from the job that held it, the free
    GPUs given to the job holding fewer, floor((|A - B| - free) / 2) GPUs must change
    hands. An owner's return frees a GPU: no move is needed for it."""
    needed, owners = 3, 0
    for e in timeline:
        if "owner leaves" in e:
            owners -= 1
            continue
        a, b = e["held"]["A"], e["held"]["B"]
        hit = e.get("held by")
        a, b = a - (hit == "A"), b - (hit == "B")
        free = max(0, N_HOSTS * GPUS - owners - 1 - a - b)
        needed += max(0, abs(a - b) - free) // 2
        owners += 1
    return needed


def _held(hosts) -> dict[tuple[str, int], str]:
    from eltctl_runtime import claims

    out = {}
    for host in hosts:
        for name, c in claims.holders(host.claims_dir, [f"gpu{i}" for i in range(GPUS)]).items():
            out[(host.name, int(name[3:]))] = c.job
    return out


def _running(je) -> int:
    n = 0
    for h in je.status().get("hosts", []):
        n += sum(1 for w in ((h.get("daemon") or {}).get("workers") or []) if w.get("state") in ("running", "starting", "leaving"))
    return n


def _as_login(text: str, hosts) -> str:
    """The inventory logging in as the test bed's account (no per-host `user`)."""
    for h in hosts:
        text = text.replace(f'user = "{h.login}"\n', "")
    return text


def _up_detached(je) -> subprocess.CompletedProcess:
    from tests.testbed.jobenv import ELTCTL

    return subprocess.run([*ELTCTL, "-i", str(je.inventory), "up", "--detach"], env=je.env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)


def _released(details: dict, je) -> None:
    for e in je.status().get("events") or ():
        if e.get("kind") == "fairshare":
            details[(je.job, e.get("time"), e.get("detail"))] = e.get("detail") or ""


def _released_at(je) -> list[float]:
    """When job `je` released GPUs to fair share (its `fairshare` events' times)."""
    return [float(e["time"]) for e in je.status().get("events") or ()
            if e.get("kind") == "fairshare" and isinstance(e.get("time"), (int, float))]


def run(minutes: float, seed: int, hold: str, keep: bool, quiet: bool, third_only: bool = False) -> dict:
    from soak import audit_figures

    from tests.testbed import make_testbed
    from tests.testbed.jobenv import ELTCTL, hand_home_to_hosts_accounts, job_env_on, wait_for

    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="eltfair-", dir="/tmp"))
    audit = root / "audit-a.jsonl"
    audit.touch()
    audit.chmod(0o666)
    root.chmod(0o755)
    fair = f'fairshare_hold = "{hold}"\n'
    result: dict = {"benchmark": "fairshare", "minutes": minutes, "seed": seed, "hosts": N_HOSTS,
                    "gpus_per_host": GPUS, "fairshare_hold": hold, "third_only": third_only}
    started = time.monotonic()
    timeline: list[dict] = []
    (root / "bed").mkdir()
    with make_testbed(root=root / "bed") as bed:
        hosts = bed.add_hosts(N_HOSTS, gpus=GPUS, login=True)
        gens = [job_env_on(bed, hosts, extra=fair) for _ in range(3)]
        try:
            a, b, c = (next(g) for g in gens)
            text = _as_login(a.inventory.read_text(), hosts)
            # Job A's audit: its own file, set by its command (the inventory's `env` may
            # not set ELTCTL_* variables, and the hosts' session environment is shared).
            text = text.replace('command = ["python", ', f'command = ["env", "ELTCTL_AUDIT={audit}", "python", ', 1)
            a.inventory.write_text(text)
            text = _as_login(c.inventory.read_text(), hosts)
            text, n = re.subn(r"min_workers = 1\n", "min_workers = 2\nmax_workers = 2\npriority = 1\n", text, 1)
            assert n == 1, text
            c.inventory.write_text(text)
            names = {a.job: "A", b.job: "B", c.job: "C"}

            log(f"eltctl up: job A ({a.job}) alone on {N_HOSTS} hosts x {GPUS} GPUs (files in {root})", quiet)
            a.eltctl("up")
            a.training_at(N_HOSTS * GPUS, timeout=240)
            log(f"A trains on {N_HOSTS * GPUS} GPUs after {time.monotonic() - started:.0f} s", quiet)
            hand_home_to_hosts_accounts(hosts)

            gpu_s = {"A": 0.0, "B": 0.0}
            moves = 0
            last_job: dict[tuple[str, int], str] = {}  # GPU -> the job that held it last (reset by an owner)
            owners: dict[tuple[str, int], tuple[int, float]] = {}
            releases: dict = {}

            t_b = time.monotonic()
            up = _up_detached(b)
            if up.returncode != 0:
                raise RuntimeError(f"eltctl up of B exited {up.returncode}: {up.stdout[-800:]}{up.stderr[-800:]}")
            halves_s = None
            end = t_b + minutes * 60
            prev = t_b
            next_owner = t_b + 150  # the owners come once the halves had time to settle
            last_report = t_b
            counts = {"owner_arrivals": 0}
            while True:
                now = time.monotonic()
                if now >= end and not (third_only and halves_s is None and now - t_b < 300):
                    break
                if third_only and halves_s is not None:
                    break
                held = _held(hosts)
                per = {"A": 0, "B": 0}
                for gpu, job in held.items():
                    who = names.get(job)
                    if who in per:
                        per[who] += 1
                        if last_job.get(gpu) not in (None, who):
                            moves += 1
                        last_job[gpu] = who
                dt = now - prev
                prev = now
                for k in per:
                    gpu_s[k] += per[k] * dt
                if halves_s is None and per == {"A": 3, "B": 3}:
                    halves_s = now - t_b
                    log(f"A and B hold 3 GPUs each {halves_s:.1f} s after B's up", quiet)
                for gpu, (pid, until) in list(owners.items()):
                    if now >= until:
                        bed.host(gpu[0]).stop_foreign_process(pid)
                        del owners[gpu]
                        timeline.append({"t": round(now - t_b, 1), "owner leaves": gpu, "held": dict(per)})
                if now >= next_owner and len(owners) < MAX_OWNERS and not third_only:
                    choices = [(h.name, g) for h in hosts for g in range(GPUS) if (h.name, g) not in owners]
                    gpu = rng.choice(choices)
                    hit = names.get(held.get(gpu, ""))
                    pid = bed.host(gpu[0]).start_foreign_process(gpu[1], memory_mib=4000, utilization=80)
                    owners[gpu] = (pid, now + rng.uniform(20, 90))
                    last_job.pop(gpu, None)  # it comes back through a free GPU: not a move
                    counts["owner_arrivals"] += 1
                    timeline.append({"t": round(now - t_b, 1), "owner arrives": gpu, "held by": hit,
                                     "held": dict(per)})
                    next_owner = now + rng.uniform(10, 40)
                if now - last_report >= 60:
                    _released(releases, a)
                    _released(releases, b)
                    log(f"{(now - t_b) / 60:.0f} min: held A {per['A']} B {per['B']}, {len(owners)} owner(s); "
                        f"GPU-s A {gpu_s['A']:.0f} B {gpu_s['B']:.0f}; moves {moves} (min {moves_needed(timeline)})", quiet)
                    last_report = now
                time.sleep(1.0)
            _released(releases, a)
            _released(releases, b)
            for gpu, (pid, _) in list(owners.items()):
                bed.host(gpu[0]).stop_foreign_process(pid)
            owners.clear()
            result.update({
                "jain": None if jain(list(gpu_s.values())) is None else round(jain(list(gpu_s.values())), 4),
                "gpu_s": {k: round(v, 1) for k, v in gpu_s.items()},
                "moves": moves, "moves_min": moves_needed(timeline),
                "fairshare_released": sum(int(d.split()[1]) for d in releases.values()
                                          if d.startswith("released ")),
                "halves_s": None if halves_s is None else round(halves_s, 1),
                **counts,
            })

            # The third job, of higher priority.
            log("owners gone; eltctl up of job C (priority 1, min_workers 2)", quiet)
            wait_for(lambda: _running(a) + _running(b) >= 5, 180, "A and B back on the GPUs")
            before = {"A": len(_released_at(a)), "B": len(_released_at(b))}
            t_c, wall_c = time.monotonic(), time.time()
            result["load_at_third"] = list(__import__("os").getloadavg())
            up = _up_detached(c)
            result["third_up_s"] = round(time.monotonic() - t_c, 1)
            if up.returncode != 0:
                raise RuntimeError(f"eltctl up of C exited {up.returncode}: {up.stdout[-800:]}{up.stderr[-800:]}")

            def c_trains():
                st = c.status()
                return st if st.get("state") == "training" and (st.get("world_size") or 0) >= 2 else None

            result["third_min_workers_s"] = result["third_claims_s"] = None
            while time.monotonic() - t_c < 300:
                if result["third_claims_s"] is None and sum(1 for j in _held(hosts).values() if j == c.job) >= 2:
                    result["third_claims_s"] = round(time.monotonic() - t_c, 1)
                if c_trains():
                    result["third_min_workers_s"] = round(time.monotonic() - t_c, 1)
                    break
                time.sleep(0.5)
            else:
                result["third_log"] = c.controller_log(20)
            rel = [t for je, k in ((a, "A"), (b, "B")) for t in _released_at(je)[before[k]:]]
            result["third_released_s"] = round(max(rel) - wall_c, 1) if len(rel) >= 2 else None
            result["held_at_end"] = {names[j]: n for j, n in
                                     sorted({j: sum(1 for v in _held(hosts).values() if v == j)
                                             for j in names}.items())}
            log(f"C: up returned after {result['third_up_s']} s, A and B released after "
                f"{result['third_released_s']} s", quiet)
            log(f"C holds 2 GPUs after {result['third_claims_s']} s, trains on them after "
                f"{result['third_min_workers_s']} s; held {result['held_at_end']}", quiet)
            final_a = a.status()
            logs = root / "logs"
            logs.mkdir()
            for who, je in (("a", a), ("b", b), ("c", c)):
                with contextlib.suppress(OSError):
                    shutil.copy(je.state_dir / "controller.log", logs / f"controller-{who}.log")
                    shutil.copy(je.state_dir / "status.json", logs / f"status-{who}.json")
            downs = [subprocess.Popen([*ELTCTL, "-i", str(je.inventory), "down"], env=je.env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for je in (c, b, a)]
            for p in downs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(300)
            result.update({f"{k}_a" if k in ("steps_lost", "exactly_once", "committed_steps", "generations",
                                              "lost_examples", "epochs", "exactly_once_error") else k: v
                           for k, v in audit_figures(audit, int(final_a.get("step") or 0)).items()})
            result["leave_events_a"] = sum(1 for e in final_a.get("events") or () if e.get("kind") == "leave")
        finally:
            for g in reversed(gens):
                with contextlib.suppress(Exception):
                    next(g, None)
    result["total_s"] = round(time.monotonic() - started, 1)
    result["timeline"] = timeline
    if keep:
        (root / "timeline.json").write_text(json.dumps(timeline, indent=1))
    result["ok"] = bool((third_only or result.get("jain") is not None and result["jain"] >= TARGET_JAIN)
                        and result.get("halves_s") is not None and result["halves_s"] <= TARGET_HALVES_S
                        and result.get("steps_lost_a") == 0
                        and result.get("third_claims_s") is not None
                        and result["third_claims_s"] <= TARGET_THIRD_S and result.get("third_min_workers_s") is not None)
    if keep:
        result["kept"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="the owners' phase, from B's start")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hold", default="30s", help="[policy] fairshare_hold of the jobs")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--keep", action="store_true", help="keep the run's directory (logs, audit)")
    ap.add_argument("--third-only", action="store_true",
                    help="only the third job's scenario: A, B until each holds 3, then C (no owners)")
    args = ap.parse_args(argv)

    def stop(signum, frame):  # SIGTERM tears the bed down as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    r = run(0.0 if args.third_only else args.minutes, args.seed, args.hold, args.keep, quiet=False,
            third_only=args.third_only)  # progress on stderr
    if args.json:
        print(json.dumps({k: v for k, v in r.items() if k != "timeline"}))
        return 0 if r["ok"] else 1
    print(f"fairshare: {r['minutes']:g} min, {r['hosts']} hosts x {r['gpus_per_host']} GPUs, seed {r['seed']}, "
          f"{r['total_s']:.0f} s in all")
    print(f"  A and B hold 3 each {r.get('halves_s')} s after B's up (target <= {TARGET_HALVES_S:g})")
    print(f"  Jain's index of GPU-time: {r.get('jain')} (target >= {TARGET_JAIN}); GPU-s {r.get('gpu_s')}")
    print(f"  GPU moves: {r.get('moves')} against a minimum of {r.get('moves_min')} "
          f"({r.get('owner_arrivals')} owner arrivals; fair-share releases in the events: "
          f"{r.get('fairshare_released')})")
    print(f"  steps lost in A (audit): {r.get('steps_lost_a')}; exactly-once: {r.get('exactly_once_a')}")
    print(f"  C (priority 1) holds its min_workers GPUs {r.get('third_claims_s')} s after its up, trains on them "
          f"{r.get('third_min_workers_s')} s after it "
          f"(target <= {TARGET_THIRD_S:g}); held at the end {r.get('held_at_end')}")
    print(f"  C's up returned after {r.get('third_up_s')} s; A and B released to it after "
          f"{r.get('third_released_s')} s; load average then {r.get('load_at_third')}")
    print(f"  {'PASS' if r['ok'] else 'FAIL'}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Chaos: random faults, one at a time, on a job on the real-sshd test bed; invariants checked.

`eltctl up` runs examples/train.py (CPU workers on simulated GPUs) on --hosts simulated
hosts of --gpus GPUs each (tests/testbed: a real sshd per host on its own loopback address),
with `[storage] mirror` a directory of this run. Once it trains at full width, for --minutes,
after a random gap of 5-20 s (seeded: --seed) one fault of a random kind (--faults, default
all) is injected, held, and undone; the next waits until the step has advanced again:

  worker_kill      SIGKILL of a worker
  worker_hang      SIGSTOP of a worker for 3-15 s, then SIGCONT
  daemon_kill      SIGKILL of a host daemon
  daemon_hang      SIGSTOP of a host daemon for 5-25 s, then SIGCONT
  host_crash       every process of a simulated host killed and its sshd stopped, for 10-40 s;
                   then sshd again (the host's files stay, as after a reboot)
  keeper_kill      SIGKILL of the store keeper (its pid in the state dir's controller.json)
  controller_kill  SIGKILL of the controller; 2-15 s later `eltctl up --unattended`, the run
                   the crontab entry makes
  gpu_owner        a process of another user on the GPU of a worker, for 10-40 s
  mirror_away      the mirror directory moved away and a plain file in its place, 10-40 s
  disk_full        the checkpoint directory of rank 0's host on a 16 MiB tmpfs, filled up,
                   for 10-40 s (a real ENOSPC for that host's writes there; the tmpfs keeps
                   what is written to it until the end of the run)

Invariants (each printed as held, or broken with its first violation):

- keeps_training: one fault at a time always leaves at least `min_workers` (1) slots
  usable, so the step must advance within --bound s after each fault is undone, and no
  stretch of the run goes --bound s without a committed step. Progress is read from the
  workers' own audit lines (ELTCTL_AUDIT), not through the controller. A job that stops
  advancing ends the fault phase (the run goes on to `down` and the checks).
- exactly_once: every committed step took a full global batch, no sample twice within an
  epoch, every completed epoch used every sample (the runtime's audit; soak.py's check).
- no_step_lost_on_planned_leave: no committed step redone by a generation that began
  during a planned fault (gpu_owner: the worker leaves at a step boundary) or during
  `down`. Steps redone after crashes are counted per fault kind, not an error.
- final_checkpoint_mirrored: `eltctl down` reports the final checkpoint mirrored and
  verified, and `eltctl checkpoints --json` lists that step on the mirror, verified.
- nothing_left_after_down: no process of the job (ELTCTL_JOB), none started over SSH on a
  host, no connection's sshd under a host's listener, no controller or store keeper.

Also printed: the faults injected (count per kind) and the pause per fault kind (the
longest stretch without a committed step from the fault until the next fault: median and max).

    .venv/bin/python benchmarks/chaos.py [--minutes 30] [--hosts 3] [--gpus 2] [--seed 1]
        [--faults worker_kill,host_crash,...] [--bound 120] [--json] [--keep]

Needs root (sshd hosts, the foreign user, tmpfs mounts). Exit status 0 when every invariant
held, 1 when one broke, 2 when the job could not be started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for p in (ROOT, ROOT / "tests" / "runtime", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import _chaos_faults as cf  # noqa: E402
from soak import BATCH, FAST_POLICY, SAMPLES, audit_figures, log  # noqa: E402

# torch without numpy (the hosts' interpreter has none) warns once when the audit check imports it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
ELTCTL = [sys.executable, "-m", "eltctl"]
INVARIANTS = ("keeps_training", "exactly_once", "no_step_lost_on_planned_leave", "final_checkpoint_mirrored",
              "nothing_left_after_down")


class Invariants:
    def __init__(self) -> None:
        self.broken: dict[str, list[str]] = {name: [] for name in INVARIANTS}

    def fail(self, name: str, what: str) -> None:
        self.broken[name].append(what)

    def as_json(self) -> dict:
        return {name: {"held": not v, "violations": len(v), "first_violation": v[0] if v else None}
                for name, v in self.broken.items()}

    def ok(self) -> bool:
        return not any(self.broken.values())


def run(minutes: float, n_hosts: int, gpus: int, seed: int, kinds: list[str], bound: float, keep: bool,
        quiet: bool) -> dict:
    from tests.testbed import make_testbed
    from tests.testbed.jobenv import job_pids, wait_for

    rng = random.Random(seed)
    job = f"chaos{uuid.uuid4().hex[:6]}"
    root = Path(tempfile.mkdtemp(prefix="eltchaos-", dir="/tmp"))
    workdir = root / "code"
    workdir.mkdir()
    for f in ("train.py", "toy.py"):
        shutil.copy(ROOT / "examples" / f, workdir / f)
    audit, mirror = root / "audit.jsonl", root / "mirror"
    state_home = root / "state"
    env = {**os.environ, "XDG_STATE_HOME": str(state_home), "PYTHONUNBUFFERED": "1"}
    env.pop("ELTCTL_CRONTAB", None)
    state_dir = state_home / "eltctl" / job
    inv = Invariants()
    records: list[dict] = []
    started = time.monotonic()
    result: dict = {"benchmark": "chaos", "minutes": minutes, "hosts": n_hosts, "gpus_per_host": gpus,
                    "seed": seed, "faults_selected": kinds, "bound_s": bound}
    phase_reached = False  # the job trained at full width: the audit is worth checking
    pids_seen: dict[str, int] = {}  # "controller 1234" -> pid, the same for keepers

    def eltctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([*ELTCTL, "-i", str(inventory), *args], env=env, capture_output=True, text=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, 124, str(e.stdout or ""), f"timed out after {timeout:g} s")

    def status() -> dict:
        try:
            return json.loads((state_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def note_pids() -> None:
        doc = ctx.controller_doc()
        if doc.get("pid"):
            pids_seen[f"controller {doc['pid']}"] = int(doc["pid"])
        keeper = (doc.get("store") or {}).get("pid")
        if keeper:
            pids_seen[f"store keeper {keeper}"] = int(keeper)

    def rel(t: float) -> float:
        return round(t - started, 1)

    (root / "bed").mkdir()
    with make_testbed(root=root / "bed") as bed:
        bed.add_hosts(n_hosts, gpus=gpus, envs=[{"ELTCTL_AUDIT": str(audit)}] * n_hosts)
        command = ["python", "train.py", "--steps", "100000000", "--hidden", "16", "--layers", "1",
                   "--samples", str(SAMPLES), "--batch", str(BATCH), "--step-sleep", "0.05",
                   "--checkpoint-every", "50"]
        inventory = bed.write_inventory(root / "hosts.toml", job={
            "name": job, "command": command, "workdir": str(workdir), "device": "cpu", "min_workers": 1,
            "env": {"OMP_NUM_THREADS": "1"}}, extra=FAST_POLICY + f'\n[storage]\nmirror = "{mirror}"\n')
        ctx = cf.Context(bed=bed, job=job, state_dir=state_dir, mirror=mirror, root=root, rng=rng, eltctl=eltctl)
        watch = cf.StepWatch(audit)
        total = n_hosts * gpus
        try:
            watch.start()
            log(f"eltctl up: job {job}, {n_hosts} hosts x {gpus} GPUs (files in {root})", quiet)
            up = eltctl("up", timeout=420)
            note_pids()
            if up.returncode != 0:
                raise RuntimeError(f"eltctl up exited {up.returncode}: {up.stdout[-800:]}{up.stderr[-800:]}")
            wait_for(lambda: status().get("world_size") == total and status().get("state") == "training", 300,
                     f"training at {total}")
            phase_start = time.monotonic()
            phase_reached = True
            deadline = phase_start + minutes * 60
            stalled = None
            while time.monotonic() < deadline:
                time.sleep(min(rng.uniform(5, 20), max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    break
                last = watch.last()
                if last is None or time.monotonic() - last[0] > bound:
                    stalled = f"no committed step for {bound:g} s at t={rel(time.monotonic())} s"
                    break
                kind = rng.choice(kinds)
                try:
                    injected = cf.FAULTS[kind](ctx)
                except Exception as e:  # noqa: BLE001 - the benchmark's own failure: say it, go on
                    log(f"could not inject {kind}: {e!r}", quiet)
                    continue
                if injected is None:
                    continue
                t0 = time.monotonic()
                log(f"{kind} on {injected.where}: {injected.detail}", quiet)
                time.sleep(injected.hold_s)
                note = injected.recover()
                t_rec = time.monotonic()
                note_pids()
                rec = {"kind": kind, "where": injected.where, "detail": injected.detail, "t": rel(t0),
                       "held_s": round(t_rec - t0, 1), "note": note, "_t0": t0}
                records.append(rec)
                if note:
                    log(f"  {note}", quiet)
                t_adv = None
                while time.monotonic() - t_rec <= bound:
                    t_adv = watch.first_after(t_rec)
                    if t_adv is not None:
                        break
                    time.sleep(0.2)
                rec["advanced_after_recovery_s"] = None if t_adv is None else round(t_adv - t_rec, 2)
                if t_adv is None:
                    stalled = (f"after {kind} on {injected.where} at t={rec['t']} s ({injected.detail}): no step "
                               f"within {bound:g} s of its recovery")
                    inv.fail("keeps_training", stalled)
                    log(stalled, quiet)
                    break
            phase_end = time.monotonic()
            time.sleep(5)  # the last fault's window: its pause shows
            if stalled and not inv.broken["keeps_training"]:
                inv.fail("keeps_training", stalled)
            # Every stretch of the fault phase without a commit, against the bound.
            times = watch.times(phase_start, phase_end)
            edges = [phase_start, *times, phase_end]
            result["longest_stall_s"] = round(max(b - a for a, b in zip(edges, edges[1:])), 2)
            for a, b in zip(edges, edges[1:]):
                if b - a > bound:
                    inv.fail("keeps_training", f"no committed step from t={rel(a)} s to t={rel(b)} s")
                    break
            # Pauses: the longest stretch without a commit in each fault's window.
            windows_end = [r["_t0"] for r in records[1:]] + [time.monotonic()]
            for r, end in zip(records, windows_end):
                r["pause_s"] = round(cf.longest_stall(watch.times(r["_t0"], end), r["_t0"], end), 2)
                r["_end"] = end
            cf.undo_everything(ctx)

            log("eltctl down", quiet)
            down_t = time.monotonic()
            down = eltctl("down", timeout=420)
            note_pids()
            result["down_exit"] = down.returncode
            result["down_output"] = (down.stdout + down.stderr)[-1500:]
            m = re.search(r"final checkpoint step (\d+) mirrored and verified", down.stdout)
            final = re.search(r"final checkpoint: step (\d+)", down.stdout)
            result["final_checkpoint_step"] = int(final.group(1)) if final else None
            result["mirrored_step"] = int(m.group(1)) if m else None
            if not m:
                line = next((ln for ln in down.stdout.splitlines() if "mirror" in ln), down.stdout[-300:])
                inv.fail("final_checkpoint_mirrored", f"`eltctl down` (exit {down.returncode}): {line.strip()}")
            else:
                listing = eltctl("checkpoints", "--json", timeout=300)
                try:
                    found = json.loads(listing.stdout)
                except ValueError:
                    found = {}
                mine = [c for c in found.get("checkpoints", ())
                        if c.get("where") == "mirror" and c.get("step") == result["mirrored_step"]]
                result["checkpoints_listing"] = mine
                if not mine or mine[0].get("verified") is not True:
                    inv.fail("final_checkpoint_mirrored",
                             f"`eltctl checkpoints --json` (exit {listing.returncode}) lists step "
                             f"{result['mirrored_step']} on the mirror as {mine or 'absent'}: "
                             f"{(listing.stderr or '')[-300:]}")
                elif final and result["final_checkpoint_step"] != result["mirrored_step"]:
                    inv.fail("final_checkpoint_mirrored", f"final checkpoint step {result['final_checkpoint_step']}"
                             f", mirrored step {result['mirrored_step']}")
            watch.stop()
            left = cf.leftovers(ctx, job_pids, pids_seen)
            result["left_running"] = left
            if left:
                inv.fail("nothing_left_after_down", f"after `eltctl down` (exit {down.returncode}): {left[0]}"
                         + (f" and {len(left) - 1} more" if len(left) > 1 else ""))
            elif down.returncode != 0:
                inv.fail("nothing_left_after_down", f"`eltctl down` exited {down.returncode}: "
                         f"{(down.stdout + down.stderr)[-300:]}")
            # Redone steps by the fault whose window saw their generation begin.
            redone_by: dict[str, int] = {}
            for gen, step in watch.redone:
                t = watch.gen_first_seen.get(gen, 0.0)
                kind = "before faults" if t < phase_start else "down" if t >= down_t else "?"
                for r in records:
                    if r["_t0"] <= t < r["_end"]:
                        kind = r["kind"]
                        r["steps_redone"] = r.get("steps_redone", 0) + 1
                redone_by[kind] = redone_by.get(kind, 0) + 1
                if kind in cf.PLANNED or kind == "down":
                    inv.fail("no_step_lost_on_planned_leave", f"step {step} redone by generation {gen}, which "
                             f"began during {kind}")
            result["steps_redone_by_fault"] = redone_by
            result["stopped_early"] = stalled
        except Exception as e:  # noqa: BLE001 - reported, then the cleanup below runs
            result["error"] = f"{type(e).__name__}: {e}"
            log(result["error"], quiet)
        finally:
            watch.stop()
            cf.undo_everything(ctx)
            with contextlib.suppress(Exception):
                if job_pids(job) or any(os.path.exists(f"/proc/{p}") for p in pids_seen.values()):
                    eltctl("down", "--force", timeout=240)
            for pid in job_pids(job):
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            for pid in pids_seen.values():  # a controller or keeper that outlived `down --force`
                with contextlib.suppress(OSError):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if b"eltctl.controller" in cmd or b"eltctl.storekeeper" in cmd:
                        os.kill(pid, 9)
            if keep:  # the hosts' logs outlive the test bed
                for f in Path(bed.dir).glob(f"*/home/.eltctl/jobs/{job}/*/**/*.log"):
                    dest = root / "host-logs" / f.relative_to(bed.dir)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with contextlib.suppress(OSError):
                        shutil.copy(f, dest)
            problems = cf.unmount_all(ctx)
            if problems:
                result["unmount_problems"] = problems
    if phase_reached:
        # The audit, once every worker is gone (`down` may have left some training): exactly-once.
        final_step = watch.max_step()
        figures = audit_figures(audit, final_step) if audit.exists() else {"exactly_once": False,
                                                                            "exactly_once_error": "no audit"}
        result.update({k: v for k, v in figures.items() if k != "steps_lost"})
        result["steps_redone"] = figures.get("steps_lost")
        if not figures.get("exactly_once"):
            inv.fail("exactly_once", figures.get("exactly_once_error") or "no audit")
    result["total_s"] = round(time.monotonic() - started, 1)
    counts = {k: 0 for k in cf.KINDS if k in kinds}
    pauses: dict[str, list[float]] = {}
    for r in records:
        counts[r["kind"]] += 1
        if r.get("pause_s") is not None:
            pauses.setdefault(r["kind"], []).append(r["pause_s"])
    result["faults"] = counts
    result["faults_total"] = len(records)
    result["pause_s"] = {k: {"n": len(v), "median": round(statistics.median(v), 2), "max": round(max(v), 2)}
                         for k, v in pauses.items()}
    result["timeline"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in records]
    result["invariants"] = inv.as_json()
    result["ok"] = inv.ok() and "error" not in result
    if keep:
        result["kept"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def parse_faults(text: str) -> list[str]:
    if text.strip() in ("", "all"):
        return list(cf.KINDS)
    out = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in out if k not in cf.KINDS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown fault kind(s) {', '.join(bad) or '(none given)'}; "
                                         f"choose from {', '.join(cf.KINDS)} (comma-separated) or all")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", type=parse_faults, default=list(cf.KINDS),
                    help=f"comma-separated fault kinds (default all: {','.join(cf.KINDS)})")
    ap.add_argument("--bound", type=float, default=120.0,
                    help="seconds the step may stand still after a fault's recovery (default 120)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--keep", action="store_true", help="keep the run's directory (logs, audit, mirror)")
    args = ap.parse_args(argv)
    if args.hosts < 2:
        ap.error("--hosts must be at least 2 (a host crash must leave one host training)")
    r = run(args.minutes, args.hosts, args.gpus, args.seed, args.faults, args.bound, args.keep, quiet=args.json)
    code = 0 if r["ok"] else (2 if "error" in r and not r.get("faults_total") else 1)
    if args.json:
        print(json.dumps(r))
        return code
    print(f"chaos: {r['minutes']:g} min on {r['hosts']} hosts x {r['gpus_per_host']} GPUs (seed {r['seed']}), "
          f"{r['total_s']:.0f} s in all")
    if r.get("error"):
        print(f"  error: {r['error']}")
    print(f"  faults injected ({r.get('faults_total', 0)}): "
          + ", ".join(f"{k} {n}" for k, n in r.get("faults", {}).items()))
    print("  pause per fault kind (longest stretch without a committed step, s):")
    for k, p in r.get("pause_s", {}).items():
        print(f"    {k:16} median {p['median']:7.2f}  max {p['max']:7.2f}  (n={p['n']})")
    for t in r.get("timeline", ()):
        print(f"    t={t['t']:7.1f} s  {t['kind']:16} {t['where']:8} held {t['held_s']} s, pause {t.get('pause_s')} s"
              + (f", {t['steps_redone']} step(s) redone" if t.get("steps_redone") else "")
              + (f"  ({t['note']})" if t.get("note") else ""))
    print(f"  longest stretch without a committed step during the faults: {r.get('longest_stall_s')} s")
    print(f"  steps committed: {r.get('committed_steps')} in {r.get('generations')} generations; redone: "
          f"{r.get('steps_redone')} {r.get('steps_redone_by_fault') or ''}")
    if r.get("down_exit"):
        print(f"  `eltctl down` exited {r['down_exit']}:")
        print("    " + r.get("down_output", "").strip().replace("\n", "\n    "))
    if r.get("stopped_early"):
        print(f"  fault phase stopped early: {r['stopped_early']}")
    for name, v in r["invariants"].items():
        print(f"  {name:30} " + ("held" if v["held"] else f"BROKEN ({v['violations']}x): {v['first_violation']}"))
    print(f"  {'PASS' if r['ok'] else 'FAIL'}")
    return code


if __name__ == "__main__":
    sys.exit(main())

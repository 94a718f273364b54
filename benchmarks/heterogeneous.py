"""The mixed-hardware benchmark: speed-proportional shares against equal shares, in one run.

    .venv/bin/python benchmarks/heterogeneous.py [--json] [--per-sample 0.008] [--steps 60] [--save out.json]

Three workers of examples/train.py (the small toy model, global batch 42, one
torch thread each) whose compute per sample is made to differ by a sleep per
sample (`--slow-per-sample`), so that the 2 cores of the machine do not blur
the ratios. One run measures:

- `balanced`: speeds 1 : 1 : 1/3 (sleeps s, s, 3s per sample), balancing on
  (the default): samples/s of the job (global batch / median step time after
  `--warmup` steps, from the workers' per-step log);
- `equal`: the same workers with equal shares (`--no-balance`);
- `alone`: each kind of worker alone (world size 1, the same global batch):
  its own samples/s; the ideal is their sum over the three workers;
- `slowdown`: three workers at speed 1, balancing on, one of them 4x slower
  from step `--slowdown-at` on: the steps from the slowdown until the split
  (rank 0's audit lines) stays within one sample per rank of its final value
  (`settle_steps`; one sample is the split's granularity), and until its last
  change (`last_change_steps`: a late one-sample refinement when noise first
  shows a split better by more than the dead band), every change with its step,
  and samples/s once settled against that case's ideal (2 fast + 1 slow
  worker, from `alone`).

Targets: balanced >= 2x equal; balanced >= 0.9 of the ideal; the split settles
within 20 steps of the slowdown.
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
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
from _eltctl_side import _Launcher  # noqa: E402

BATCH = 42  # 1 : 1 : 1/3 splits it exactly: 18, 18, 6
MODEL = ["--hidden", "32", "--layers", "2", "--samples", "8400", "--batch", str(BATCH), "--optimizer", "sgd",
         "--lr", "0.01"]
SPEEDUP_TARGET = 2.0
IDEAL_TARGET = 0.9
SETTLE_TARGET = 20


def run_job(per_sample: Sequence[str | float], steps: int, *, extra: Sequence[str] = (),
            per_worker: Sequence[Sequence[str]] | None = None, timeout_s: float = 300.0) -> dict[str, Any]:
    """One fixed-size job, a worker per entry of `per_sample` (its seconds of
    sleep per sample); returns the commit times and rank 0's splits per step."""
    wd = Path(tempfile.mkdtemp(prefix="eltctl-hetero-"))
    audit = wd / "audit.jsonl"
    la = _Launcher(wd, [*MODEL, "--steps", str(steps), "--threads", "1", *extra], min_workers=len(per_sample),
                   threads=1)
    try:
        for i, s in enumerate(per_sample):
            la.start(["--slow-per-sample", str(s), *(per_worker[i] if per_worker else ())],
                     env={"ELTCTL_AUDIT": str(audit)})
        la.wait(lambda: all(p.poll() is not None for _, p, _ in la.procs), timeout_s, f"{steps} steps")
        if any(p.returncode != 0 for _, p, _ in la.procs):
            raise RuntimeError(f"a worker failed; logs in {wd}")
        _, _, path0 = la.procs[0]
        times = {}
        for line in path0.read_text().splitlines():
            step, _gen, _world, t, _loss = line.split()
            times[int(step)] = float(t)
        splits = {}
        for line in audit.read_text().splitlines():
            r = json.loads(line)
            if r["rank"] == 0:
                splits[r["step"]] = r["split"]
        return {"times": times, "splits": splits}
    finally:
        la.close()


def samples_per_s(times: dict[int, float], first: int, last: int | None = None) -> float | None:
    """Global batch / median step time over steps first..last."""
    last = max(times) if last is None else last
    dts = [times[k] - times[k - 1] for k in range(first + 1, last + 1) if k in times and k - 1 in times]
    return round(BATCH / statistics.median(dts), 2) if dts else None


def settle_steps(splits: dict[int, list[int]], slowdown_at: int) -> tuple[int | None, int]:
    """(settled, last_change): steps from the first step run at the new speed
    (slowdown_at + 1) until the split stays within one sample per rank of the
    final split for good (a sample is the split's granularity), and until its
    last change (0: never changed)."""
    first = slowdown_at + 1
    steps = [k for k in sorted(splits) if k >= first]
    if not steps:
        return None, 0
    final = splits[steps[-1]]
    near = [all(abs(a - b) <= 1 for a, b in zip(splits[k], final)) for k in steps]
    settled = next((i for i in range(len(steps)) if all(near[i:])), None)
    changes = [k for k in steps if k > first and k - 1 in splits and splits[k] != splits[k - 1]]
    return (steps[settled] - first if settled is not None else None), (changes[-1] - first if changes else 0)


def run(*, per_sample: float, steps: int, warmup: int, slowdown_at: int, progress=print) -> dict[str, Any]:
    s = per_sample
    load_before = os.getloadavg()
    out: dict[str, Any] = {"batch": BATCH, "per_sample_s": s, "steps": steps, "warmup": warmup}
    progress("balanced: speeds 1 : 1 : 1/3 ...")
    bal = run_job([s, s, 3 * s], steps)
    progress("equal shares: speeds 1 : 1 : 1/3, --no-balance ...")
    eq = run_job([s, s, 3 * s], steps, extra=["--no-balance"])
    alone_steps = max(8, warmup // 2 + 6)
    progress("alone: a fast worker, then a slow one ...")
    fast = run_job([s], alone_steps)
    slow = run_job([3 * s], alone_steps)
    fast_sps = samples_per_s(fast["times"], 3)
    slow_sps = samples_per_s(slow["times"], 3)
    ideal = round(2 * fast_sps + slow_sps, 2) if fast_sps and slow_sps else None
    bal_sps = samples_per_s(bal["times"], warmup)
    eq_sps = samples_per_s(eq["times"], warmup)
    out["balanced"] = {"samples_per_s": bal_sps, "final_split": bal["splits"].get(steps),
                       "changes": [[k, bal["splits"][k]] for k in sorted(bal["splits"])
                                   if k - 1 in bal["splits"] and bal["splits"][k] != bal["splits"][k - 1]]}
    out["equal"] = {"samples_per_s": eq_sps, "final_split": eq["splits"].get(steps)}
    out["alone"] = {"fast_samples_per_s": fast_sps, "slow_samples_per_s": slow_sps, "ideal_samples_per_s": ideal}
    out["balanced_vs_equal"] = round(bal_sps / eq_sps, 3) if bal_sps and eq_sps else None
    out["balanced_vs_ideal"] = round(bal_sps / ideal, 3) if bal_sps and ideal else None

    progress(f"slowdown: three workers at speed 1, one 4x slower from step {slowdown_at} ...")
    slow_steps = slowdown_at + 40
    slow4 = 4 * s
    sd = run_job([s, s, s], slow_steps, per_worker=[(), (), ("--slow-at", f"{slowdown_at}={slow4}")])
    settled, last_change = settle_steps(sd["splits"], slowdown_at)
    # Ideal of this case: two fast workers and one 4x slower (its own speed, a quarter of a fast one's).
    ideal_sd = round(2 * fast_sps + fast_sps / 4, 2) if fast_sps else None
    after = samples_per_s(sd["times"], slowdown_at + 1 + (settled or 0) + 2)
    out["slowdown"] = {
        "at_step": slowdown_at, "settle_steps": settled, "last_change_steps": last_change,
        "split_before": sd["splits"].get(slowdown_at), "split_after": sd["splits"].get(slow_steps),
        "changes": [[k, sd["splits"][k]] for k in sorted(sd["splits"])
                    if k - 1 in sd["splits"] and sd["splits"][k] != sd["splits"][k - 1]],
        "samples_per_s_before": samples_per_s(sd["times"], warmup, slowdown_at),
        "samples_per_s_settled": after, "ideal_samples_per_s": ideal_sd,
        "settled_vs_ideal": round(after / ideal_sd, 3) if after and ideal_sd else None,
    }
    out["targets"] = assess(out)
    out["machine"] = _report.machine(load_before)
    return out


def assess(res: dict) -> list[dict]:
    """The targets, met or not (None: no figure)."""
    def target(name: str, goal: str, value, ok) -> dict:
        return {"name": name, "goal": goal, "measured": value, "met": None if value is None else ok(value)}

    return [
        target("balanced vs equal shares (1 : 1 : 1/3)", f">= {SPEEDUP_TARGET:g}x", res["balanced_vs_equal"],
               lambda v: v >= SPEEDUP_TARGET),
        target("balanced vs ideal (sum of each worker's own samples/s)", f">= {IDEAL_TARGET:g}",
               res["balanced_vs_ideal"], lambda v: v >= IDEAL_TARGET),
        target("steps until the split settles after a 4x slowdown", f"<= {SETTLE_TARGET}",
               res["slowdown"]["settle_steps"], lambda v: v <= SETTLE_TARGET),
    ]


def render(res: dict) -> str:
    lines = [f"global batch {res['batch']}, {res['per_sample_s'] * 1000:g} ms per sample on a fast worker",
             f"balanced  {res['balanced']['samples_per_s']} samples/s  split {res['balanced']['final_split']}",
             f"equal     {res['equal']['samples_per_s']} samples/s  split {res['equal']['final_split']}",
             f"ideal     {res['alone']['ideal_samples_per_s']} samples/s  (fast alone "
             f"{res['alone']['fast_samples_per_s']}, slow alone {res['alone']['slow_samples_per_s']})",
             f"slowdown  settled in {res['slowdown']['settle_steps']} steps (last change after "
             f"{res['slowdown']['last_change_steps']}): {res['slowdown']['split_before']} -> "
             f"{res['slowdown']['split_after']}, {res['slowdown']['samples_per_s_settled']} samples/s "
             f"(ideal {res['slowdown']['ideal_samples_per_s']})", ""]
    for t in res["targets"]:
        mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        lines.append(f"{t['name']}: {t['measured']} (target {t['goal']}): {mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--per-sample", type=float, default=0.008, help="seconds of sleep per sample, fast worker")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=12, help="steps left out of the samples/s")
    ap.add_argument("--slowdown-at", type=int, default=20)
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON object to this file")
    a = ap.parse_args(argv)
    t0 = time.time()
    res = run(per_sample=a.per_sample, steps=a.steps, warmup=a.warmup, slowdown_at=a.slowdown_at,
              progress=_report.say)
    res["wall_s"] = round(time.time() - t0, 1)
    return _report.emit(res, as_json=a.json, save=a.save, render=render)


if __name__ == "__main__":
    sys.exit(main())

"""The resize benchmark: eltctl's runtime against torchrun elastic and plain DDP, in one run.

    .venv/bin/python benchmarks/resize.py [--json] [--rounds 3] [--threads 1] [--cap 120] [--save out.json]
                                          [--no-restart-mode] [--base DIR] [--event-repeats N]

One run measures, on this machine (gloo on loopback, CPU):

- membership events on a 3-worker job, eltctl (`_eltctl_side.measure_eltctl`)
  and torchrun c10d elastic (`_baselines.measure_torchrun`): a planned leave,
  a warm join and a SIGKILL of one worker. For each: the pause (last step
  completed at the old size to the first completed at the new size, from every
  worker's per-step log), steps lost (committed before and done again after),
  and the ratio torchrun pause / eltctl pause (`--event-repeats N`: eltctl's events
  N times, each pause the median; with `--base`, that revision's in turns with this
  one's);
- the same events for eltctl's restart mode (`_restart_side.measure_restart`):
  torchrun's own worker script, unmodified, run by restart-mode supervisors
  (`python -m eltctl_runtime.restart`), with its pause, steps lost and the
  ratio torchrun pause / restart-mode pause;
- the steady-state step time at a fixed world size of 2, eltctl
  (`measure_eltctl_step_time`) against plain DDP (`measure_ddp_step_time`),
  `--rounds` alternating rounds (the order flips each round), each giving a
  ratio of median step times; the overhead is the median of those ratios,
  because the machine is shared and noisy. Each round also runs eltctl with
  one all-reduce after backward (`--bucket-mb 0`) for comparison with the
  default bucketed all-reduce overlapped with backward;
- the targets: planned leave <= 0.5 s, warm join <= 1 s, SIGKILL <= 3 s,
  0 steps lost on a planned leave, pauses >= 20x shorter than torchrun's,
  steady-state overhead <= 3 % over DDP; restart mode: <= 10 s per event and
  >= 4x shorter than torchrun's.

Both sides train the same thing: examples/toy.py's ~3.2 M parameter MLP, 8192
samples, global batch 64 split over the ranks, SGD lr 0.01, `--threads` torch
threads per worker, one step = forward, backward, gradient all-reduce,
optimizer step, one log line. torchrun runs with `--nnodes=1:3
--nproc-per-node=1 --rdzv-backend=c10d --max-restarts=100`, a checkpoint every
20 steps (events fire 10 steps past one), and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
with torch's default (a rendezvous store shared with the workers and kept
across rounds) a re-rendezvous hangs here (see _baselines._Job.start_agent).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
from _baselines import measure_ddp_step_time, measure_torchrun  # noqa: E402
from _eltctl_side import base_env, measure_eltctl, measure_eltctl_step_time  # noqa: E402
from _restart_side import measure_restart  # noqa: E402

EVENTS = ("leave", "join", "kill")
EVENT_NAMES = {"leave": "planned leave", "join": "warm join", "kill": "SIGKILL"}
PAUSE_TARGET_S = {"leave": 0.5, "join": 1.0, "kill": 3.0}
SPEEDUP_TARGET = 20.0
RESTART_PAUSE_TARGET_S = 10.0
RESTART_SPEEDUP_TARGET = 4.0
OVERHEAD_TARGET = 0.03


@dataclass(frozen=True)
class Target:
    name: str
    goal: str
    measured: str
    met: bool | None  # None: no figure to judge

    def to_dict(self) -> dict:
        return {"name": self.name, "goal": self.goal, "measured": self.measured, "met": self.met}


def _event(side: dict, name: str) -> dict:
    return next((e for e in side.get("events", []) if e.get("event") == name), {})


def event_rows(eltctl: dict, torchrun: dict, restart: dict | None = None) -> list[dict]:
    """One row per event: the pauses, the ratios to torchrun and the steps lost."""
    rows = []
    for ev in EVENTS:
        e, t, r = _event(eltctl, ev), _event(torchrun, ev), _event(restart or {}, ev)
        pe, pt, pr = e.get("pause_s"), t.get("pause_s"), r.get("pause_s")
        rows.append({
            "restart_pause_s": pr, "restart_ratio": round(pt / pr, 1) if pr and pt else None,
            "restart_steps_lost": r.get("steps_lost"),
            "restart_error": (r.get("error") or (None if r.get("resumed", bool(r)) else "did not resume"))
            if restart is not None else None,
            "event": ev, "eltctl_pause_s": pe, "eltctl_runtime_pause_s": e.get("runtime_pause_s"),
            "torchrun_pause_s": pt, "ratio": round(pt / pe, 1) if pe and pt else None,
            "eltctl_steps_lost": e.get("steps_lost"), "torchrun_steps_lost": t.get("steps_lost"),
            "eltctl_error": e.get("error") or (None if e.get("resumed", bool(e)) else "did not resume"),
            "torchrun_error": t.get("error"),
        })
    return rows


def median_events(runs: list[dict]) -> dict:
    """Several runs of one side's events (measure_eltctl) as one: per event the median
    pause (and runtime pause) over the runs that resumed, the most steps lost in any,
    and every run's pause (`pause_samples`, None where one did not resume). One run
    is returned as it is. Pure."""
    if len(runs) == 1:
        return runs[0]
    events = []
    for ev in EVENTS:
        got = [_event(r, ev) for r in runs]
        ok = [e for e in got if e.get("pause_s") is not None]
        row: dict[str, Any] = {"event": ev, "pause_samples": [e.get("pause_s") for e in got]}
        if ok:
            row |= {"resumed": True, "pause_s": round(statistics.median(e["pause_s"] for e in ok), 4),
                    "steps_lost": max(e.get("steps_lost") or 0 for e in ok)}
            rt = [e["runtime_pause_s"] for e in ok if e.get("runtime_pause_s") is not None]
            row["runtime_pause_s"] = round(statistics.median(rt), 4) if rt else None
        else:
            row |= {"resumed": False, "error": next((r.get("error") for r in runs if r.get("error")), None)}
        events.append(row)
    return {"system": "eltctl", "events": events, "runs": runs}


def overhead(pairs: list[dict], side: str = "eltctl") -> dict:
    """Median over rounds of (`side` median step) / (DDP median step) - 1."""
    ok = [p for p in pairs if p.get(side, {}).get("median_step_s") and p["ddp"].get("median_step_s")]
    ratios = [p[side]["median_step_s"] / p["ddp"]["median_step_s"] for p in ok]
    if not ratios:
        return {"rounds": len(pairs), "ratios": [], "median_ratio": None, "overhead": None}
    med = statistics.median(ratios)
    return {"rounds": len(pairs), "ratios": [round(r, 4) for r in ratios], "median_ratio": round(med, 4),
            "overhead": round(med - 1.0, 4),
            "eltctl_median_step_s": round(statistics.median(p[side]["median_step_s"] for p in ok), 5),
            "ddp_median_step_s": round(statistics.median(p["ddp"]["median_step_s"] for p in ok), 5)}


def assess(rows: list[dict], steady: dict) -> list[Target]:
    """The targets, met or not, from the figures (pure)."""
    out = []
    by = {r["event"]: r for r in rows}
    for ev in EVENTS:
        p = by[ev]["eltctl_pause_s"]
        out.append(Target(f"{EVENT_NAMES[ev]} pause", f"<= {PAUSE_TARGET_S[ev]:g} s",
                          "n/a" if p is None else f"{p:.3f} s", None if p is None else p <= PAUSE_TARGET_S[ev]))
    lost = by["leave"]["eltctl_steps_lost"]
    out.append(Target("steps lost on a planned leave", "0", "n/a" if lost is None else str(lost),
                      None if lost is None else lost == 0))
    for ev in EVENTS:
        r = by[ev]["ratio"]
        out.append(Target(f"{EVENT_NAMES[ev]}: shorter than torchrun", f">= {SPEEDUP_TARGET:g}x",
                          "n/a" if r is None else f"{r:g}x", None if r is None else r >= SPEEDUP_TARGET))
    for ev in EVENTS:
        p, r = by[ev].get("restart_pause_s"), by[ev].get("restart_ratio")
        out.append(Target(f"restart mode: {EVENT_NAMES[ev]} pause", f"<= {RESTART_PAUSE_TARGET_S:g} s",
                          "n/a" if p is None else f"{p:.2f} s", None if p is None else p <= RESTART_PAUSE_TARGET_S))
        out.append(Target(f"restart mode: {EVENT_NAMES[ev]} vs torchrun", f">= {RESTART_SPEEDUP_TARGET:g}x",
                          "n/a" if r is None else f"{r:g}x", None if r is None else r >= RESTART_SPEEDUP_TARGET))
    o = steady.get("overhead")
    out.append(Target("steady-state overhead vs DDP", f"<= {OVERHEAD_TARGET:.0%}",
                      "n/a" if o is None else f"{o:+.1%}", None if o is None else o <= OVERHEAD_TARGET))
    return out


def run(*, rounds: int, threads: int, cap_s: float, steady_steps: int, progress=print,
        restart_mode: bool = True, base: Path | None = None, event_repeats: int = 1) -> dict[str, Any]:
    started = time.time()
    load_before = os.getloadavg()
    benv = base_env(base)
    sides = {"eltctl": None} | ({"eltctl_base": benv} if benv is not None else {})
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(event_repeats):  # with --base, the two trees in turns, the order flipping each turn
        for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            progress(f"eltctl{f' at {base} (--base)' if side == 'eltctl_base' else ''}: leave, join, SIGKILL "
                     f"on 3 workers" + (f" (turn {i + 1} of {event_repeats})" if event_repeats > 1 else "") + " ...")
            try:
                runs[side].append(measure_eltctl(EVENTS, nodes=3, threads=threads, event_cap_s=cap_s,
                                                 env=sides[side]))
            except TimeoutError as e:  # a figure missing is reported, not a crash of the whole run
                runs[side].append({"system": "eltctl", "error": str(e), "events": []})
    eltctl = median_events(runs["eltctl"])
    eltctl_base = median_events(runs["eltctl_base"]) if benv is not None else None
    progress("torchrun c10d elastic: leave, join, SIGKILL on 3 agents ...")
    torchrun = measure_torchrun(EVENTS, nodes=3, threads=threads, event_cap_s=cap_s)
    restart = None
    if restart_mode:
        progress("eltctl restart mode (torchrun's script, unmodified): leave, join, SIGKILL on 3 workers ...")
        restart = measure_restart(EVENTS, nodes=3, threads=threads, event_cap_s=cap_s)
    pairs = []
    for i in range(rounds):
        progress(f"steady state, round {i + 1} of {rounds}: eltctl and DDP at world size 2 ...")
        order = ("eltctl", "eltctl_one_bucket", "ddp") if i % 2 == 0 else ("ddp", "eltctl_one_bucket", "eltctl")
        if benv is not None:  # the base revision beside this one, its place alternating too
            order = ("eltctl", "eltctl_base", "ddp") if i % 2 == 0 else ("ddp", "eltctl_base", "eltctl")
        pair = {}
        for side in order:
            if side == "eltctl":
                pair[side] = measure_eltctl_step_time(2, steady_steps, threads=threads)
            elif side == "eltctl_base":
                pair[side] = measure_eltctl_step_time(2, steady_steps, threads=threads, env=benv)
            elif side == "eltctl_one_bucket":  # the all-reduce after backward, for comparison
                pair[side] = measure_eltctl_step_time(2, steady_steps, threads=threads, extra_args=("--bucket-mb", "0"))
            else:
                pair[side] = measure_ddp_step_time(2, steady_steps, threads=threads)
        pair["order"] = list(order)
        pairs.append(pair)
    rows = event_rows(eltctl, torchrun, restart)
    steady = overhead(pairs)
    steady["one_bucket"] = overhead(pairs, "eltctl_one_bucket")
    if eltctl_base is not None:
        steady["base"] = overhead(pairs, "eltctl_base")
        steady["base"]["tree"] = str(base)
        by_base = {e["event"]: e for e in eltctl_base.get("events", [])}
        for r in rows:  # this tree's pause beside the base's, measured in this run
            b = by_base.get(r["event"], {})
            r["base_pause_s"] = b.get("pause_s")
            r["base_steps_lost"] = b.get("steps_lost")
            if "pause_samples" in b:
                r["base_pause_samples"] = b["pause_samples"]
    if event_repeats > 1:
        for r in rows:
            r["eltctl_pause_samples"] = _event(eltctl, r["event"]).get("pause_samples")
    return {
        "machine": _report.machine(load_before, started),
        "event_repeats": event_repeats,
        "workload": {"model": "examples/toy.py MLP (64-1024-1024-1024-16, ~3.2 M parameters)",
                     "samples": 8192, "global_batch": 64, "optimizer": "SGD lr 0.01",
                     "threads_per_worker": threads, "event_world": 3, "steady_world": 2,
                     "steady_steps": steady_steps, "steady_warmup_discarded": 30},
        "torchrun_settings": dict(torchrun.get("settings", {}),
                                  env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                                  args="--nnodes=1:3 --nproc-per-node=1 --rdzv-backend=c10d --max-restarts=100"),
        "events": rows,
        "steady": steady,
        "steady_rounds": pairs,
        "targets": [t.to_dict() for t in assess(rows, steady)],
        "raw": {"eltctl": eltctl, "torchrun": torchrun, "restart": restart, "eltctl_base": eltctl_base},
    }


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.3f}{unit}"
    return f"{x}{unit}"


def render(res: dict) -> str:
    m, w, ts = res["machine"], res["workload"], res["torchrun_settings"]
    lines = [
        f"eltctl resize benchmark, {m['started']} ({m['duration_s']:.0f} s), {m['cpus']} CPUs, "
        f"load average {m['loadavg_before'][0]:.2f} before / {m['loadavg_after'][0]:.2f} after, "
        f"python {m['python']}, torch {m['torch']}",
        f"workload (both sides): {w['model']}, {w['samples']} samples, global batch {w['global_batch']}, "
        f"{w['optimizer']}, {w['threads_per_worker']} thread(s) per worker; events on {w['event_world']} workers",
        f"torchrun: {ts['args']} --rdzv-conf={ts.get('rdzv_conf', 'defaults')}, checkpoint every "
        f"{ts.get('ckpt_every')} steps (events 10 steps past one), TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
        "(torch's default hangs a re-rendezvous here)",
        "",
        f"{'event':<14} {'eltctl pause':>13} {'(runtime)':>10} {'torchrun pause':>15} {'ratio':>8} "
        f"{'eltctl lost':>12} {'torchrun lost':>14} {'restart pause':>14} {'ratio':>8} {'restart lost':>13}",
    ]
    for r in res["events"]:
        ratio = f"{r['ratio']:g}x" if r["ratio"] else "n/a"
        rratio = f"{r['restart_ratio']:g}x" if r.get("restart_ratio") else "n/a"
        lines.append(f"{EVENT_NAMES[r['event']]:<14} {_fmt(r['eltctl_pause_s'], ' s'):>13} "
                     f"{_fmt(r['eltctl_runtime_pause_s'], ' s'):>10} {_fmt(r['torchrun_pause_s'], ' s'):>15} "
                     f"{ratio:>8} {_fmt(r['eltctl_steps_lost']):>12} {_fmt(r['torchrun_steps_lost']):>14} "
                     f"{_fmt(r.get('restart_pause_s'), ' s'):>14} {rratio:>8} {_fmt(r.get('restart_steps_lost')):>13}")
        for side in ("eltctl", "torchrun", "restart"):
            if r.get(f"{side}_error"):
                lines.append(f"  {side}: {r[f'{side}_error']}")
    s = res["steady"]
    lines += ["", f"steady state at world size {w['steady_world']} ({w['steady_steps']} steps per run, first "
                  f"{w['steady_warmup_discarded']} discarded), {s['rounds']} alternating rounds:"]
    other = "eltctl_base" if s.get("base") else "eltctl_one_bucket"
    for i, p in enumerate(res["steady_rounds"]):
        e, o, d = (p.get(k, {}).get("median_step_s") for k in ("eltctl", other, "ddp"))
        ratio = f"{e / d:.3f}" if e and d else "n/a"
        ratio_o = f"{o / d:.3f}" if o and d else "n/a"
        lines.append(f"  round {i + 1} ({', '.join(p['order'])}): eltctl {_fmt(e, ' s')}, "
                     f"{'base' if other == 'eltctl_base' else 'one-bucket'} "
                     f"{_fmt(o, ' s')}, DDP {_fmt(d, ' s')}; ratios {ratio}, {ratio_o}"
                     + "".join(f"  [{k}: {p[k]['error'][:120]}]" for k in ("eltctl", other, "ddp")
                               if p.get(k, {}).get("error")))
    if s.get("median_ratio") is not None:
        lines.append(f"  median step: eltctl {s['eltctl_median_step_s']:.4f} s, DDP {s['ddp_median_step_s']:.4f} s; "
                     f"median ratio {s['median_ratio']:.3f} (overhead {s['overhead']:+.1%})")
    ob = s.get("one_bucket") or {}
    if ob.get("median_ratio") is not None:
        lines.append(f"  for comparison, eltctl with one all-reduce after backward (--bucket-mb 0): median ratio "
                     f"{ob['median_ratio']:.3f} (overhead {ob['overhead']:+.1%})")
    b = s.get("base") or {}
    if b.get("median_ratio") is not None:
        lines.append(f"  the base revision ({b['tree']}), same rounds: median step {b['eltctl_median_step_s']:.4f} s; "
                     f"median ratio {b['median_ratio']:.3f} (overhead {b['overhead']:+.1%})")
        lines.append("  pauses, this tree / base: " + ", ".join(
            f"{EVENT_NAMES[r['event']]} {_fmt(r['eltctl_pause_s'], ' s')} / {_fmt(r.get('base_pause_s'), ' s')}"
            for r in res["events"]))
        if res.get("event_repeats", 1) > 1:
            lines.append(f"  (medians of {res['event_repeats']} runs each, in turns; every run's pause, this tree / base: "
                         + "; ".join(f"{EVENT_NAMES[r['event']]} {r.get('eltctl_pause_samples')} / "
                                     f"{r.get('base_pause_samples')}" for r in res["events"]) + ")")
    lines += ["", f"{'target':<38} {'goal':>10} {'measured':>12}  status"]
    for t in res["targets"]:
        status = "met" if t["met"] else ("n/a" if t["met"] is None else "NOT met")
        lines.append(f"{t['name']:<38} {t['goal']:>10} {t['measured']:>12}  {status}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--rounds", type=int, default=3, help="alternating eltctl/DDP steady-state pairs")
    ap.add_argument("--steady-steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (both sides)")
    ap.add_argument("--cap", type=float, default=120.0, help="seconds to wait for each event to settle")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON object to this file")
    ap.add_argument("--no-restart-mode", action="store_true", help="leave out the restart-mode column")
    ap.add_argument("--event-repeats", type=int, default=1,
                    help="run the events this many times (with --base, the two trees in turns) and report each "
                         "pause's median: one pause of 0.05-0.15 s varies by half from run to run here")
    ap.add_argument("--base", type=Path, default=None,
                    help="a checkout of another revision (git worktree add DIR REV): its runtime runs beside this "
                         "one's, in the same run (events and alternating steady rounds)")
    a = ap.parse_args(argv)
    res = run(rounds=a.rounds, threads=a.threads, cap_s=a.cap, steady_steps=a.steady_steps, progress=_report.say,
              restart_mode=not a.no_restart_mode, base=a.base, event_repeats=max(1, a.event_repeats))
    return _report.emit(res, as_json=a.json, save=a.save, render=render)


if __name__ == "__main__":
    sys.exit(main())

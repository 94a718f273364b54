"""The control plane's cost on the hot path: resize pauses and steady step time, in one run.

    .venv/bin/python benchmarks/control_plane.py [--json] [--rounds 2] [--steady-steps 200]
                                                 [--before PATH_TO_A_CHECKOUT_OF_AN_OLDER_ELTCTL]

Issue 21 moved the job's store from a c10d TCPStore to eltctl's own store on a Unix
socket (runtime/sockstore.py, a Python client), put a run id into every signature and
signed the process groups' rendezvous (runtime/pgstore.py). This measures what that
costs where it could show: the pause of a planned leave, a warm join and a SIGKILL on
a 3-worker job (benchmarks/_eltctl_side.py `measure_eltctl`), and the steady step
time at world size 2 (`measure_eltctl_step_time`), for

- `c10d`: this tree's runtime on a c10d TCPStore, unsigned (the resize benchmark's setup);
- `c10d-signed`: the same on a c10d TCPStore with every value signed in a run (the
  previous main's production setup, as far as the store goes);
- `socket`: this tree's runtime as the controller runs it: the Unix-socket store, every
  value signed in a run, the rendezvous signed;
- `before` (with `--before PATH`): PATH's runtime (e.g. a checkout of the previous main,
  with its own .venv) on its c10d TCPStore, unsigned, run with PATH/.venv/bin/python;
- `main` (with `--main PATH`): PATH's runtime (a checkout with the socket store, e.g. the
  main a change starts from, with its own .venv) measured by THIS tree's harness as
  `socket` is, so a change and its starting point are compared side by side.

`--configs` picks the configurations (default: all that apply).

`--phases` also times the parts of each pause (benchmarks/_phases/sitecustomize.py wraps
the runtime's functions from outside, in this tree and in `--before`'s alike, which is
not modified): from the last step at the old size, `detect` (to the boundary, or to the
abort being handled: for a kill, the kill itself and its detection), `plan` (the roll
call or the planned change: until the last rank starts forming the group), `group` (the
gloo rendezvous over the store), `pairs` (the signed pair handshake), `sync` (the state
agreement and transfer) and `step` (the first step at the new size), in ms, each the
median over rounds, on the critical path (the last rank to reach each mark).

Rounds alternate the order of the configurations (the machine is shared and noisy); each
figure is the median over rounds, and the ratios are socket / c10d and socket / before.
Targets (issue 21): pauses and steady step time within 10 % of before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _eltctl_side import measure_eltctl, measure_eltctl_step_time  # noqa: E402

EVENTS = ("leave", "join", "kill")


HERE = Path(__file__).resolve().parent


def _before(path: Path, what: str, steady_steps: int, store: str | None = None,
            workdir: Path | None = None) -> dict[str, Any]:
    """PATH's runtime, run with PATH/.venv/bin/python: with its own harness (`store` None),
    or with this tree's harness on `store`; `workdir`: the events' work directory (with
    --phases)."""
    harness = "benchmarks" if store is None else str(HERE)
    kw = ", ".join(([] if store is None else [f"store={store!r}"])
                   + ([] if workdir is None else [f"workdir=__import__('pathlib').Path({str(workdir)!r})"]))
    code = (f"import json, sys; sys.path.insert(0, {harness!r}); import _eltctl_side as s; "
            + (f"print(json.dumps(s.measure_eltctl({kw})))" if what == "events"
               else f"print(json.dumps(s.measure_eltctl_step_time(steps={steady_steps})))" if store is None
               else f"print(json.dumps(s.measure_eltctl_step_time(steps={steady_steps}, store={store!r})))"))
    out = subprocess.run([str(path / ".venv" / "bin" / "python"), "-c", code], cwd=path, capture_output=True,
                         text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


PHASES = ("detect", "plan", "group", "pairs", "sync", "step")


def _phase_env(wd: Path) -> dict[str, str]:
    """What the workers' environment needs for the phase marks (benchmarks/_phases)."""
    (wd / "phases").mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(HERE / "_phases"), os.environ.get("PYTHONPATH", "")) if p)
    return {"ELTCTL_PHASES": str(wd / "phases"), "PYTHONPATH": path}


def phase_breakdown(wd: Path, figures: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The parts of each pause of a measure_eltctl run in `wd` (the module docstring), in
    ms: {event: {phase: ms, "pause": ms, "resume": ms, "store_ops": n}}. The events are the
    runs of generations with commits, in order (a generation that aborted while forming has
    none); `figures`: measure_eltctl's events. `resume`: from the event (the kill, the
    leave request, the joiner's start) to the first step at the new size; for a kill,
    `detect` runs from the kill (the harness kills some time after the last old step:
    `until_event`), not from the last old step."""
    events = [f["event"] for f in figures]
    recs: list[tuple[float, int]] = []  # (time, generation) of every commit
    for path in wd.glob("w*.progress"):
        for line in path.read_text().splitlines():
            _step, gen, _world, t, _loss = line.split()
            recs.append((float(t), int(gen)))
    marks: list[dict] = []
    for path in (wd / "phases").glob("*.jsonl"):
        marks += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    gens = sorted({g for _, g in recs})
    out: dict[str, dict[str, float]] = {}
    for i, (a, b) in enumerate(zip(gens, gens[1:])):
        t0 = max(t for t, g in recs if g == a)
        t1 = min(t for t, g in recs if g == b)
        window = [m for m in marks if t0 < m["t"] <= t1 + 1e-3]

        def last(*names: str) -> float | None:
            ts = [m["t"] for m in window if m["mark"] in names]
            return max(ts) if ts else None

        def first(*names: str) -> float | None:
            ts = [m["t"] for m in window if m["mark"] in names]
            return min(ts) if ts else None

        start = first("change", "recover") or t0
        g0, g1 = last("group_start") or start, last("group_end") or start
        p1 = last("pairs_end") or g1
        s1 = last("sync_end") or p1
        ms = {"detect": start - t0, "plan": g0 - start, "group": g1 - g0, "pairs": p1 - g1, "sync": s1 - p1,
              "step": t1 - s1, "pause": t1 - t0}
        fig = figures[i] if i < len(figures) and len(gens) - 1 == len(figures) else {}
        resume = fig.get("event_to_first_new_step_s")
        if resume is not None:
            ms["resume"] = resume
            if fig["event"] == "kill":
                t_event = t1 - resume
                ms["until_event"] = t_event - t0
                ms["detect"] = start - t_event
        row = {k: round(v * 1000, 1) for k, v in ms.items()}
        row["store_ops"] = sum(n for m in window if m["mark"] == "group_end" for n, _s in m.get("ops", {}).values())
        out[events[i] if i < len(events) and len(gens) - 1 == len(events) else f"change{i + 1}"] = row
    return out


def _pauses(result: dict[str, Any]) -> dict[str, float | None]:
    return {e["event"]: e.get("pause_s") for e in result["events"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steady-steps", type=int, default=200, help="0: no steady step time")
    ap.add_argument("--before", type=Path, default=None, help="a checkout of an older eltctl with its .venv")
    ap.add_argument("--main", type=Path, default=None,
                    help="a checkout with the socket store (with its .venv), run by this tree's harness")
    ap.add_argument("--configs", default="", help="comma-separated: c10d, c10d-signed, socket, before, main")
    ap.add_argument("--phases", action="store_true", help="time the parts of each pause (module docstring)")
    args = ap.parse_args()

    configs = ["c10d", "c10d-signed", "socket"] + (["before"] if args.before else []) + (["main"] if args.main else [])
    if args.configs:
        configs = [c for c in configs if c in args.configs.split(",")]
    pauses: dict[str, dict[str, list[float]]] = {c: {e: [] for e in EVENTS} for c in configs}
    steady: dict[str, list[float]] = {c: [] for c in configs}
    parts: dict[str, dict[str, dict[str, list[float]]]] = {c: {} for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for c in order:
            wd = Path(tempfile.mkdtemp(prefix="eltctl-cp-")) if args.phases else None
            saved = dict(os.environ)
            if wd is not None:
                os.environ.update(_phase_env(wd))
            try:
                ev = (_before(args.before, "events", 0, workdir=wd) if c == "before"
                      else _before(args.main, "events", 0, "socket", workdir=wd) if c == "main"
                      else measure_eltctl(store=c, workdir=wd))
            finally:
                os.environ.clear()
                os.environ.update(saved)
            if wd is not None:
                for e, row in phase_breakdown(wd, ev["events"]).items():
                    for k, v in row.items():
                        parts[c].setdefault(e, {}).setdefault(k, []).append(v)
                print(f"round {r + 1} {c}: phases {phase_breakdown(wd, ev['events'])}",
                      file=sys.stderr, flush=True)
            for e, p in _pauses(ev).items():
                if p is not None:
                    pauses[c][e].append(p)
            st = ({} if args.steady_steps <= 0
                  else _before(args.before, "steady", args.steady_steps) if c == "before"
                  else _before(args.main, "steady", args.steady_steps, "socket") if c == "main"
                  else measure_eltctl_step_time(steps=args.steady_steps, store=c))
            if st.get("median_step_s"):
                steady[c].append(st["median_step_s"])
            print(f"round {r + 1} {c}: pauses {_pauses(ev)}, steady median {st.get('median_step_s')} s",
                  file=sys.stderr, flush=True)

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 4) if xs else None

    figures: dict[str, Any] = {"rounds": args.rounds, "configs": {}}
    for c in configs:
        figures["configs"][c] = {"pause_s": {e: med(pauses[c][e]) for e in EVENTS},
                                 "steady_median_step_s": med(steady[c]),
                                 "samples": {"pause_s": pauses[c], "steady": steady[c]}}
        if args.phases:
            figures["configs"][c]["phases_ms"] = {e: {k: med(v) for k, v in row.items()}
                                                  for e, row in parts[c].items()}
    for base in [b for b in ("c10d", "c10d-signed", "before", "main") if b in configs and "socket" in configs]:
        new, old = figures["configs"]["socket"], figures["configs"][base]
        ratio = {e: (round(new["pause_s"][e] / old["pause_s"][e], 3)
                     if new["pause_s"][e] and old["pause_s"][e] else None) for e in EVENTS}
        ratio["steady"] = (round(new["steady_median_step_s"] / old["steady_median_step_s"], 3)
                           if new["steady_median_step_s"] and old["steady_median_step_s"] else None)
        figures[f"socket_over_{base}"] = ratio
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for c in configs:
            f = figures["configs"][c]
            print(f"{c:>11}: leave {f['pause_s']['leave']} s, join {f['pause_s']['join']} s, "
                  f"kill {f['pause_s']['kill']} s, steady step {f['steady_median_step_s']} s")
            for e, row in f.get("phases_ms", {}).items():
                print(f"{'':>13}{e:>5} ms: " + ", ".join(f"{k} {row.get(k)}" for k in (*PHASES, "pause", "resume")))
        for base in [b for b in ("c10d", "c10d-signed", "before", "main") if b in configs and "socket" in configs]:
            print(f"socket / {base}: {figures[f'socket_over_{base}']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

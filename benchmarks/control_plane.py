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

Rounds alternate the order of the configurations (the machine is shared and noisy); each
figure is the median over rounds, and the ratios are socket / c10d and socket / before.
Targets (issue 21): pauses and steady step time within 10 % of before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _eltctl_side import measure_eltctl, measure_eltctl_step_time  # noqa: E402

EVENTS = ("leave", "join", "kill")


HERE = Path(__file__).resolve().parent


def _before(path: Path, what: str, steady_steps: int, store: str | None = None) -> dict[str, Any]:
    """PATH's runtime, run with PATH/.venv/bin/python: with its own harness (`store` None),
    or with this tree's harness on `store`."""
    harness = "benchmarks" if store is None else str(HERE)
    kw = "" if store is None else f"store={store!r}"
    code = (f"import json, sys; sys.path.insert(0, {harness!r}); import _eltctl_side as s; "
            + (f"print(json.dumps(s.measure_eltctl({kw})))" if what == "events"
               else f"print(json.dumps(s.measure_eltctl_step_time(steps={steady_steps}, {kw})))"))
    out = subprocess.run([str(path / ".venv" / "bin" / "python"), "-c", code], cwd=path, capture_output=True,
                         text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pauses(result: dict[str, Any]) -> dict[str, float | None]:
    return {e["event"]: e.get("pause_s") for e in result["events"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steady-steps", type=int, default=200)
    ap.add_argument("--before", type=Path, default=None, help="a checkout of an older eltctl with its .venv")
    ap.add_argument("--main", type=Path, default=None,
                    help="a checkout with the socket store (with its .venv), run by this tree's harness")
    ap.add_argument("--configs", default="", help="comma-separated: c10d, c10d-signed, socket, before, main")
    args = ap.parse_args()

    configs = ["c10d", "c10d-signed", "socket"] + (["before"] if args.before else []) + (["main"] if args.main else [])
    if args.configs:
        configs = [c for c in configs if c in args.configs.split(",")]
    pauses: dict[str, dict[str, list[float]]] = {c: {e: [] for e in EVENTS} for c in configs}
    steady: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for c in order:
            ev = (_before(args.before, "events", 0) if c == "before"
                  else _before(args.main, "events", 0, "socket") if c == "main" else measure_eltctl(store=c))
            for e, p in _pauses(ev).items():
                if p is not None:
                    pauses[c][e].append(p)
            st = (_before(args.before, "steady", args.steady_steps) if c == "before"
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
        for base in [b for b in ("c10d", "c10d-signed", "before", "main") if b in configs and "socket" in configs]:
            print(f"socket / {base}: {figures[f'socket_over_{base}']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

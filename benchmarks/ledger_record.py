"""Usage ledger benchmark: what recording costs the controller's loop.

Folds --passes observations (one every 0.5 s of a fake clock, as the loop does) of
--hosts hosts into a fresh usage.db, each host's daemon reporting 2 live workers and a
full history (200 ended workers), and prints the first pass (every history entry is
new: inserted) and the mean of the others (nothing new: what a steady job costs).
Target: a steady pass well under the loop's 0.5 s tick (a few ms for 20 hosts).

    .venv/bin/python benchmarks/ledger_record.py [--hosts 20] [--passes 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from eltctl.controller.observe import Observer, seen_state
from eltctl.inventory import parse_inventory
from eltctl.ledger.recorder import UsageRecorder
from eltctl_runtime.protocol import DAEMON_HISTORY_KEPT, history_entry


def measure(hosts: int, passes: int) -> dict:
    inv = parse_inventory('[job]\nname = "j"\ncommand = "python t.py"\n' + "".join(
        f'[[hosts]]\nname = "h{i}"\naddress = "h{i}.lab"\n' for i in range(hosts)), "hosts.toml")
    now = 1e9
    history = {f"h{i}": [history_entry(worker_id=f"h{i}/0/{k}", slot=0, start=now - 1000 + k, end=now - 999 + k,
                                       state="left", why="yield") for k in range(DAEMON_HISTORY_KEPT)]
               for i in range(hosts)}
    with tempfile.TemporaryDirectory() as d:
        rec = UsageRecorder(Path(d) / "usage.db", "j").open()
        obs = Observer()
        times = []
        for _ in range(passes):
            now += 0.5
            for i in range(hosts):
                name = f"h{i}"
                doc = {"time": now, "phase": "running", "health": "ok", "history": history[name],
                       "workers": [{"slot": s, "worker_id": f"{name}/{s}/9999", "state": "running", "start": 1e9}
                                   for s in range(2)],
                       "gpus": [{"index": s, "state": "ours"} for s in range(2)]}
                obs.seen[name] = seen_state(obs.seen.get(name), json.dumps(doc).encode(), now)
            t = time.perf_counter()
            rec.record(now, inv, obs, {})
            times.append(time.perf_counter() - t)
        rec.close(now)
    steady = times[1:]
    return {"hosts": hosts, "passes": passes, "first_pass_ms": round(times[0] * 1000, 2),
            "steady_pass_ms": round(sum(steady) / max(1, len(steady)) * 1000, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=20)
    ap.add_argument("--passes", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = measure(args.hosts, args.passes)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['hosts']} hosts, {DAEMON_HISTORY_KEPT} history entries each: first pass {r['first_pass_ms']} ms, "
              f"then {r['steady_pass_ms']} ms a pass (mean of {r['passes'] - 1})")


if __name__ == "__main__":
    main()

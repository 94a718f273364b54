"""Notifications benchmark: a dead endpoint must not change the controller's loop period.

Runs an asyncio loop shaped like the controller's (`Controller.run`: a pass, then a wait
of --tick seconds) whose every pass publishes a status document through the
controller's outputs (controller/outputs.py: the notification events it brings are
queued, `[controller] metrics_file` is rewritten). Every pass flips the job between
training and paused, so every pass brings an event (a flood: the worst case). Four
endpoints: none ([notify] unset), one that accepts and never answers, a closed port,
one answering 500. Prints each one's loop period (mean and max, ms) and the time the
outputs took per pass; target: the same period with every endpoint.

    .venv/bin/python benchmarks/notify_loop.py [--passes 100] [--tick 0.05] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from eltctl.controller.outputs import Outputs
from eltctl.controller.statedir import StateDir
from eltctl.inventory import parse_inventory


def serve(answer):
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            if answer == "hang":
                release.wait(600)
                return
            self.send_response(answer)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/hook", server, release


def closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/hook"


async def run_loop(outputs: Outputs, passes: int, tick: float) -> tuple[list[float], list[float]]:
    periods, costs = [], []
    last = time.monotonic()
    for i in range(passes):
        doc = {"job": "bench", "state": "paused" if i % 2 else "training", "phase": "training", "step": i,
               "world_size": 2, "hosts": [{"name": "a", "state": "running", "workers": 2}],
               "forged": {"total": 0}, "controller": {"alive": True}}
        t0 = time.monotonic()
        outputs.published(outputs.extend(doc), time.time())
        costs.append(time.monotonic() - t0)
        await asyncio.sleep(tick)
        now = time.monotonic()
        periods.append(now - last)
        last = now
    return periods, costs


def measure(endpoint: str | None, passes: int, tick: float, root: Path) -> dict:
    notify = f'[notify]\nwebhook = "{endpoint}"\ntimeout = "2s"\nretries = 3\n' if endpoint else ""
    text = ('[job]\nname = "bench"\ncommand = "python t.py"\n'
            f'[controller]\nmetrics_file = "{root}/bench.prom"\n{notify}[[hosts]]\nname = "a"\naddress = "local"\n')
    inv = parse_inventory(text, root / "hosts.toml")
    state = StateDir(root / "state")
    state.create()
    outputs = Outputs(inv, state)
    outputs.start()
    try:
        periods, costs = asyncio.run(run_loop(outputs, passes, tick))
        status = outputs.notifier.status()
    finally:
        outputs.notifier.record_path = None  # its directory goes away with the run
        outputs.stop(timeout=0.1)
    return {"period_ms_mean": round(statistics.mean(periods) * 1000, 2),
            "period_ms_max": round(max(periods) * 1000, 2),
            "outputs_ms_mean": round(statistics.mean(costs) * 1000, 3),
            "outputs_ms_max": round(max(costs) * 1000, 3),
            "queued": status["pending"], "delivered": status["delivered"], "failed": status["failed"],
            "dropped": status["dropped"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=100)
    ap.add_argument("--tick", type=float, default=0.05, help="the wait between passes (the controller's is 0.5 s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.getLogger("eltctl").setLevel(logging.CRITICAL)  # the failed attempts are the point, not news
    hang_url, hang_server, release = serve("hang")
    err_url, err_server, _ = serve(500)
    cases = {"no notify": None, "never answers": hang_url, "closed port": closed_port(), "HTTP 500": err_url}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, url) in enumerate(cases.items()):
            root = Path(tmp) / str(i)
            root.mkdir()
            results[name] = measure(url, args.passes, args.tick, root)
    release.set()
    hang_server.shutdown()
    err_server.shutdown()
    if args.json:
        print(json.dumps({"passes": args.passes, "tick_s": args.tick, "results": results}, indent=2))
        return
    print(f"{args.passes} passes, a wait of {args.tick * 1000:.0f} ms after each; every pass brings an event")
    print(f"{'endpoint':<15} {'period mean':>12} {'period max':>11} {'outputs mean':>13} {'outputs max':>12}"
          f" {'delivered':>10} {'failed':>7} {'queued':>7}")
    for name, r in results.items():
        print(f"{name:<15} {r['period_ms_mean']:>10.2f}ms {r['period_ms_max']:>9.2f}ms {r['outputs_ms_mean']:>11.3f}ms"
              f" {r['outputs_ms_max']:>10.3f}ms {r['delivered']:>10} {r['failed']:>7} {r['queued']:>7}")


if __name__ == "__main__":
    main()

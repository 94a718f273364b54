"""Benchmark: what the signed pair handshake (collectives.verify_pairs) adds to a new group.

A resize forms a new process group; the runtime then checks every pair of it with one
all-to-all of signed messages before any collective uses it (issue 21: gloo's listener
gives a pair to whoever connects first). This forms gloo groups of `world` ranks
(threads, each with its own store client, on a signed job store over a TCPStore in this
process, as the runtime's pgstore does) and prints, per world size, the median and max
over `--reps` formations of: the group's formation alone, the handshake alone, and
their sum (the slowest rank's wall time each).

    .venv/bin/python benchmarks/pair_handshake.py [--worlds 2 4 8] [--reps 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def form(port: int, secret: bytes, generation: int, world: int) -> tuple[float, float]:
    """One group of `world` ranks: (formation s, handshake s), the slowest rank's each."""
    import torch
    import torch.distributed as dist

    from eltctl_runtime.member import collectives
    from eltctl_runtime.member.plan import job_store
    from eltctl_runtime.store.pgstore import pg_store

    cpu = torch.device("cpu")
    times: dict[int, tuple[float, float]] = {}
    barrier = threading.Barrier(world)
    keep = []

    def rank(r: int) -> None:
        js = job_store(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)), "bench",
                       secret)
        store = pg_store(js, generation)
        barrier.wait()
        t0 = time.perf_counter()
        pg = collectives.make_group(store, r, world, cpu, "127.0.0.1")
        t1 = time.perf_counter()
        collectives.verify_pairs(pg, js, generation, collectives.group_id(f"bench {generation}"), r, world, cpu,
                                 threading.Event())
        t2 = time.perf_counter()
        times[r] = (t1 - t0, t2 - t1)
        keep.append((pg, store))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if len(times) != world:
        raise RuntimeError(f"a group of {world} did not form")
    return max(f for f, _ in times.values()), max(h for _, h in times.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    secret = secrets.token_bytes(32)
    rows, g = [], 0
    for world in args.worlds:
        runs = []
        for _ in range(args.reps):
            runs.append(form(server.port, secret, g, world))
            g += 1
        f = [x * 1e3 for x, _ in runs]
        h = [y * 1e3 for _, y in runs]
        both = [a + b for a, b in zip(f, h)]
        rows.append({"world": world, "reps": args.reps,
                     "formation_ms": {"median": statistics.median(f), "max": max(f)},
                     "handshake_ms": {"median": statistics.median(h), "max": max(h)},
                     "total_ms": {"median": statistics.median(both), "max": max(both)},
                     "handshake_share": statistics.median(h) / statistics.median(both)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'world':>5}  {'formation ms (med/max)':>22}  {'handshake ms (med/max)':>22}  {'handshake share':>15}")
    for r in rows:
        print(f"{r['world']:>5}  {r['formation_ms']['median']:>10.1f} /{r['formation_ms']['max']:>9.1f}  "
              f"{r['handshake_ms']['median']:>10.2f} /{r['handshake_ms']['max']:>9.2f}  {r['handshake_share']:>14.1%}")


if __name__ == "__main__":
    main()

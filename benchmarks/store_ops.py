"""Store benchmark: c10d's TCPStore against eltctl's SocketStore, side by side in one run.

The job's control plane does small gets and sets (heartbeats, plans, events, the
daemon's desired-slots polls). This measures, for each store, one client in this
process against a server in its own process (as the store keeper is):

  - set: ops/s and latency (median, p99) of `set(key, 64 bytes)`;
  - get: ops/s and latency of `get(key)` of an existing key;
  - a gloo rendezvous of 2 ranks through a PrefixStore over it (threads), wall time;
  - SocketStore only: `poll`, what a worker's control thread does every 30 ms (its
    heartbeat set and 5 keys read, one pipelined round trip: `set_and_peek`), and the
    server's CPU time per request (`server_cpu_us`, from /proc: the server's own process).

c10d's `set` does not wait for the server (nothing is read back), so its set figures
are the client's send alone; SocketStore's `set` is a round trip (a value over a limit
must raise). Compare the gets for the protocol's cost.

The servers: TCPStore on 127.0.0.1 (non-libuv, as the old store keeper served it,
and the default libuv one), and eltctl_runtime.store.server on a Unix socket (the
keeper's "ssh" mode) and on TCP (the direct mode).

    .venv/bin/python benchmarks/store_ops.py [--ops 5000] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _serve_tcpstore(port_q, stop, libuv: bool) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=libuv,
                          timeout=timedelta(seconds=60))
    port_q.put(store.port)
    stop.wait()


def _serve_sockstore(port_q, stop, where: str) -> None:
    from eltctl_runtime.store.server import StoreServer

    srv = StoreServer()
    if where == "tcp":
        spec = f"tcp:127.0.0.1:{srv.listen_tcp('127.0.0.1', 0)}"
    else:
        spec = f"unix:{srv.listen_unix(Path(tempfile.mkdtemp(prefix='eltstore-')) / 'store.sock')}"
    srv.start()
    port_q.put(spec)
    stop.wait()
    srv.stop()


def _timed(fn, n: int) -> dict:
    lat = []
    t0 = time.perf_counter()
    for i in range(n):
        s = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - s)
    total = time.perf_counter() - t0
    lat.sort()
    return {"ops_per_s": n / total, "median_us": statistics.median(lat) * 1e6,
            "p99_us": lat[int(len(lat) * 0.99) - 1] * 1e6}


def _rendezvous(make_client) -> float:
    import torch
    import torch.distributed as dist

    done = {}

    def rank(r: int) -> None:
        client = make_client()
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"bench/{t0}", client), r, 2, timedelta(seconds=30))
        t = torch.ones(1)
        pg.allreduce([t]).wait()
        done[r] = client  # referenced while the group lives

    t0 = time.perf_counter()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name: str, target, args, connect, n: int) -> dict:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(q, stop, *args), daemon=True)
    proc.start()
    try:
        where = q.get(timeout=60)
        client = connect(where)
        value = b"x" * 64
        client.set("warm", value)
        cpu0 = _cpu_s(proc.pid)
        out = {"store": name,
               "set": _timed(lambda i: client.set(f"k{i % 100}", value), n),
               "get": _timed(lambda i: client.get(f"k{i % 100}"), n)}
        out["server_cpu_us"] = round((_cpu_s(proc.pid) - cpu0) / (2 * n) * 1e6, 1)
        if hasattr(client, "set_and_peek"):
            keys = ["stop", "leave/me", "abort/3", "k1", "k2"]
            out["poll"] = _timed(lambda i: client.set_and_peek([("hb/me", str(i).encode())], keys), n)
        out["rendezvous_s"] = _rendezvous(lambda: connect(where))
        return out
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=5000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch.distributed as dist

    from eltctl_runtime.store.client import SocketStore

    def tcp_client(port):
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))

    rows = [
        measure("TCPStore (non-libuv, TCP)", _serve_tcpstore, (False,), tcp_client, args.ops),
        measure("TCPStore (libuv, TCP)", _serve_tcpstore, (True,), tcp_client, args.ops),
        measure("SocketStore (Unix socket)", _serve_sockstore, ("unix",), lambda s: SocketStore(s, 30), args.ops),
        measure("SocketStore (TCP)", _serve_sockstore, ("tcp",), lambda s: SocketStore(s, 30), args.ops),
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.ops} ops each, one client, server in its own process; latency in microseconds")
    print(f"{'store':28} {'set ops/s':>10} {'set med':>8} {'set p99':>8} {'get ops/s':>10} {'get med':>8} "
          f"{'get p99':>8} {'gloo rdzv':>10} {'srv cpu/op':>10} {'poll med':>9}")
    for r in rows:
        s, g = r["set"], r["get"]
        poll = f"{r['poll']['median_us']:9.0f}" if "poll" in r else f"{'-':>9}"
        print(f"{r['store']:28} {s['ops_per_s']:10.0f} {s['median_us']:8.0f} {s['p99_us']:8.0f} "
              f"{g['ops_per_s']:10.0f} {g['median_us']:8.0f} {g['p99_us']:8.0f} {r['rendezvous_s'] * 1000:8.0f}ms "
              f"{r['server_cpu_us']:10.1f} {poll}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

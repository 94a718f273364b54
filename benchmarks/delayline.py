"""What the bed's user-space delay line delivers and costs (tests/testbed/delayline.py).

Where the kernel has no `sch_netem`, the shaped bed delays a host's link through a
process between two TAPs. This prints, per link, side by side for the kernel's veth
link (where the link has no delay, the only case a veth can shape without netem) and
the delay line: a refused TCP connect's round trip (the smallest of 5), one TCP
stream's rate over `--seconds`, and the machine's busy cores during the stream (from
/proc/stat: the sender, the receiver, the kernel's network work and the delay lines).

    .venv/bin/python benchmarks/delayline.py            # 1 Gbit/s at 0, 0.2 and 5 ms; unlimited at 5 ms
    .venv/bin/python benchmarks/delayline.py --json

Needs root (network namespaces). The stream's sender and receiver are Python programs
in the two hosts; their own CPU is in the busy figure, the same on both paths.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECEIVER = r"""
import socket, sys, time
srv = socket.create_server((sys.argv[1], 5003))
conn, _ = srv.accept()
n, t = 0, time.perf_counter()
while True:
    b = conn.recv(1 << 20)
    if not b:
        break
    n += len(b)
print(n * 8 / (time.perf_counter() - t) / 1e6)
"""

SENDER = r"""
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], 5003)); break
    except OSError:
        time.sleep(0.05)
buf, end = b"x" * (1 << 20), time.perf_counter() + float(sys.argv[2])
while time.perf_counter() < end:
    c.sendall(buf)
c.close()
"""

RTT = r"""
import socket, sys, time
best = 1e9
for _ in range(5):
    t = time.perf_counter()
    try:
        socket.create_connection((sys.argv[1], 5009), timeout=5).close()
    except ConnectionRefusedError:
        pass
    best = min(best, time.perf_counter() - t)
print(best * 1000)
"""


def busy_cores() -> float:
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def measure(link, delay_line: bool, seconds: float) -> dict:
    from tests.testbed.netns import NetBed

    with NetBed({"h1": link, "h2": link}, delay_line=delay_line) as bed:
        rtt = float(bed.check_in("h1", [sys.executable, "-c", RTT, bed.address("h2")]).stdout)
        time.sleep(0.3)
        b0, t0 = busy_cores(), time.perf_counter()
        recv = bed.run_in("h2", [sys.executable, "-c", RECEIVER, bed.address("h2")], stdout=subprocess.PIPE,
                          text=True)
        bed.check_in("h1", [sys.executable, "-c", SENDER, bed.address("h2"), str(seconds)], timeout=seconds + 30)
        mbit = float(recv.communicate(timeout=30)[0])
        cores = (busy_cores() - b0) / (time.perf_counter() - t0)
    return {"link": link.describe(), "path": "delay line" if delay_line else "veth", "rtt_ms": round(rtt, 3),
            "mbit_s": round(mbit, 1), "busy_cores": round(cores, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="the TCP stream's length")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("network namespaces need root: run as root")
    from tests.testbed.netns import Link, netns_missing_reason

    reason = netns_missing_reason()
    if reason:
        raise SystemExit(reason)
    rows = [measure(Link(rate_mbit=1000), False, args.seconds), measure(Link(rate_mbit=1000), True, args.seconds)]
    for link in (Link(rate_mbit=1000, delay_ms=0.2), Link(rate_mbit=1000, delay_ms=5), Link(delay_ms=5),
                 Link(rate_mbit=100, delay_ms=5)):
        rows.append(measure(link, True, args.seconds))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'link':<26} {'path':<11} {'round trip ms':>13} {'TCP Mbit/s':>11} {'busy cores':>10}")
    for r in rows:
        print(f"{r['link']:<26} {r['path']:<11} {r['rtt_ms']:>13.2f} {r['mbit_s']:>11.1f} {r['busy_cores']:>10.2f}")


if __name__ == "__main__":
    main()

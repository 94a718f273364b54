"""What a gradient exchange costs on an office network: all-reduce over shaped links.

Every other figure in this project ran on loopback. Here each rank runs in a host
of the shaped network bed (tests/testbed/netns.py: a namespace per host, a bridge
between them, each host's link limited by `tc`), with gloo bound to the host's
interface (GLOO_SOCKET_IFNAME) and a TCPStore on rank 0's bridge address. For each
world size the workers start once (the host interpreter, Python and torch only)
and the bed is reshaped under them for each link case, so the table costs one
`import torch` per rank, not one per row.

A mode is one function of the worker's gradient and group (`MODES`): the table
iterates over them. Issue 51's later modes (local steps, low rank) add theirs here.

    .venv/bin/python benchmarks/network.py --mb 20                  # quick
    .venv/bin/python benchmarks/network.py --json                   # the issue's sizes
    .venv/bin/python benchmarks/network.py --delays 0 --worlds 2    # a kernel without sch_netem

Per row: the slowest rank's time for one exchange (after a barrier; the median
of --rounds), the bytes a rank's interface sent (`tx_bytes`, headers included)
against a ring all-reduce's 2 (N-1)/N of the payload, and the rate those imply.
Needs root (network namespaces). Cases the kernel cannot shape (delay without
sch_netem) are skipped with the reason, in the table and in --json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORE_PORT = 29500  # each host has its own network stack: no other bed can hold this port
PROCESS_GROUP_TIMEOUT_S = 1800  # 200 MB at 100 Mbit/s on a loaded machine takes tens of seconds


# --- the modes (run in the workers; torch is imported there only) ------------------

def allreduce_fp32(grad, dist) -> int:
    """The synchronous baseline: the fp32 gradient summed in place. Returns payload bytes."""
    dist.all_reduce(grad)
    return grad.numel() * 4


def allreduce_bf16(grad, dist) -> int:
    """Half the bytes: cast to bf16, all-reduce, cast back (accumulation is the caller's)."""
    import torch

    half = grad.to(torch.bfloat16)
    dist.all_reduce(half)
    grad.copy_(half)
    return half.numel() * 2


MODES = {f.__name__: f for f in (allreduce_fp32, allreduce_bf16)}


# --- pure parts ---------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One link shape, the same for every host."""

    rate_mbit: float
    delay_ms: float

    @property
    def label(self) -> str:
        rate = f"{self.rate_mbit / 1000:g} Gbit/s" if self.rate_mbit >= 1000 else f"{self.rate_mbit:g} Mbit/s"
        return f"{rate}, {self.delay_ms:g} ms"


def ring_bytes(payload: int, world: int) -> int:
    """What a ring all-reduce sends per rank: reduce-scatter plus all-gather."""
    return 2 * (world - 1) * payload // world


def summarize(world: int, case: Case, mode: str, rounds: list[list[dict]]) -> dict:
    """One table row from the ranks' records of each round of one mode: an exchange
    takes as long as its slowest rank; the row has the median round."""
    times = sorted(max(r["seconds"] for r in per_rank) for per_rank in rounds)
    seconds = times[len(times) // 2]
    records = [r for per_rank in rounds for r in per_rank]
    wire = sum(r["wire_bytes"] for r in records) // len(records)
    payload = records[0]["payload_bytes"]
    return {"world": world, "rate_mbit": case.rate_mbit, "delay_ms": case.delay_ms, "mode": mode,
            "rounds": len(rounds), "seconds": round(seconds, 4), "seconds_all": [round(t, 4) for t in times],
            "payload_bytes": payload,
            "ring_bytes_per_rank": ring_bytes(payload, world), "wire_bytes_per_rank": wire,
            "wire_mbit_per_s": round(wire * 8 / seconds / 1e6, 1)}


def render_table(rows: list[dict], skipped: list[dict]) -> str:
    head = (f"{'world':>5}  {'link':<22} {'mode':<16} {'time s':>8} {'MB sent/rank':>13} "
            f"{'ring MB':>8} {'Mbit/s':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        link = Case(r["rate_mbit"], r["delay_ms"]).label
        lines.append(f"{r['world']:>5}  {link:<22} {r['mode']:<16} {r['seconds']:>8.3f} "
                     f"{r['wire_bytes_per_rank'] / 1e6:>13.1f} {r['ring_bytes_per_rank'] / 1e6:>8.1f} "
                     f"{r['wire_mbit_per_s']:>8.1f}")
    lines += [f"skipped world {s['world']}, {Case(s['rate_mbit'], s['delay_ms']).label}: {s['reason']}"
              for s in skipped]
    return "\n".join(lines)


# --- the worker (host interpreter, inside a namespace) ------------------------------

def worker(rank: int, world: int, master: str, floats: int, modes: list[str], rounds: int) -> None:
    """Join the group, then for each `run` line on stdin time every mode `rounds` times.

    The gradient is filled with rank+1 before each mode, so the sum is known
    (world (world+1) / 2, exact in bf16 too) and a wrong exchange fails loudly.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    store = dist.TCPStore(master, STORE_PORT, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    grad = torch.empty(floats)
    tx = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics" / "tx_bytes"
    expected = world * (world + 1) / 2
    print(json.dumps({"ready": rank}), flush=True)
    for line in sys.stdin:
        if line.split()[0] != "run":
            break
        for name in (m for m in modes for _ in range(rounds)):
            grad.fill_(rank + 1)
            dist.barrier()
            sent = int(tx.read_text())
            start = time.perf_counter()
            payload = MODES[name](grad, dist)
            seconds = time.perf_counter() - start
            # A rank is done when it has received its share; its last sends may still sit in
            # its tbf queue (not yet counted in tx_bytes) until every rank is done.
            dist.barrier()
            sent = int(tx.read_text()) - sent
            if grad[0].item() != expected or grad[-1].item() != expected:
                raise SystemExit(f"rank {rank}: {name} summed to {grad[0].item()}, not {expected}")
            print(json.dumps({"mode": name, "rank": rank, "seconds": seconds, "wire_bytes": sent,
                              "payload_bytes": payload}), flush=True)
    dist.destroy_process_group()


# --- the driver -----------------------------------------------------------------------

def run_world(world: int, cases: list[Case], floats: int, modes: list[str],
              rounds: int) -> tuple[list[dict], list[dict]]:
    """One bed of `world` hosts; its links reshaped for each case under the same workers."""
    sys.path.insert(0, str(ROOT))
    from tests.testbed.hostpython import HOST_PYTHON
    from tests.testbed.netns import IFNAME, Link, NetBed, shaping_missing_reason

    rows, skipped, runnable = [], [], []
    for case in cases:
        reason = shaping_missing_reason(Link(rate_mbit=case.rate_mbit, delay_ms=case.delay_ms))
        if reason:
            skipped.append({"world": world, **asdict(case), "reason": reason})
        else:
            runnable.append(case)
    if not runnable:
        return rows, skipped
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GLOO_SOCKET_IFNAME": IFNAME,
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONWARNINGS": "ignore::UserWarning"}  # torch warns that it has no numpy: hosts have none
    with NetBed(world) as bed:
        master = bed.address("h1")
        workers = [bed.run_in(f"h{r + 1}", [HOST_PYTHON, __file__, "--worker", str(r), str(world), master,
                                            str(floats), ",".join(modes), str(rounds)],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for r in range(world)]
        for w in workers:
            _read(w)  # ready
        for case in runnable:
            bed.reshape_all(Link(rate_mbit=case.rate_mbit, delay_ms=case.delay_ms))
            for w in workers:
                w.stdin.write("run\n")
                w.stdin.flush()
            records = [[_read(w) for _ in range(len(modes) * rounds)] for w in workers]
            for i, mode in enumerate(modes):
                mode_rounds = [[per_worker[i * rounds + k] for per_worker in records] for k in range(rounds)]
                rows.append(summarize(world, case, mode, mode_rounds))
                print(render_table(rows[-1:], []).splitlines()[-1], file=sys.stderr, flush=True)
        for w in workers:
            w.stdin.write("quit\n")
            w.stdin.close()
        for w in workers:
            w.wait(60)
    return rows, skipped


def _read(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a worker ended early (exit {proc.wait()}); its stderr is above")
    return json.loads(line)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        rank, world, master, floats, modes, rounds = argv[1:7]
        worker(int(rank), int(world), master, int(floats), modes.split(","), int(rounds))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=200, help="fp32 gradient size in MB (200: 50 M floats)")
    ap.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--rates", default="10000,1000,100", help="link rates in Mbit/s")
    ap.add_argument("--delays", default="0.2,5", help="one-way delay per host link in ms (needs sch_netem)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of: {', '.join(MODES)}")
    ap.add_argument("--rounds", type=int, default=1, help="exchanges per mode and link (the median is shown)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}")
    if os.geteuid() != 0:
        ap.error("network namespaces need root: run as root")
    floats = int(args.mb * 1e6 / 4)
    cases = [Case(r, d) for r in _floats(args.rates) for d in _floats(args.delays)]
    rows, skipped = [], []
    for world in (int(w) for w in args.worlds.split(",")):
        r, s = run_world(world, cases, floats, modes, args.rounds)
        rows += r
        skipped += s
    if args.json:
        report = {"mb": args.mb, "floats": floats, "rounds": args.rounds, "rows": rows, "skipped": skipped}
        print(json.dumps(report, indent=2))
    else:
        print(render_table(rows, skipped))


if __name__ == "__main__":
    main()

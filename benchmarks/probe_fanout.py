"""Fan-out benchmark: probing many hosts at once versus one after another.

Starts 64 simulated hosts (real sshd on loopback, tests/testbed), then measures:

  - the library probe (`eltctl.probe.probe_fleet` over a fresh `Fleet`, connections
    included, as `eltctl probe` does) of the first 1, 8, 32 and 64 hosts, median of
    --runs runs each;
  - the same 64 hosts probed one after another with the plain `ssh` client running
    the same probe command (what a shell loop over `ssh` would do);
  - the wall time of `eltctl --help` (a subprocess, median of 5).

Targets: 64 hosts within 2x the time of 1 host; at least 10x faster than one after
another; `eltctl --help` under 0.5 s.

    .venv/bin/python benchmarks/probe_fanout.py [--json] [--hosts 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES = (1, 8, 32, 64)
TARGET_SCALE = 2.0  # t(64) / t(1) at most
TARGET_SPEEDUP = 10.0  # sequential / parallel at least
TARGET_HELP_S = 0.5


def probe_time(inventory, hosts) -> tuple[float, float, dict[str, int]]:
    """One library probe of `hosts` with fresh connections: its seconds, the seconds of
    a second probe over the same (reused) connections, and the host states found."""
    from eltctl.probe import probe_fleet
    from eltctl.hosts.fleet import Fleet

    async def main():
        async with Fleet(hosts, ssh=inventory.ssh) as fleet:
            started = time.perf_counter()
            reports = await probe_fleet(fleet, job=inventory.job.name, policy=inventory.policy)
            first = time.perf_counter() - started
            started = time.perf_counter()
            await probe_fleet(fleet, job=inventory.job.name, policy=inventory.policy)
            return reports, first, time.perf_counter() - started

    reports, took, reused = asyncio.run(main())
    states: dict[str, int] = {}
    for r in reports:
        states[r.state.value] = states.get(r.state.value, 0) + 1
    return took, reused, states


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and its reaped descendants (for sshd: every connection)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


def hosts_cpu(bed) -> float:
    return sum(cpu_seconds(h.sshd_pid) for h in bed.hosts if h.sshd_pid)


def sequential_ssh_time(bed, inventory) -> tuple[float, int]:
    """Seconds to run the probe command on every host, one `ssh` after another."""
    from eltctl.probe import parse_probe_output, probe_command

    command = probe_command(inventory.job.name, inventory.policy.nvidia_smi_timeout)
    ok = 0
    started = time.perf_counter()
    for host in bed.hosts:
        out = subprocess.run(host.ssh_argv(command), capture_output=True, text=True, timeout=120)
        if out.returncode == 0 and parse_probe_output(out.stdout).complete:
            ok += 1
    return time.perf_counter() - started, ok


def help_time(runs: int = 5) -> float:
    exe = Path(sys.executable).with_name("eltctl")
    argv = [str(exe), "--help"] if exe.exists() else [shutil.which("eltctl") or "eltctl", "--help"]
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True, cwd=ROOT)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(n_hosts: int, runs: int, log) -> dict:
    from eltctl.inventory import load_inventory
    from tests.testbed import make_testbed

    log(f"starting {n_hosts} simulated hosts ...")
    t0 = time.perf_counter()
    with make_testbed(n_hosts) as bed:
        log(f"  started in {time.perf_counter() - t0:.1f} s")
        inventory = load_inventory(bed.write_inventory(connect_timeout=30))
        hosts = inventory.hosts
        sizes = [n for n in SIZES if n <= len(hosts)]
        probe_once, probe_reused, states, client_cpu, host_cpu = {}, {}, {}, {}, {}
        probe_time(inventory, hosts[:1])  # warm up: imports, first connection
        for n in sizes:
            times, reused_times = [], []
            c0, h0 = time.process_time(), hosts_cpu(bed)
            for _ in range(runs):
                took, reused, st = probe_time(inventory, hosts[:n])
                times.append(took)
                reused_times.append(reused)
            time.sleep(0.5)  # let the connections' sshd processes exit and be reaped
            client_cpu[n] = (time.process_time() - c0) / runs
            host_cpu[n] = (hosts_cpu(bed) - h0) / runs
            probe_once[n] = statistics.median(times)
            probe_reused[n] = statistics.median(reused_times)
            states[n] = st
            log(f"  {n:3d} host(s): median {probe_once[n]:.3f} s (reused connections "
                f"{probe_reused[n]:.3f} s) over {runs} run(s) {st}; CPU per run: eltctl "
                f"{client_cpu[n]:.2f} s, simulated hosts {host_cpu[n]:.2f} s")
        log(f"probing {len(bed.hosts)} hosts one after another with ssh ...")
        seq, seq_ok = sequential_ssh_time(bed, inventory)
        log(f"  {seq:.2f} s ({seq_ok} answered)")
    help_s = help_time()
    largest = max(sizes)
    scale = probe_once[largest] / probe_once[1]
    speedup = seq / probe_once[largest]
    return {
        "hosts": largest,
        "runs": runs,
        "probe_s": {str(n): round(probe_once[n], 4) for n in sizes},
        "probe_reused_connections_s": {str(n): round(probe_reused[n], 4) for n in sizes},
        "states": {str(n): states[n] for n in sizes},
        # CPU seconds per run (two probes: fresh connections, then reused ones)
        "client_cpu_s": {str(n): round(client_cpu[n], 3) for n in sizes},
        "hosts_cpu_s": {str(n): round(host_cpu[n], 3) for n in sizes},
        "cpu_count": __import__("os").cpu_count(),
        "load_avg": list(__import__("os").getloadavg()),
        "sequential_ssh_s": round(seq, 4),
        "sequential_ssh_answered": seq_ok,
        "scale_64_vs_1": round(scale, 3),
        "speedup_vs_sequential": round(speedup, 2),
        "help_s": round(help_s, 4),
        "targets": {"scale_64_vs_1_max": TARGET_SCALE, "speedup_min": TARGET_SPEEDUP,
                    "help_s_max": TARGET_HELP_S},
        "met": {"scale": scale <= TARGET_SCALE, "speedup": speedup >= TARGET_SPEEDUP,
                "help": help_s < TARGET_HELP_S},
    }


def render(r: dict) -> str:
    lines = ["probe fan-out (library, fresh connections each run; median of "
             f"{r['runs']} run(s))", ""]
    lines.append(f"{'hosts':>6}  {'seconds':>8}  {'reused':>8}  {'eltctl CPU':>10}  {'hosts CPU':>10}")
    for n, s in r["probe_s"].items():
        lines.append(f"{n:>6}  {s:8.3f}  {r['probe_reused_connections_s'][n]:8.3f}  "
                     f"{r['client_cpu_s'][n]:10.2f}  {r['hosts_cpu_s'][n]:10.2f}")
    lines.append("(seconds: a probe with fresh connections, as `eltctl probe` runs; reused: a second "
                 "probe over the same connections, as the controller polls; CPU: seconds per run of "
                 "both, spent by eltctl and by all simulated hosts' sshd + probe scripts, which share "
                 f"this machine's {r['cpu_count']} cores; load average {r['load_avg'][0]:.2f})")
    lines.append("")
    lines.append(f"sequential ssh, {r['hosts']} hosts: {r['sequential_ssh_s']:.2f} s "
                 f"({r['sequential_ssh_answered']} answered)")
    ok = {True: "met", False: "MISSED"}
    lines.append(f"{r['hosts']} vs 1 host: {r['scale_64_vs_1']:.2f}x   "
                 f"(target <= {TARGET_SCALE:g}x: {ok[r['met']['scale']]})")
    lines.append(f"parallel vs sequential: {r['speedup_vs_sequential']:.1f}x faster   "
                 f"(target >= {TARGET_SPEEDUP:g}x: {ok[r['met']['speedup']]})")
    lines.append(f"eltctl --help: {r['help_s']:.3f} s   (target < {TARGET_HELP_S:g} s: "
                 f"{ok[r['met']['help']]})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--hosts", type=int, default=64, help="simulated hosts to start (default 64)")
    ap.add_argument("--runs", type=int, default=3, help="runs per size; the median is reported")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = measure(args.hosts, args.runs, log)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

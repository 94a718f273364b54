"""A training benchmark's side of the shaped bed (tests/testbed/netns.py): which link
cases this kernel can shape, the environment of the processes on the bed, and the
processes, the ranks of a job and the servers beside them, and how they stop.

- **Cases**: one whose link cannot be shaped here (a delay without `sch_netem` nor
  `/dev/net/tun` for the user-space delay line) is a skipped row per mode, with the
  reason (`shapeable`); a bed for delayed cases without netem delays through the
  delay line (`bed_for`), and each row says which (`delay_path`).
- **A rank** writes its runtime log to a file and its records, JSON lines, to stdout;
  its record is the last of them. However the benchmark ends, a rank still running is
  killed with its process group (the bed's `ip netns exec` execs: the group is the
  rank's) and its log closed (`stop_ranks`).
- **A server** (the job's store, torchft's lighthouse) prints `listening` once it
  accepts and stops when its stdin closes; one that does not stop within 30 s of that
  is killed (`serving`).

benchmarks/network.py, benchmarks/_events.py and benchmarks/_torchft.py use these.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence

# The job's store for the runtime's ranks: the runtime's StoreServer, unsigned TCP, on argv's address and port.
_STORE = """
import sys
from eltctl_runtime.store.server import StoreServer
srv = StoreServer()
srv.listen_tcp(sys.argv[1], int(sys.argv[2]))
srv.start()
print("listening", flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
srv.stop()
"""

Rank = tuple[subprocess.Popen, IO[str]]


def shapeable(cases: Sequence, world: int, modes: Iterable[str]) -> tuple[list, list[dict]]:
    """The cases (rate_mbit, delay_ms) whose links this kernel can shape, and a skipped
    row for each mode of each other case, naming why."""
    from tests.testbed.netns import Link, shaping_missing_reason

    runnable, skipped = [], []
    for case in cases:
        reason = shaping_missing_reason(Link(rate_mbit=case.rate_mbit, delay_ms=case.delay_ms))
        if reason:
            skipped += [{"mode": m, "world": world, **asdict(case), "reason": reason} for m in modes]
        else:
            runnable.append(case)
    return runnable, skipped


def bed_for(world: int, cases: Sequence):
    """A NetBed of `world` unshaped hosts that can be reshaped to every case: through the
    user-space delay line (tests/testbed/delayline.py) where a case has a delay and the
    kernel has no netem. `delay_path(bed)` names which."""
    from tests.testbed.netns import Link, NetBed, uses_delay_line

    return NetBed(world, delay_line=uses_delay_line([Link(rate_mbit=c.rate_mbit, delay_ms=c.delay_ms)
                                                     for c in cases]))


def delay_path(bed) -> str:
    """How the bed shapes what a host sends: the kernel's qdiscs alone (netem where a
    link has a delay), or through the user-space delay line."""
    return "user-space delay line (no sch_netem)" if bed.delay_line else "kernel (tc)"


# The TAP a delay-line host's sends go through (tests/testbed/netns.py LINE_TAP; eth0's own
# counters miss them: its egress is redirected before the device counts it).
LINE_TAP = "delay0"


def tx_bytes_file(net: Path = Path("/sys/class/net")) -> Path:
    """Where a rank on the bed reads what its host sent: the delay line's TAP where the
    host has one, else its interface (GLOO_SOCKET_IFNAME)."""
    dev = LINE_TAP if (net / LINE_TAP).exists() else os.environ["GLOO_SOCKET_IFNAME"]
    return net / dev / "statistics" / "tx_bytes"


def bed_env(threads: int) -> dict:
    """The environment every rank and server on the bed starts from: the host
    interpreter's, gloo on the bed's interface, `threads` torch threads, unbuffered."""
    from tests.testbed.hostpython import host_env
    from tests.testbed.netns import IFNAME

    return host_env({"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GLOO_SOCKET_IFNAME": IFNAME,
                     "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
                     "PYTHONWARNINGS": "ignore::UserWarning"})


def start_rank(bed, host: str, argv: Sequence[str], env: dict, log: Path) -> Rank:
    """Start `argv` on `host`: stdout piped (its records), stderr into the file `log`."""
    out = log.open("w")
    return bed.run_in(host, list(argv), env=env, stdout=subprocess.PIPE, stderr=out, text=True), out


def last_record(proc: subprocess.Popen, deadline: float) -> dict | None:
    """The rank's last JSON line once it has exited, None if it printed none; raises
    subprocess.TimeoutExpired when it runs past `deadline` (time.monotonic())."""
    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def stop_ranks(ranks: Iterable[Rank]) -> None:
    """Kill every rank still running, with its process group; close every log."""
    for proc, log in ranks:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@contextmanager
def serving(bed, host: str, argv: Sequence[str], env: dict, *, failed: Callable[[int], BaseException],
            stderr: IO[str] | None = None) -> Iterator[subprocess.Popen]:
    """A server on `host` for the length of the `with`; raises `failed(its exit status)`
    when it exits instead of printing `listening`. At the end its stdin is closed."""
    proc = bed.run_in(host, list(argv), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                      text=True)
    try:
        if proc.stdout.readline().strip() != "listening":
            raise failed(proc.wait())
        yield proc
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def job_store(bed, host: str, port: int, env: dict) -> Iterator[str]:
    """The job's store on `host`'s bed address at `port`; yields that address."""
    from tests.testbed.hostpython import HOST_PYTHON

    address = bed.address(host)
    with serving(bed, host, [HOST_PYTHON, "-c", _STORE, address, str(port)], env,
                 failed=lambda status: SystemExit(f"the job store did not start on {address} (exit {status})")):
        yield address

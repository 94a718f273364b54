"""How often a process that holds a gloo group dies in the interpreter's teardown.

Each round starts three host-interpreter processes that form a 3-rank
ProcessGroupGloo (as runtime/collectives.make_group does: its own TCPStore,
a device on 127.0.0.1), run one allreduce and then end at once, all together,
with the group still referenced: either by the ordinary interpreter exit
(`sys.exit(0)`: module teardown, the group's destructor while its peers close
their sides) or the way a worker and a restart-mode supervisor end
(`runtime/exiting.py`: `os._exit` once atexit has run). A round counts every
process that did not exit 0 (a gloo destructor throwing in the teardown is
SIGABRT, -6: "terminate called ...").

Both modes run interleaved, round by round, in one run:

    .venv/bin/python benchmarks/gloo_teardown.py --rounds 40

Why: a CI run's restart-mode supervisor exited -6 after its job had ended
cleanly ("terminate called after throwing an instance of 'gloo::IoException'");
the supervisor then ended by the ordinary exit.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.testbed.hostpython import HOST_PYTHON, host_env  # noqa: E402

MEMBER = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from eltctl_runtime.member import exiting

rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if mode == "quick":
    exiting.arm()
store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=timedelta(seconds=60))
opts = dist.ProcessGroupGloo._Options()
opts._timeout = timedelta(seconds=300)
opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
pg = dist.ProcessGroupGloo(store, rank, 3, opts)
t = torch.ones(4)
pg.allreduce([t]).wait()
assert t.tolist() == [3.0] * 4
sys.exit(0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(mode: str) -> list[int]:
    port = free_port()
    env = host_env({**os.environ, "OMP_NUM_THREADS": "1"})
    procs = [subprocess.Popen([HOST_PYTHON, "-c", MEMBER, str(r), str(port), mode], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
             for r in range(3)]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=120))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            codes.append(p.wait())
    return codes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="rounds per mode (default 40)")
    args = ap.parse_args()
    bad = {"ordinary": Counter(), "quick": Counter()}
    t0 = time.monotonic()
    for _ in range(args.rounds):
        for mode in ("ordinary", "quick"):
            for code in one_round(mode):
                if code != 0:
                    bad[mode][code] += 1
    n = args.rounds * 3
    print(f"{args.rounds} rounds x 3 processes per mode, interleaved ({time.monotonic() - t0:.0f} s)")
    for mode, c in bad.items():
        print(f"  {mode:8s} exit: {sum(c.values())}/{n} processes did not exit 0 {dict(c) or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

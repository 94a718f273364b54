"""The job's store on a Unix socket, reached by each host through the keeper's SSH forward
of it (issue 21), on the real-sshd test bed: the keeper listens on no TCP port, its
socket is 0600 in the 0700 state directory, each host's daemon.json names the forward's
socket in its own job directory (beside the keeper's run id, written first), another
account can connect to none of them, workers bind gloo to the host's address of its SSH
connection, and a forward whose SSH connection dies (the sshd process serving it
killed) comes back at the same path while the job trains on.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from eltctl.storeforward import forward_socket, read_forwards
from tests.controller.test_store_attack_sshd import listening_addresses, listening_ports
from tests.testbed.jobenv import job_env_on, wait_for, worker_pids
from tests.testbed.procs import descendants

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(300)]

PROBE = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print(type(exc).__name__)
else:
    print("connected")
"""


def connect_as_nobody(path: str) -> str:
    """What another account gets when it connects to the Unix socket `path`."""
    if os.getuid() != 0:
        pytest.skip("switching to another account needs root")
    out = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-I",
                          "-c", PROBE, path], capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or out.stderr.strip()


def test_store_on_a_unix_socket_forwarded_per_host_and_a_dropped_forward_comes_back(testbed):
    hosts = testbed.add_hosts(2, gpus=1)
    gen = job_env_on(testbed, hosts)
    je = next(gen)
    try:
        je.eltctl("up")
        before = je.training_at(2)
        keeper = json.loads((je.state_dir / "controller.json").read_text())["store"]
        kpid, ksock = int(keeper["pid"]), keeper["socket"]

        # -- the keeper listens on its Unix socket alone: 0600 in the 0700 state directory
        assert ksock == str(je.state_dir / "store.sock") and listening_addresses(kpid) == set()
        assert stat.S_IMODE(os.stat(ksock).st_mode) == 0o600
        assert stat.S_IMODE(je.state_dir.stat().st_mode) == 0o700
        run = (je.state_dir / "run").read_text()
        assert len(run.strip()) == 32 and stat.S_IMODE((je.state_dir / "run").stat().st_mode) == 0o600

        # -- each host's daemon.json names its own forward's socket, beside the keeper's run id
        forwards = read_forwards(je.state_dir / "forwards.json")
        paths = {}
        for h in hosts:
            job_dir = h.home / ".eltctl" / "jobs" / je.job / h.name
            path = forward_socket(forwards, h.name, kpid)
            assert path == str(job_dir / "store.sock"), forwards
            paths[h.name] = path
            config = json.loads((job_dir / "daemon.json").read_text())
            assert config["store"] == f"unix:{path}", config
            assert (job_dir / "run").read_text() == run
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(job_dir.stat().st_mode) == 0o700

        # -- another account connects to none of them (the kernel checks the directory's mode)
        for path in [ksock, *paths.values()]:
            assert connect_as_nobody(path) == "PermissionError", path

        # -- workers bind gloo to the host's address of its SSH connection (the store says nothing)
        for wid, pid in worker_pids(je.job).items():
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            host = next(h for h in hosts if wid.startswith(f"{h.name}/"))
            assert env.get("ELTCTL_BIND_ADDRESS") == host.address, (wid, env.get("ELTCTL_BIND_ADDRESS"))
            assert env["ELTCTL_STORE"] == f"unix:{paths[host.name]}"

        # -- status shows the forwards
        doc = json.loads(je.eltctl("status", "--json").stdout)
        assert {n: f["socket"] for n, f in (doc.get("keeper") or {}).get("forwards", {}).items()} == paths, doc.get(
            "keeper")
        assert doc["keeper"]["refused"] == 0 and doc["keeper"]["attack"] is None

        # -- the sshd process serving h1's forward dies: the keeper opens it again, same path
        h1 = hosts[0]
        holders = [pid for pid in descendants(h1.sshd_pid) if _holds_forward(pid, je.job)]
        assert holders
        for pid in holders:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: forward_socket(read_forwards(je.state_dir / "forwards.json"), h1.name, kpid) is None, 30,
                 "the keeper to see h1's forward down")
        wait_for(lambda: forward_socket(read_forwards(je.state_dir / "forwards.json"), h1.name, kpid), 60,
                 "h1's forward to come back")
        assert forward_socket(read_forwards(je.state_dir / "forwards.json"), h1.name, kpid) == paths[h1.name]
        after = je.training_at(2, after_step=before["step"] + 20)
        assert after["step"] > before["step"] + 20
    finally:
        next(gen, None)


def _holds_forward(pid: int, job: str) -> bool:
    """Whether the sshd process `pid` listens on a Unix socket of `job` (the keeper's forward)."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        return False
    socks = {i[len("socket:["):-1] for i in inodes if i.startswith("socket:[")}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in socks and f"/{job}/" in parts[7] and parts[7].endswith("store.sock"):
            return True
    return False


def test_direct_mode_binds_one_address_for_all_and_says_it_is_exposed(testbed):
    hosts = testbed.add_hosts(2, gpus=1)
    gen = job_env_on(testbed, hosts, extra='\n[controller]\nstore = "direct"\n')
    je = next(gen)
    try:
        je.eltctl("up")
        je.training_at(2)
        keeper = json.loads((je.state_dir / "controller.json").read_text())["store"]
        endpoint = f"tcp:{keeper['address']}:{keeper['port']}"
        assert read_forwards(je.state_dir / "forwards.json")["forward"] is False  # the run ids alone
        run = (je.state_dir / "run").read_text()
        for h in hosts:
            job_dir = h.home / ".eltctl" / "jobs" / je.job / h.name
            config = json.loads((job_dir / "daemon.json").read_text())
            assert config["store"] == endpoint, config
            assert (job_dir / "run").read_text() == run and not (job_dir / "store.sock").exists()
        assert 'store = "direct": the job\'s store listens on' in je.controller_log(200)
        for pid in worker_pids(je.job).values():
            env = Path(f"/proc/{pid}/environ").read_text()
            assert "ELTCTL_BIND_ADDRESS" not in env  # the runtime's own rule: towards the store
    finally:
        next(gen, None)

"""The job's store on loopback, reached by each host through the keeper's SSH remote
forward (issue 14, "the store reachable only through SSH"), on the real-sshd test bed:
the keeper listens on 127.0.0.1 alone, each host's daemon.json names its own forward,
workers bind gloo to the host's address of its SSH connection, and a forward whose SSH
connection dies (the sshd process serving it killed) comes back on the same port while
the job trains on.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from eltctl.storeforward import forward_port, read_forwards
from tests.controller.test_store_attack_sshd import listening_addresses, listening_ports
from tests.testbed.jobenv import job_env_on, wait_for, worker_pids
from tests.testbed.procs import descendants

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(300)]


def test_store_on_loopback_forwarded_per_host_and_a_dropped_forward_comes_back(testbed):
    hosts = testbed.add_hosts(2, gpus=1)
    gen = job_env_on(testbed, hosts)
    je = next(gen)
    try:
        je.eltctl("up")
        before = je.training_at(2)
        keeper = json.loads((je.state_dir / "controller.json").read_text())["store"]
        kpid, kport = int(keeper["pid"]), int(keeper["port"])

        # -- the keeper listens on 127.0.0.1 alone
        assert keeper["address"] == "127.0.0.1"
        assert listening_addresses(kpid) == {("127.0.0.1", kport)}, listening_addresses(kpid)

        # -- each host's daemon.json names its own forward; the forward is held by that host's sshd
        forwards = read_forwards(je.state_dir / "forwards.json")
        ports = {}
        for h in hosts:
            port = forward_port(forwards, h.name, kpid)
            assert port, forwards
            ports[h.name] = port
            config = json.loads((h.home / ".eltctl" / "jobs" / je.job / h.name / "daemon.json").read_text())
            assert config["store"] == f"127.0.0.1:{port}", config
            held = listening_ports(descendants(h.sshd_pid))
            assert port in held, (h.name, port, held)
            assert all(a == "127.0.0.1" for pid in set(held.values()) for a, p in listening_addresses(pid)
                       if p == port)  # GatewayPorts no: the forward is on the host's loopback only

        # -- workers bind gloo to the host's address of its SSH connection (the store says nothing)
        for wid, pid in worker_pids(je.job).items():
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            host = next(h for h in hosts if wid.startswith(f"{h.name}/"))
            assert env.get("ELTCTL_BIND_ADDRESS") == host.address, (wid, env.get("ELTCTL_BIND_ADDRESS"))
            assert env["ELTCTL_STORE"] == f"127.0.0.1:{ports[host.name]}"

        # -- status shows the forwards
        doc = json.loads(je.eltctl("status", "--json").stdout)
        assert {n: f["port"] for n, f in (doc.get("keeper") or {}).get("forwards", {}).items()} == ports, doc.get(
            "keeper")

        # -- the sshd process serving h1's forward dies: the keeper opens it again, same port
        h1 = hosts[0]
        held = listening_ports(descendants(h1.sshd_pid))
        os.kill(held[ports[h1.name]], signal.SIGKILL)
        wait_for(lambda: forward_port(read_forwards(je.state_dir / "forwards.json"), h1.name, kpid) is None, 30,
                 "the keeper to see h1's forward down")
        wait_for(lambda: forward_port(read_forwards(je.state_dir / "forwards.json"), h1.name, kpid), 60,
                 "h1's forward to come back")
        assert forward_port(read_forwards(je.state_dir / "forwards.json"), h1.name, kpid) == ports[h1.name]
        after = je.training_at(2, after_step=before["step"] + 20)
        assert after["step"] > before["step"] + 20
    finally:
        next(gen, None)


def test_direct_mode_binds_one_address_for_all_and_says_it_is_exposed(testbed):
    hosts = testbed.add_hosts(2, gpus=1)
    gen = job_env_on(testbed, hosts, extra='\n[controller]\nstore = "direct"\n')
    je = next(gen)
    try:
        je.eltctl("up")
        je.training_at(2)
        keeper = json.loads((je.state_dir / "controller.json").read_text())["store"]
        endpoint = f"{keeper['address']}:{keeper['port']}"
        assert not (je.state_dir / "forwards.json").exists()
        for h in hosts:
            config = json.loads((h.home / ".eltctl" / "jobs" / je.job / h.name / "daemon.json").read_text())
            assert config["store"] == endpoint, config
        assert 'store = "direct": the job\'s store listens on' in je.controller_log(200)
        for pid in worker_pids(je.job).values():
            env = Path(f"/proc/{pid}/environ").read_text()
            assert "ELTCTL_BIND_ADDRESS" not in env  # the runtime's own rule: towards the store
    finally:
        next(gen, None)

"""An attacker on the lab network against a running job (issue 14, finding 1).

Plan: a job on two simulated hosts (one GPU each: world size 2) with a checkpoint
mirror trains. The attacker lists every TCP port the job's processes listen on
(/proc/net/tcp{,6} joined with /proc/<pid>/fd of the job's processes and the store
keeper) and connects to each: one is the store keeper's (the job's c10d TCPStore,
the control plane); the others are the workers' (gloo's pairs: the data plane, not
signed, see docs/commands.md, Security). Through the store's port, as a plain c10d
client without the job's secret, it forges what finding 1 lists:

- `daemon/h1/desired` telling h1's daemon to stop (a host taken out of the job);
- `leave/<worker>` for every worker (a planned leave of everyone);
- a `crash` event naming h2's worker (the controller would cool down and bench h2);
- `events/seq` raised by 10^9 (a controller reading events one by one would wedge);
- rank 0's `status` with a step of 10^12 (mirroring would stop: no newer step, and
  `down` would report a checkpoint that does not exist).

What must hold: the job trains on at world size 2 (no worker left, no host stopped),
no host is benched or cooling down, status.json keeps updating with real steps, the
forged values are counted in `eltctl status --json` (`forged`), and `down` mirrors
and verifies the final checkpoint, signed (manifest.mac). The job's secret is 0600
on the control machine and on every host.
"""

from __future__ import annotations

import json
import socket
import stat
import time
from pathlib import Path

import pytest

from eltctl_runtime.store import client as storeclient
from eltctl_runtime.protocol import EventKind, Keys, desired_key, job_prefix
from tests.testbed.attacker import tcp_listeners as listening_addresses
from tests.testbed.jobenv import job_env_on, job_pids, wait_for, worker_pids

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(300)]

HUGE_STEP = 10**12


def listening_ports(pids: list[int]) -> dict[int, int]:
    """port -> pid, for every TCP socket in LISTEN state held by one of `pids`."""
    return {port: pid for pid in pids for _addr, port in listening_addresses(pid)}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_forged_control_values_from_the_network_are_ignored_and_counted(testbed, tmp_path):
    import torch.distributed as dist

    hosts = testbed.add_hosts(2, gpus=1)
    mirror = tmp_path / "mirror"
    gen = job_env_on(testbed, hosts, extra=f'\n[storage]\nmirror = "{mirror}"\n')
    je = next(gen)
    try:
        je.eltctl("up")
        before = je.training_at(2)
        job = je.job
        assert mode(je.state_dir / "secret") == 0o600
        for h in hosts:
            assert mode(h.home / ".eltctl" / "jobs" / job / h.name / "secret") == 0o600, h.name

        # -- every port the job listens on: the workers' (gloo) alone; the store keeper has no
        # TCP port (its Unix socket, forwarded to each host over SSH: issue 21)
        keeper = json.loads((je.state_dir / "controller.json").read_text())["store"]
        # one reading of each process's listeners: a worker's process groups come and go
        listeners = {pid: listening_addresses(pid) for pid in job_pids(job) + [int(keeper["pid"])]}
        ports = {port: pid for pid, addrs in listeners.items() for _addr, port in addrs}
        where = {port: addr for addrs in listeners.values() for addr, port in addrs}
        workers = set(worker_pids(job).values())
        gloo = {p for p, pid in ports.items() if pid in workers}
        assert set(ports) - gloo == set(), f"unexpected listeners: {ports}"
        assert listeners[int(keeper["pid"])] == set() and keeper["socket"]
        # a scan: connect, then go (gloo's data plane is not signed: not probed further). gloo
        # listens on the host's address of its SSH connection (ELTCTL_BIND_ADDRESS)
        for port in ports:
            try:
                with socket.create_connection((where[port], port), timeout=5):
                    pass
            except ConnectionRefusedError:  # only a group closed since the reading
                assert (where[port], port) not in listening_addresses(ports[port]), port

        # -- through the store (reached here through its socket, as the job's own account: a
        # stand-in for whoever reaches the store): forge what finding 1 lists
        tcp = storeclient.connect(f"unix:{keeper['socket']}", 10)
        attacker = dist.PrefixStore(job_prefix(job), tcp)
        h1, h2 = hosts[0].name, hosts[1].name
        attacker.set(desired_key(h1), json.dumps({"seq": 10**6, "slots": [], "stop": True}))
        for wid in worker_pids(job):
            attacker.set(Keys.leave(wid), str(time.time()))
        victim = next(w for w in worker_pids(job) if w.startswith(f"{h2}/"))
        n = attacker.add(Keys.EVENTS_SEQ, 1)
        attacker.set(Keys.event(n), json.dumps({"kind": EventKind.CRASH.value, "host": h2, "workers": [victim],
                                                "detail": "exit status 1", "time": time.time()}))
        # the controller reads the forged crash (and ignores it) before the counter jumps past it
        wait_for(lambda: ((je.status().get("forged") or {}).get("controller") or {}).get("events"), 30,
                 "the controller to count the forged crash event")
        attacker.add(Keys.EVENTS_SEQ, 10**9)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # rank 0 rewrites its status every second: forge faster
            attacker.set(Keys.STATUS, json.dumps({"generation": 99, "world_size": 1, "members": [victim],
                                                  "step": HUGE_STEP, "epoch": 0, "time": time.time(),
                                                  "checkpoint": {"step": HUGE_STEP, "path": "/nowhere"}}))
            time.sleep(0.1)

        # -- the job trains on, as it was
        after = je.training_at(2, after_step=before["step"] + 10)
        assert after["step"] < HUGE_STEP and after["generation"] != 99
        updated = after["updated"]
        wait_for(lambda: (je.status().get("updated") or 0) > updated + 2, 30, "status.json to keep updating")
        doc = json.loads(je.eltctl("status", "--json").stdout)
        for h in doc["hosts"]:
            assert h["state"] == "running" and not h["benched_until"] and not h["cooldown_until"], h
        kinds = [e.get("kind") for e in doc.get("events") or ()]
        assert "crash" not in kinds and "bench" not in kinds, kinds
        forged = doc["forged"]
        assert forged["total"] > 0 and forged["controller"].get("events", 0) >= 1, forged
        assert forged["controller"].get("status", 0) >= 1, forged
        assert forged["events_skipped"] == 0, forged  # the log is read as a run of entries, not by its counter
        # the daemons' and rank 0's counts (runtime side): h1's daemon saw the forged desired
        assert forged["hosts"].get(h1, {}).get("daemon/desired", 0) >= 1, forged
        text = je.eltctl("status").stdout
        assert "forged store values ignored" in text, text

        # -- `down` mirrors and verifies the final checkpoint, signed
        down = je.eltctl("down", timeout=240)
        assert "mirrored and verified" in down.stdout, down.stdout
        final = json.loads((je.state_dir / "status.json").read_text())["mirror"]["step"]
        assert final is not None and final < HUGE_STEP
        assert (mirror / job / f"step-{final:08d}" / "manifest.mac").is_file()
        tcp = attacker = None
    finally:
        next(gen, None)

"""The store's SSH forwards of a Unix socket (eltctl/storeforward.py) on the real-sshd test bed.

A Unix-socket echo server stands in for the keeper's store: what matters here is the
forward (the host's sshd listening on store.sock in the host's job directory, carried
back over the verified connection), the run id written there first, its state file,
the same path after a lost connection and for a new Forwarder, the inventory re-read,
and a host whose sshd refuses streamlocal forwarding named with the fix while the
others go on. The whole job through the forwards is tests/controller/test_store_loopback_sshd.py.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
import time

import pytest

from eltctl.storeforward import Forwarder, forward_socket, read_forwards
from eltctl_runtime.store.server import bind_unix
from tests.testbed.jobenv import wait_for

pytestmark = pytest.mark.sshd

JOB = {"name": "fw", "command": ["python", "x.py"], "device": "cpu"}


def _echo_server(path) -> socket.socket:
    srv = bind_unix(path, 16)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(64)
                conn.sendall(b"echo:" + data)

    threading.Thread(target=serve, daemon=True).start()
    return srv


def _through(path: str) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(b"hi")
        return s.recv(64)


def _sshd_children(host) -> list[int]:
    """The sshd processes serving the connections of `host` (children of its listener)."""
    listener = host.sshd_pid
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == listener:
                out.append(int(d))
    return out


def test_forwards_come_up_after_the_run_id_keep_their_path_and_follow_the_inventory(testbed, tmp_path):
    h1, h2, h3 = testbed.add_hosts(3, gpus=0)
    h3.set_sshd_option("AllowStreamLocalForwarding", "no")
    job = dict(JOB, workdir=str(tmp_path))
    inventory = testbed.write_inventory(tmp_path / "hosts.toml", hosts=[h1, h3], job=job)
    keeper_sock = tmp_path / ("s" * 60) / "state" / "store.sock"  # longer than sun_path: the keeper's alias
    assert len(str(keeper_sock)) > 108
    srv = _echo_server(keeper_sock)
    state = tmp_path / "forwards.json"
    fw = Forwarder(inventory, state, str(keeper_sock), "a" * 32)
    job_dir = h1.home / ".eltctl" / "jobs" / "fw" / "h1"
    try:
        fw.start()
        doc = wait_for(lambda: (d := read_forwards(state)) and forward_socket(d, "h1", os.getpid()) and d, 30,
                       "h1's forward", interval=0.1)
        path = forward_socket(doc, "h1", os.getpid())
        assert path == str(job_dir / "store.sock") and doc["keeper_socket"] == str(keeper_sock)
        assert (job_dir / "run").read_text() == "a" * 32 + "\n"
        assert stat.S_IMODE((job_dir / "run").stat().st_mode) == 0o600
        assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(path).st_mode)
        assert _through(path) == b"echo:hi"
        assert forward_socket(doc, "h1", os.getpid() + 1) is None  # another keeper's file: not trusted

        # h3's sshd refuses streamlocal forwarding: named with the fix; h1 goes on
        h3_state = wait_for(lambda: (e := read_forwards(state)["hosts"].get("h3")) and "refused" in e["error"] and e,
                            30, "h3's refusal", interval=0.1)
        assert "AllowStreamLocalForwarding yes" in h3_state["error"] and 'store = "direct"' in h3_state["error"]
        assert not h3_state["up"]

        # the sshd child serving the forward dies: the connection is opened again, at the same path
        for pid in _sshd_children(h1):
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not (read_forwards(state)["hosts"]["h1"]["up"]), 30, "the forward to be seen down",
                 interval=0.1)
        wait_for(lambda: forward_socket(read_forwards(state), "h1", os.getpid()), 60, "h1's forward again",
                 interval=0.1)
        assert forward_socket(read_forwards(state), "h1", os.getpid()) == path
        assert _through(path) == b"echo:hi"  # the stale socket file was removed first

        # a host added to the inventory gets a forward too (the file's mtime changed)
        time.sleep(1.1)
        testbed.write_inventory(inventory, hosts=[h1, h2], job=job)
        wait_for(lambda: forward_socket(read_forwards(state), "h2", os.getpid()), 30, "h2's forward", interval=0.1)
        assert _through(forward_socket(read_forwards(state), "h2", os.getpid())) == b"echo:hi"
    finally:
        fw.stop()
        srv.close()
    # a new Forwarder (a restarted keeper, a new run id): the same path, the new id written first
    srv = _echo_server(keeper_sock)
    again = Forwarder(inventory, state, str(keeper_sock), "b" * 32)
    try:
        again.start()
        wait_for(lambda: forward_socket(read_forwards(state), "h1", os.getpid()), 30, "h1's forward after a restart",
                 interval=0.1)
        assert forward_socket(read_forwards(state), "h1", os.getpid()) == path
        assert (job_dir / "run").read_text() == "b" * 32 + "\n"
        assert _through(path) == b"echo:hi"
    finally:
        again.stop()
        srv.close()

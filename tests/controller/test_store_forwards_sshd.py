"""The store's SSH remote forwards (eltctl/storeforward.py) on the real-sshd test bed.

A TCP echo server stands in for the keeper's port: what matters here is the forward
(the host's sshd listening on 127.0.0.1:P_h, carried back over the verified
connection), its state file, the port remembered across a lost connection and a new
Forwarder, and the inventory re-read. The whole job through the forwards is
exercised by the existing sshd e2e tests (the default store mode is "ssh") and
tests/controller/test_store_loopback_sshd.py.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from eltctl.storeforward import Forwarder, forward_port, read_forwards
from tests.testbed.jobenv import wait_for

pytestmark = pytest.mark.sshd


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

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
    return srv, srv.getsockname()[1]


def _through(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
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


def test_forwards_come_up_keep_their_port_and_follow_the_inventory(testbed, tmp_path):
    h1, h2 = testbed.add_hosts(2, gpus=0)
    inventory = testbed.write_inventory(tmp_path / "hosts.toml", hosts=[h1], job={
        "name": "fw", "command": ["python", "x.py"], "workdir": str(tmp_path), "device": "cpu"})
    srv, keeper_port = _echo_server()
    state = tmp_path / "forwards.json"
    fw = Forwarder(inventory, state, keeper_port)
    try:
        fw.start()
        doc = wait_for(lambda: (d := read_forwards(state)) and forward_port(d, "h1", os.getpid()) and d, 30,
                       "h1's forward", interval=0.1)
        port = forward_port(doc, "h1", os.getpid())
        # the bed's hosts share this machine's loopback, where the keeper's port is taken: another one
        assert port != keeper_port and doc["keeper_port"] == keeper_port
        assert _through(port) == b"echo:hi"
        assert forward_port(doc, "h1", os.getpid() + 1) is None  # another keeper's file: not trusted

        # the sshd child serving the forward dies: the connection is opened again, on the same port
        for pid in _sshd_children(h1):
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not (read_forwards(state)["hosts"]["h1"]["up"]), 30, "the forward to be seen down",
                 interval=0.1)
        wait_for(lambda: forward_port(read_forwards(state), "h1", os.getpid()), 60, "h1's forward again", interval=0.1)
        assert forward_port(read_forwards(state), "h1", os.getpid()) == port
        assert _through(port) == b"echo:hi"

        # a host added to the inventory gets a forward too (the file's mtime changed)
        time.sleep(1.1)
        testbed.write_inventory(inventory, hosts=[h1, h2], job={
            "name": "fw", "command": ["python", "x.py"], "workdir": str(tmp_path), "device": "cpu"})
        wait_for(lambda: forward_port(read_forwards(state), "h2", os.getpid()), 30, "h2's forward", interval=0.1)
        assert _through(forward_port(read_forwards(state), "h2", os.getpid())) == b"echo:hi"
    finally:
        fw.stop()
        srv.close()
    # a new Forwarder (a restarted keeper: insist) asks for the remembered ports first
    srv, _ = _echo_server()
    again = Forwarder(inventory, state, keeper_port, insist=True)
    try:
        again.start()
        wait_for(lambda: forward_port(read_forwards(state), "h1", os.getpid()), 30, "h1's forward after a restart",
                 interval=0.1)
        assert forward_port(read_forwards(state), "h1", os.getpid()) == port
    finally:
        again.stop()
        srv.close()

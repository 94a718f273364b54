"""The store keeper's supervision (eltctl/controller/store.py `KeeperSupervisor`), with
real keeper processes: a killed keeper is seen at once and replaced on the same address
and port, controller.json names the new one, its store carries the job's restart mark;
in the direct mode a port another process took is given up for a new one."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import time

import pytest

from eltctl.controller import store as kstore
from eltctl.controller.statedir import StateDir
from eltctl_runtime.pids import pid_alive
from eltctl_runtime.protocol import Keys

JOB = "kjob"


@pytest.fixture
def state(tmp_path):
    s = StateDir(tmp_path / "state")
    s.create()
    started: list[kstore.KeeperInfo] = []
    yield s, started
    for info in started:
        kstore.stop_keeper(info, timeout=2)


def test_a_killed_keeper_is_replaced_on_the_same_port(state):
    s, started = state
    first = kstore.start_keeper(s, "127.0.0.1")
    started.append(first)
    s.controller_json.write_text(json.dumps({"pid": 1, "store": first.to_json()}))
    sup = kstore.KeeperSupervisor(s, JOB, first, round_trip_every=1)
    assert sup.check()

    os.kill(first.pid, signal.SIGKILL)
    os.waitpid(first.pid, 0)  # our child here: reaped, as the controller's Popen bookkeeping does
    assert not sup.check()
    info = sup.restart()
    started.append(info)
    assert (info.address, info.port) == (first.address, first.port) and info.pid != first.pid
    assert sup.restarts == 1 and sup.check()
    doc = json.loads(s.controller_json.read_text())
    assert doc["store"] == info.to_json() and doc["keeper_restarts"] == 1 and doc["pid"] == 1
    client = kstore.connect_client(info.endpoint, JOB)
    assert client.check([Keys.STORE_RESTARTED]) and not client.check([Keys.STATUS])


def test_a_socket_keeper_has_a_fresh_run_id_and_is_replaced_at_the_same_path(state):
    s, started = state
    first = kstore.start_keeper(s, None)
    started.append(first)
    assert first.socket == str(s.store_socket) and first.endpoint == f"unix:{s.store_socket}"
    assert stat.S_IMODE(s.store_socket.stat().st_mode) == 0o600 and stat.S_IMODE(s.path.stat().st_mode) == 0o700
    run = s.run_file.read_text().strip()
    assert len(run) == 32 and stat.S_IMODE(s.run_file.stat().st_mode) == 0o600
    sup = kstore.KeeperSupervisor(s, JOB, first, round_trip_every=1)
    assert sup.check()
    with pytest.raises(kstore.KeeperPortTaken):  # a live store answers there: never taken over
        kstore.start_keeper(s, None)
    os.kill(first.pid, signal.SIGKILL)
    os.waitpid(first.pid, 0)
    assert not sup.check()
    info = sup.restart()
    started.append(info)
    assert info.socket == first.socket and info.pid != first.pid
    assert s.run_file.read_text().strip() not in ("", run)
    client = kstore.connect_client(info.endpoint, JOB)
    assert client.check([Keys.STORE_RESTARTED])


def test_a_store_that_refuses_requests_is_reported_not_restarted(state):
    s, started = state
    info = kstore.start_keeper(s, "127.0.0.1")
    started.append(info)
    sup = kstore.KeeperSupervisor(s, JOB, info, round_trip_every=1, unresponsive_s=0.0)
    flood = socket.create_connection(("127.0.0.1", info.port))
    flood.sendall((1 << 30).to_bytes(4, "big"))  # a 1 GiB request: refused, counted
    flood.recv(4)
    flood.close()
    deadline = time.monotonic() + 20
    while sup.attack() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "refused 1 requests (1 frame_size" in sup.attack() and "possible attack" in sup.attack()
    os.kill(info.pid, signal.SIGSTOP)  # and now it does not answer either
    try:
        assert sup.check() and pid_alive(info.pid)  # not killed: a new one would be flooded alike
    finally:
        os.kill(info.pid, signal.SIGCONT)


def test_a_port_taken_by_another_process_moves_the_direct_store_to_a_new_port(state):
    """Anyone on the LAN can take a lost keeper's port: the restart serves on a new one
    (never waits for the squatter), and controller.json names it (issue 49)."""
    s, started = state
    first = kstore.start_keeper(s, "127.0.0.1")
    started.append(first)
    s.controller_json.write_text(json.dumps({"pid": 1, "store": first.to_json()}))
    sup = kstore.KeeperSupervisor(s, JOB, first)
    os.kill(first.pid, signal.SIGKILL)
    os.waitpid(first.pid, 0)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", first.port))
    squatter.listen(1)
    try:
        with pytest.raises(kstore.KeeperPortTaken):  # without any_port: the port or nothing
            kstore.start_keeper(s, "127.0.0.1", first.port)
        info = sup.restart()
        started.append(info)
    finally:
        squatter.close()
    assert info.port != first.port and info.address == first.address and sup.problem == ""
    assert json.loads(s.controller_json.read_text())["store"] == info.to_json()
    assert "taken by another process; serving on a new one" in s.storekeeper_log.read_text()
    client = kstore.connect_client(info.endpoint, JOB)
    assert client.check([Keys.STORE_RESTARTED])  # the restarted store, with its mark


def test_the_keeper_keeps_its_connection_limit_below_its_open_files():
    from eltctl.storekeeper import keeper_limits, parse_limit
    from eltctl_runtime.store.server import FD_RESERVE

    assert keeper_limits(1 << 20, forwarding=True).max_connections == 4096
    assert keeper_limits(1024, forwarding=False).max_connections == 1024 - FD_RESERVE
    assert keeper_limits(1024, forwarding=True).max_connections == (1024 - FD_RESERVE) // 2
    lim = keeper_limits(1 << 20, False, dict([parse_limit("idle_timeout_s=60"), parse_limit("max_keys=10")]))
    assert lim.idle_timeout_s == 60.0 and lim.max_keys == 10 and isinstance(lim.max_keys, int)
    with pytest.raises(Exception, match="NAME=VALUE"):
        parse_limit("nonsense=1")


def test_republishing_writes_every_remembered_desired_document_with_its_seq():
    import asyncio

    from eltctl.controller import act
    from eltctl.controller.policy import HostRecord
    from eltctl.inventory import Host

    class Store:
        def __init__(self) -> None:
            self.values: dict = {}

        async def set_json(self, key, value):
            self.values[key] = value

        async def set_raw(self, key, value):
            self.values[key] = value

    hosts = [Host(name=n, address=n) for n in ("a", "b", "c")]
    records = {"a": HostRecord(seq=4, desired=(0, 1)), "b": HostRecord(seq=2, desired=())}  # c: never asked
    store = Store()
    asyncio.run(act.republish_desired(store, records, hosts, stopping=False))
    assert store.values == {"daemon/a/desired": {"seq": 4, "slots": [0, 1], "stop": False},
                            "daemon/b/desired": {"seq": 2, "slots": [], "stop": False}}
    store = Store()
    asyncio.run(act.republish_desired(store, records, hosts, stopping=True))
    assert store.values[Keys.STOP] and store.values["daemon/a/desired"]["stop"] is True

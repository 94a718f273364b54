"""The store keeper's supervision (eltctl/controller/store.py `KeeperSupervisor`), with
real keeper processes: a killed keeper is seen at once and replaced on the same address
and port, controller.json names the new one, its store carries the job's restart mark;
a port held by another process is refused with a clear reason and tried again."""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest

from eltctl.controller import store as kstore
from eltctl.controller.statedir import StateDir
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
    client = kstore.connect_client(info.address, info.port, JOB)
    assert client.check([Keys.STORE_RESTARTED]) and not client.check([Keys.STATUS])


def test_a_port_taken_by_another_process_is_refused_and_tried_again(state):
    s, started = state
    first = kstore.start_keeper(s, "127.0.0.1")
    started.append(first)
    sup = kstore.KeeperSupervisor(s, JOB, first)
    os.kill(first.pid, signal.SIGKILL)
    os.waitpid(first.pid, 0)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", first.port))
    squatter.listen(1)
    try:
        with pytest.raises(kstore.KeeperPortTaken):
            sup.restart()
        assert f"port 127.0.0.1:{first.port} is taken by another process" in sup.problem
        assert "free it" in sup.problem and sup.restarts == 0
    finally:
        squatter.close()
    info = sup.restart()  # freed: the next attempt takes the same port
    started.append(info)
    assert info.port == first.port and sup.problem == ""


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

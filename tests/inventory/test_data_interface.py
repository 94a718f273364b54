"""`[[hosts]] data_interface`: from hosts.toml through daemon.json to the host daemon,
which names it to its workers (runtime/netif.py); a malformed name is the inventory's error."""

from __future__ import annotations

import json

import pytest

from eltctl.errors import ConfigError
from eltctl.hosts import ops as hostops
from eltctl.hosts.layout import HostPaths
from eltctl.inventory import parse_inventory
from eltctl_runtime.daemon import DaemonConfig
from eltctl_runtime.daemon.config import data_plane

JOB = '[job]\nname = "j"\ncommand = "python t.py"\n'


def test_a_hosts_interface_reaches_its_daemon(tmp_path):
    inv = parse_inventory(JOB + '[[hosts]]\nname = "a"\naddress = "a"\ndata_interface = "lo"\n'
                                '[[hosts]]\nname = "b"\naddress = "b"\n', tmp_path / "hosts.toml")
    a, b = inv.hosts
    assert (a.data_interface, b.data_interface) == ("lo", None)
    docs = [hostops.daemon_config(inv, h, HostPaths(home="/h", job="j", host=h.name), "127.0.0.1:1", None)
            for h in (a, b)]
    assert [d["data_interface"] for d in docs] == ["lo", None]
    plane, env = data_plane(DaemonConfig.from_json(json.dumps(docs[0])), {"ELTCTL_BIND_ADDRESS": "10.1.1.1"})
    assert (plane.interface, plane.source, env["ELTCTL_BIND_ADDRESS"]) == ("lo", "inventory", "127.0.0.1")


@pytest.mark.parametrize("value, message", [
    ('"eth 1"', "is not a network interface name"),
    ('"averyveryverylongname0"', "is not a network interface name"),
    ("3", "must be a string"),
])
def test_a_malformed_interface_is_the_inventorys_error(tmp_path, value, message):
    with pytest.raises(ConfigError) as info:
        parse_inventory(JOB + f'[[hosts]]\nname = "a"\naddress = "a"\ndata_interface = {value}\n',
                        tmp_path / "hosts.toml")
    assert f'hosts[0].data_interface (host "a"): ' in str(info.value) and message in str(info.value)

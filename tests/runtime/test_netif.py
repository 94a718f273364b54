"""The data plane's interface (runtime/netif.py): a table of cases for the choice, the
host's own table, `ip -o addr show`'s output, and the daemon's variables for its workers."""

from __future__ import annotations

import json
import os

import pytest

from eltctl_runtime import netif
from eltctl_runtime.daemon.config import DaemonConfig, DaemonConfigError, data_plane

TABLE = {"lo": ("127.0.0.1", "::1"), "eth0": ("10.0.0.5", "fe80::1"), "eth1": ("192.168.7.2",),
         "ib0": ("fd00::7",), "docker0": ()}

IP_ADDR = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
2: eth0    inet 10.0.0.5/24 brd 10.0.0.255 scope global eth0\\       valid_lft forever preferred_lft forever
2: eth0    inet 10.0.0.6/24 scope global secondary eth0:1\\       valid_lft forever preferred_lft forever
3: veth1@if7    inet6 fe80::2/64 scope link \\       valid_lft forever preferred_lft forever
"""


@pytest.mark.parametrize("address, interface, expect", [
    ("10.0.0.5", None, ("eth0", "10.0.0.5", "address")),
    ("127.0.0.1", None, ("lo", "127.0.0.1", "address")),
    ("127.0.0.2", None, ("lo", "127.0.0.2", "address")),  # all of 127/8 is the loopback's
    ("::1", None, ("lo", "::1", "address")),
    ("fd00::7", None, ("ib0", "fd00::7", "address")),
    ("172.16.0.1", None, (None, "172.16.0.1", "address")),  # nobody holds it: nothing is named
    ("10.0.0.5", "eth1", ("eth1", "192.168.7.2", "inventory")),  # the inventory wins, with its address
    ("10.0.0.5", "ib0", ("ib0", "fd00::7", "inventory")),
])
def test_the_data_plane_follows_the_address_unless_the_inventory_names_an_interface(address, interface, expect):
    plane = netif.choose(TABLE, address=address, interface=interface)
    assert (plane.interface, plane.address, plane.source) == expect


@pytest.mark.parametrize("interface, message", [
    ("eth9", "'eth9' is not an interface of this host; it has: docker0 (no address), eth0 (10.0.0.5, fe80::1)"),
    ("docker0", "'docker0' has no address"),
])
def test_an_unknown_interface_is_a_clear_error(interface, message):
    with pytest.raises(netif.DataInterfaceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        netif.choose(TABLE, address="10.0.0.5", interface=interface)


def test_the_variables_leave_what_the_job_sets_alone():
    plane = netif.choose(TABLE, address="10.0.0.5")
    assert netif.plane_env(plane, {}) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert netif.plane_env(plane, {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert netif.plane_env(netif.choose(TABLE, address="172.16.0.1"), {}) == {}
    chosen = netif.choose(TABLE, address="10.0.0.5", interface="eth1")
    assert netif.plane_env(chosen, {}) == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1",
                                           "ELTCTL_BIND_ADDRESS": "192.168.7.2"}


def test_ip_addr_output_and_this_hosts_table():
    assert netif.parse_ip_addr(IP_ADDR) == {"lo": ("127.0.0.1", "::1"), "eth0": ("10.0.0.5", "10.0.0.6"),
                                            "veth1": ("fe80::2",)}
    here = netif.addresses()
    assert "127.0.0.1" in here["lo"]
    assert netif.choose(here, address="127.0.0.3").interface == "lo"


CFG = {"job": "j", "host": "h1", "store": "127.0.0.1:29400", "job_dir": "/tmp/x", "code_dir": "/tmp/x/code",
       "command": ["python", "train.py"]}


def test_the_daemon_names_the_interface_of_its_address_to_its_workers():
    cfg = DaemonConfig.from_json(json.dumps(CFG))
    plane, env = data_plane(cfg, {"ELTCTL_BIND_ADDRESS": "127.0.0.2"})
    assert plane.interface == "lo" and env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    plane, env = data_plane(cfg, {})  # no SSH address: the address towards the store (127.0.0.1)
    assert plane.address == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    user = DaemonConfig.from_json(json.dumps(dict(CFG, env={"GLOO_SOCKET_IFNAME": "eth7"})))
    assert data_plane(user, {})[1] == {"NCCL_SOCKET_IFNAME": "lo"}  # the job's own setting stays
    assert data_plane(cfg, {"NCCL_SOCKET_IFNAME": "x"})[1] == {"GLOO_SOCKET_IFNAME": "lo"}
    local = DaemonConfig.from_json(json.dumps(dict(CFG, env={"ELTCTL_BIND_ADDRESS": "127.0.0.3"})))
    assert data_plane(local, {"ELTCTL_BIND_ADDRESS": "10.9.9.9"})[0].address == "127.0.0.3"  # a local host's
    lo = DaemonConfig.from_json(json.dumps(dict(CFG, data_interface="lo")))
    assert data_plane(lo, {"ELTCTL_BIND_ADDRESS": "10.9.9.9"})[1]["ELTCTL_BIND_ADDRESS"] == "127.0.0.1"


def test_a_data_interface_the_host_lacks_fails_the_daemons_config(tmp_path):
    path = tmp_path / "daemon.json"
    path.write_text(json.dumps(dict(CFG, data_interface="eltctl-none0")))
    with pytest.raises(DaemonConfigError, match="host h1: data_interface 'eltctl-none0' is not an interface"):
        DaemonConfig.load(path)
    with pytest.raises(DaemonConfigError, match="'data_interface' must be null or an interface name"):
        DaemonConfig.from_json(json.dumps(dict(CFG, data_interface=3)))
    path.write_text(json.dumps(dict(CFG, data_interface="lo")))
    assert DaemonConfig.load(path).data_interface == "lo"


def test_a_daemon_whose_store_is_a_unix_socket_names_loopback_as_the_workers_do():
    # before: "invalid literal for int()" from the socket's path, a warning at every daemon start
    cfg = DaemonConfig.from_json(json.dumps(dict(CFG, store="unix:/tmp/eltctl-x/store.sock")))
    plane, env = data_plane(cfg, {})
    assert plane.address == "127.0.0.1" and plane.interface == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    plane, _ = data_plane(cfg, {"ELTCTL_BIND_ADDRESS": "127.0.0.2"})  # the controller's address wins
    assert plane.address == "127.0.0.2"


# ------------------------------------------------------------------- who is connected to a listener

PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 100 1 0
   1: 0100007F:1F90 0100007F:A000 01 00000000:00000000 00:00000000 00000000     0        0 101 1 0
   2: 0100007F:A000 0100007F:1F90 01 00000000:00000000 00:00000000 00000000 65534        0 900 1 0
   3: 0100007F:B000 0500000A:0016 01 00000000:00000000 00:00000000 00000000     0        0 102 1 0
   4: 0100007F:1F90 0600000A:C000 01 00000000:00000000 00:00000000 00000000     0        0 103 1 0
"""


def test_the_connections_a_process_accepted_name_a_local_peers_account():
    from eltctl_runtime.netif import accepted_connections, parse_proc_net_tcp

    rows = parse_proc_net_tcp(PROC_NET_TCP)
    assert rows[0].local == ("127.0.0.1", 8080) and rows[3].remote == ("10.0.0.5", 22)
    # ours: the listener (100), two accepted connections (101, 103) and one we opened (102)
    assert accepted_connections(rows, {100, 101, 102, 103}) == [("10.0.0.6", 49152, None),
                                                                ("127.0.0.1", 40960, 65534)]
    assert accepted_connections(rows, {102}) == []


def test_one_remote_end_seen_with_and_without_its_owner_does_not_break_the_report():
    # before: "'<' not supported between instances of 'int' and 'NoneType'" from sorting, which
    # ended a worker in the middle of reporting a hijacked pair (the listener race test hung)
    from eltctl_runtime.netif import accepted_connections, parse_proc_net_tcp

    text = PROC_NET_TCP + """\
   5: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 104 1 0
   6: 0100007F:1F91 0100007F:A000 01 00000000:00000000 00:00000000 00000000     0        0 105 1 0
"""
    rows = parse_proc_net_tcp(text)
    assert accepted_connections(rows, {100, 101, 104, 105}) == [("127.0.0.1", 40960, None),
                                                                ("127.0.0.1", 40960, 65534)]


def test_the_connections_to_this_processs_own_listener_are_found():
    import socket

    from eltctl_runtime.netif import connections_to_my_listeners

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()) as client:
            accepted, _ = listener.accept()
            with accepted:
                assert (*client.getsockname(), os.getuid()) in connections_to_my_listeners()

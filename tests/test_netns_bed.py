"""The shaped network bed (tests/testbed/netns.py): its qdisc plan, and real namespaces.

The plan (`tc_commands`) and the stale-namespace rule are pure and table-tested.
On real namespaces (root only; skipped with the reason otherwise): two hosts
answer each other's ICMP echo, a 100 Mbit/s link carries a TCP stream at about
that rate (loose bounds: the machine is shared, the point is that the shaping is
real), a 5 ms delay shows in a TCP connect's round trip, and a closed bed leaves
no process, namespace or interface behind, nor one a dead bed left.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.testbed import procs
from tests.testbed.netns import (
    IFNAME,
    Link,
    NetBed,
    list_namespaces,
    namespace_name,
    netns_missing_reason,
    shaping_missing_reason,
    stale_namespaces,
    tc_commands,
)

TBF_100 = ["tbf", "rate", "100mbit", "burst", "262144", "latency", "50ms"]


@pytest.mark.parametrize("link, sending, expected", [
    (Link(), True, []),
    (Link(rate_mbit=100), True, [["qdisc", "add", "dev", "d", "root", *TBF_100]]),
    (Link(rate_mbit=100), False, [["qdisc", "add", "dev", "d", "root", *TBF_100]]),
    # Delay and loss only on the host's own sending side; the switch port gets the rate.
    (Link(delay_ms=5, jitter_ms=1, loss_pct=0.5), True,
     [["qdisc", "add", "dev", "d", "root", "netem", "limit", "100000", "delay", "5ms", "1ms", "loss", "0.5%"]]),
    (Link(delay_ms=5), False, []),
    (Link(rate_mbit=100, delay_ms=0.2), True,
     [["qdisc", "add", "dev", "d", "root", "handle", "1:", "netem", "limit", "100000", "delay", "0.2ms"],
      ["qdisc", "add", "dev", "d", "parent", "1:1", "handle", "10:", *TBF_100]]),
    (Link(rate_mbit=100, delay_ms=5), False, [["qdisc", "add", "dev", "d", "root", *TBF_100]]),
])
def test_tc_commands_shape_rate_both_ways_and_delay_on_the_senders_side(link, sending, expected):
    assert tc_commands("d", link, sending=sending) == expected


def test_tbf_burst_grows_with_the_rate_so_10gbit_is_reachable():
    (cmd,) = tc_commands("d", Link(rate_mbit=10_000), sending=True)
    assert int(cmd[cmd.index("burst") + 1]) == 5_000_000  # 4 ms at 10 Gbit/s


@pytest.mark.parametrize("bad", [dict(rate_mbit=0), dict(delay_ms=-1), dict(loss_pct=101), dict(jitter_ms=1)])
def test_link_refuses_nonsense(bad):
    with pytest.raises(ValueError, match="Link"):
        Link(**bad)


def test_only_namespaces_of_dead_beds_are_stale():
    names = [namespace_name(10, "ab", "h1"), namespace_name(11, "cd", "sw"), "eltnet-probe", "other-10-x"]
    assert stale_namespaces(names, alive=lambda pid: pid == 11) == [names[0]]


# --- on real namespaces --------------------------------------------------------------

def _need_netns() -> None:
    reason = netns_missing_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def bed100():
    """Two hosts, each on a 100 Mbit/s link, shared by the tests below."""
    _need_netns()
    with NetBed({"h1": Link(rate_mbit=100), "h2": Link(rate_mbit=100)}) as bed:
        yield bed


PING = r"""
import os, socket, struct, sys, time
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xFFFF); s += s >> 16
    return ~s & 0xFFFF
ident = os.getpid() & 0xFFFF
body = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + b"eltnet-ping!"
packet = body[:2] + struct.pack("!H", csum(body)) + body[4:]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.settimeout(5)
s.sendto(packet, (sys.argv[1], 0))
while True:
    data, (src, _) = s.recvfrom(1500)
    icmp = data[(data[0] & 0xF) * 4:]
    if src == sys.argv[1] and icmp[0] == 0 and struct.unpack("!H", icmp[4:6])[0] == ident:
        print("reply from", src); break
"""


def test_two_hosts_ping_each_other(bed100):
    for src, dst in (("h1", "h2"), ("h2", "h1")):
        out = bed100.check_in(src, [sys.executable, "-c", PING, bed100.address(dst)], timeout=30).stdout
        assert out.strip() == f"reply from {bed100.address(dst)}"


RECEIVER = r"""
import json, socket, sys, time
srv = socket.create_server((sys.argv[1], 5001))
conn, _ = srv.accept()
got, start = 0, None
while chunk := conn.recv(1 << 16):
    start = start or time.perf_counter()
    got += len(chunk)
print(json.dumps({"bytes": got, "seconds": time.perf_counter() - start}))
"""

SENDER = r"""
import socket, sys, time
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], 5001), timeout=5); break
    except OSError:
        time.sleep(0.05)
s.sendall(b"x" * int(sys.argv[2]))
s.close()
"""


def test_a_100mbit_link_carries_about_100mbit(bed100):
    size = 5_000_000
    receiver = bed100.run_in("h2", [sys.executable, "-c", RECEIVER, bed100.address("h2")],
                             stdout=subprocess.PIPE, text=True)
    bed100.check_in("h1", [sys.executable, "-c", SENDER, bed100.address("h2"), str(size)], timeout=60)
    out, _ = receiver.communicate(timeout=60)
    result = json.loads(out)
    assert result["bytes"] == size
    mbit = size * 8 / result["seconds"] / 1e6
    # Unshaped, a veth pair carries several Gbit/s here; 100 Mbit/s means the tbf is real.
    assert 30 < mbit < 150, f"measured {mbit:.0f} Mbit/s on a 100 Mbit/s link"


CONNECT_RTT = r"""
import socket, sys, time
for _ in range(100):  # the acceptor may not listen yet: this first connect is not timed
    try:
        socket.create_connection((sys.argv[1], 5002), timeout=5).close(); break
    except ConnectionRefusedError:
        time.sleep(0.05)
best = 1e9
for _ in range(5):
    t = time.perf_counter()
    socket.create_connection((sys.argv[1], 5002), timeout=5).close()
    best = min(best, time.perf_counter() - t)
print(best * 1000)
"""

ACCEPTOR = r"""
import socket, sys
srv = socket.create_server((sys.argv[1], 5002), backlog=16)
for _ in range(6):
    srv.accept()[0].close()
"""


def test_a_5ms_delay_shows_in_a_tcp_connect_round_trip():
    _need_netns()
    link = Link(delay_ms=5)
    reason = shaping_missing_reason(link)
    if reason:
        pytest.skip(reason)
    with NetBed({"h1": link, "h2": link}) as bed:
        bed.run_in("h2", [sys.executable, "-c", ACCEPTOR, bed.address("h2")])
        rtt_ms = float(bed.check_in("h1", [sys.executable, "-c", CONNECT_RTT, bed.address("h2")]).stdout)
    # SYN out through h1's 5 ms, SYN-ACK back through h2's 5 ms.
    assert rtt_ms >= 8, f"connect RTT {rtt_ms:.2f} ms with 5 ms each way"


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_close_leaves_no_process_namespace_or_interface():
    _need_netns()
    links_before = _root_links()
    bed = NetBed(2)
    with bed:
        made = bed.namespaces()
        sleeper = bed.run_in("h1", ["sleep", "300"])
        # A process the bed did not start itself (an sshd that daemonized, say).
        stray = bed.check_in("h2", ["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"]).stdout
        assert len(made) == 3 and set(made) <= set(list_namespaces())
        assert "veth" in bed.check_in("h1", ["ip", "-d", "link", "show", IFNAME]).stdout
    assert sleeper.poll() is not None
    assert not procs.is_alive(int(stray))
    assert not set(made) & set(list_namespaces())
    assert _root_links() == links_before  # no veth, no bridge in the machine's own namespace


def test_a_dead_beds_namespaces_are_removed_at_the_next_start():
    _need_netns()
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = namespace_name(dead.pid, "dead01", "h1")
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    try:
        with NetBed(1):
            assert leftover not in list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", leftover], capture_output=True)

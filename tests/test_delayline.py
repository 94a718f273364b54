"""The user-space delay line (tests/testbed/delayline.py): a bed's delay where the kernel has no netem.

Its release rule is pure and tested as such: the delay, jitter that never reorders,
a seeded loss. On real namespaces (root only): a bed made with `delay_line=True`
sends what each host sends through its TAP, a reshape to 5 ms shows in a TCP connect's round trip
and back to 0 takes it away, a 100 Mbit/s link with a delay still carries about
100 Mbit/s (the kernel's tbf keeps the rate), a link losing every packet carries
nothing, and a closed bed leaves no delay line, namespace or interface behind.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.test_netns_bed import ACCEPTOR, CONNECT_RTT, RECEIVER, SENDER
from tests.testbed import procs
from tests.testbed.delayline import Shape
from tests.testbed.netns import IFNAME, LINE_TAP, Link, NetBed, list_namespaces, netns_missing_reason


def test_a_packet_leaves_after_the_delay():
    assert Shape(5, 0, 0, seed=1).release_at(100.0) == pytest.approx(100.005)
    assert Shape(0, 0, 0, seed=1).release_at(7.0) == 7.0


def test_jitter_varies_the_delay_but_never_reorders():
    shape = Shape(5, 4, 0, seed=3)
    sent = [i * 0.0005 for i in range(2000)]  # one packet every 0.5 ms, less than the jitter's spread
    out = [shape.release_at(t) for t in sent]
    assert out == sorted(out)
    delays = [o - t for o, t in zip(out, sent)]
    assert min(delays) >= 0.001 - 1e-12 and max(delays) <= 0.009 + 1e-12
    assert max(delays) - min(delays) > 0.005  # it does vary


def test_jitter_above_the_delay_never_sends_before_the_packet_came():
    shape = Shape(1, 5, 0, seed=4)
    assert all(shape.release_at(t) >= t for t in (0.0, 0.001, 0.002, 0.003))


def test_loss_drops_about_its_share_and_none_without_it():
    lossy = Shape(0, 0, 10, seed=5)
    dropped = sum(lossy.release_at(0.0) is None for _ in range(10_000))
    assert 850 < dropped < 1150
    assert all(Shape(2, 1, 0, seed=5).release_at(0.0) is not None for _ in range(1000))
    assert all(Shape(0, 0, 100, seed=5).release_at(0.0) is None for _ in range(100))


def test_a_reshape_changes_the_rule_and_nonsense_is_refused():
    shape = Shape(0, 0, 0, seed=1)
    shape.set(5, 0, 0)
    assert shape.release_at(1.0) == pytest.approx(1.005)
    for bad in ((-1, 0, 0), (1, -1, 0), (0, 0, 101)):
        with pytest.raises(ValueError, match="delay"):
            shape.set(*bad)


# --- on real namespaces --------------------------------------------------------------

@pytest.fixture(scope="module")
def line_bed():
    """Two hosts joined through the delay line (unshaped at first), shared below."""
    reason = netns_missing_reason()
    if reason:
        pytest.skip(reason)
    with NetBed(2, delay_line=True) as bed:
        yield bed


def _connect_rtt_ms(bed) -> float:
    bed.run_in("h2", [sys.executable, "-c", ACCEPTOR, bed.address("h2")])
    return float(bed.check_in("h1", [sys.executable, "-c", CONNECT_RTT, bed.address("h2")]).stdout)


def test_a_delay_line_hosts_sends_go_through_its_tap_and_a_reshape_delays_them(line_bed):
    assert "veth" in line_bed.check_in("h1", ["ip", "-d", "link", "show", IFNAME]).stdout
    assert "tun type tap" in line_bed.check_in("h1", ["ip", "-d", "link", "show", LINE_TAP]).stdout
    egress = line_bed.check_in("h1", ["tc", "filter", "show", "dev", IFNAME, "egress"]).stdout
    assert "mirred" in egress and LINE_TAP in egress, egress
    assert _connect_rtt_ms(line_bed) < 4
    line_bed.reshape_all(Link(delay_ms=5))
    try:
        # SYN out through h1's 5 ms, SYN-ACK back through h2's 5 ms.
        assert 9.5 <= _connect_rtt_ms(line_bed) < 40
    finally:
        line_bed.reshape_all(Link())
    assert _connect_rtt_ms(line_bed) < 4


def test_a_delayed_100mbit_link_carries_about_100mbit(line_bed):
    line_bed.reshape_all(Link(rate_mbit=100, delay_ms=2))
    try:
        size = 5_000_000
        receiver = line_bed.run_in("h2", [sys.executable, "-c", RECEIVER, line_bed.address("h2")],
                                   stdout=subprocess.PIPE, text=True)
        line_bed.check_in("h1", [sys.executable, "-c", SENDER, line_bed.address("h2"), str(size)], timeout=60)
        result = json.loads(receiver.communicate(timeout=60)[0])
    finally:
        line_bed.reshape_all(Link())
    assert result["bytes"] == size
    mbit = size * 8 / result["seconds"] / 1e6
    assert 30 < mbit < 150, f"measured {mbit:.0f} Mbit/s on a 100 Mbit/s link with 2 ms each way"


CONNECT_ONCE = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], 22), timeout=1.5)
except ConnectionRefusedError:
    print("refused")
except OSError:
    print("timed out")
"""


def test_a_link_that_loses_every_packet_carries_nothing(line_bed):
    line_bed.reshape("h1", Link(loss_pct=100))
    try:
        lost = line_bed.check_in("h1", [sys.executable, "-c", CONNECT_ONCE, line_bed.address("h2")]).stdout
    finally:
        line_bed.reshape("h1", Link())
    back = line_bed.check_in("h1", [sys.executable, "-c", CONNECT_ONCE, line_bed.address("h2")]).stdout
    assert (lost.strip(), back.strip()) == ("timed out", "refused")  # nothing listens on h2's port 22


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_a_closed_delay_line_bed_leaves_nothing():
    reason = netns_missing_reason()
    if reason:
        pytest.skip(reason)
    links_before = _root_links()
    bed = NetBed(1, delay_line=True)
    with bed:
        made = bed.namespaces()
        lines = list(bed._lines.values())
        assert lines and all(line.poll() is None for line in lines)
    assert all(not procs.is_alive(line.pid) for line in lines)
    assert not set(made) & set(list_namespaces())
    assert _root_links() == links_before

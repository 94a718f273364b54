"""The link test (eltctl/linkspeed.py): its plan, figures and verdict (tables of cases),
one pair through the transports on this machine's loopback (`measure_pair`, as the
commands run it), and its host program on a real shaped link.

On the netns bed (tests/testbed/netns.py, root only; skipped with the reason otherwise)
three hosts: h1 behind a 50 Mbit/s tbf, h2 and h3 unshaped. The receiver and sender
(eltctl/hosts/programs/link_test.py, the source the SSH path runs, run here with
`python -c` inside the namespaces) measure h2 -> h1 well below 80 Mbit/s and h2 -> h3
far above it (ratios with wide margins: the machine is shared); a connection without
the token is closed and its bytes are never counted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eltctl.checks import Check, Report, Status
from eltctl.hosts import programs
from eltctl.linkspeed import (
    REFERENCE_GRAD_BYTES,
    Figure,
    Pair,
    advice,
    allreduce_seconds,
    grad_bytes_of,
    host_links,
    link_check,
    measure_pair,
    parse_receiver,
    ring,
    sender_error,
    slowest,
    up_lines,
    with_link_checks,
)

# --------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("names, pairs", [
    ([], []),
    (["a"], []),
    (["a", "b"], [("a", "b"), ("b", "a")]),  # one pair, both directions
    (["a", "b", "c"], [("a", "b"), ("b", "c"), ("c", "a")]),
    (["a", "b", "c", "d"], [("a", "b"), ("b", "c"), ("c", "d"), ("d", "a")]),
])
def test_ring_has_one_pair_per_host_each_sending_and_receiving_once(names, pairs):
    plan = ring(names)
    assert [(p.sender, p.receiver) for p in plan] == pairs
    if len(names) >= 2:
        assert sorted(p.sender for p in plan) == sorted(names) == sorted(p.receiver for p in plan)


# --------------------------------------------------------------------------- the figures

def test_the_receivers_answer_becomes_a_rate():
    f = parse_receiver('port 4242\n{"bytes": 12500000, "seconds": 1.0, "rejected": 2}\n', Pair("a", "b"), "10.0.0.2")
    assert f == Figure("a", "b", "10.0.0.2", bytes=12_500_000, seconds=1.0, rejected=2)
    assert f.mbit_s == pytest.approx(100.0)
    assert f.to_json() == {"from": "a", "to": "b", "address": "10.0.0.2", "mbit_s": 100.0, "bytes": 12_500_000,
                           "seconds": 1.0, "rtt_ms": None, "error": None}
    assert Figure.from_json(f.to_json()).mbit_s == pytest.approx(100.0)


@pytest.mark.parametrize("rtt, expected", [(0.412, 0.412), (10, 10.0), (None, None), (-1, None), ("3", None),
                                           (True, None)])
def test_the_receivers_round_trip_is_read_only_as_a_number(rtt, expected):
    doc = json.dumps({"bytes": 1000, "seconds": 0.5, "rejected": 0, "rtt_ms": rtt})
    f = parse_receiver(f"port 1\n{doc}\n", Pair("a", "b"), "10.0.0.2")
    assert f.rtt_ms == expected and f.mbit_s == pytest.approx(0.016)
    assert Figure.from_json(f.to_json()).rtt_ms == expected


@pytest.mark.parametrize("text, error", [
    ('port 1\n{"error": "no sender connected within 5 s", "rejected": 1}\n', "no sender connected within 5 s"),
    ("port 1\n", "the receiver gave no answer"),
    ('{"bytes": "many"}', "malformed"),
])
def test_a_receiver_without_a_figure_says_why(text, error):
    f = parse_receiver(text, Pair("a", "b"), "x")
    assert error in (f.error or "") and f.mbit_s is None


def test_nothing_timed_is_no_rate_and_the_slowest_is_the_lowest_timed():
    fast = Figure("a", "b", "x", bytes=10**9, seconds=1.0)
    slow = Figure("b", "c", "y", bytes=10**7, seconds=1.0)
    untimed = Figure("c", "a", "z", bytes=10**6, seconds=0.0)
    failed = Figure("c", "a", error="refused")
    assert untimed.mbit_s is None and failed.mbit_s is None
    assert slowest([fast, untimed, slow, failed]) is slow
    assert slowest([failed, untimed]) is None
    assert host_links([fast, slow]) == {"a": fast.to_json(), "b": slow.to_json()}


# --------------------------------------------------------------------------- the verdict

def test_the_wire_time_matches_the_measured_all_reduce():
    # docs/network.md: 200 MB, 2 ranks, 1 Gbit/s took 1.77 s; the wire alone 1.6 s.
    assert allreduce_seconds(200e6, 1000, 2) == pytest.approx(1.6)
    assert allreduce_seconds(200e6, 1000, 4) == pytest.approx(2.4)  # 2 (N-1)/N of it per rank
    assert allreduce_seconds(200e6, 1000, 1) == allreduce_seconds(200e6, 1000, 2)  # a pair at least


@pytest.mark.parametrize("mbit, world, grad, bound, mode", [
    (10_000, 2, None, False, None),  # 10 GbE: 0.16 s, hidden by a GPU's step
    (5_000, 2, None, True, "bf16"),  # 0.32 s: halved, within the compute
    (1_000, 2, None, True, "local"),  # 1 GbE: 1.6 s, bf16's 0.8 s is still the network's
    (1_000, 4, None, True, "local"),
    (1_000, 2, 496e6, True, "local"),  # GPT-2 small: 4 s a step
    (1_000, 2, 20e6, False, None),  # a small model's 20 MB: 0.16 s
    (100, 2, 50e6, True, "local"),  # issue 51's 100 Mbit/s row
])
def test_advice_names_the_network_and_the_mode_that_pays(mbit, world, grad, bound, mode):
    a = advice(mbit, world, grad)
    assert (a.network_bound, a.mode) == (bound, mode), a.text
    if bound:
        assert "the network, not the GPUs, will set the job's speed" in a.text
        assert 'grad_dtype="bf16"' in a.text and f'sync="local", sync_every={a.sync_every}' in a.text
        assert a.sync_s / a.sync_every <= 0.1 * 0.25  # H keeps the sync under a tenth of the compute
        # the one that pays is named as such
        paying = a.text.index("that pays here")
        first = a.text.index('grad_dtype="bf16"') if mode == "bf16" else a.text.index('sync="local"')
        assert first < paying
        # where bf16 is not enough, the low-rank compressor is named as the synchronous alternative
        low_rank = a.text.find('ElasticJob(compress="powersgd", compress_rank=4)')
        assert (low_rank > paying) if mode == "local" else (low_rank == -1)
    else:
        assert "the GPUs, not the network, set the job's speed" in a.text
    if grad is None:
        assert "rule of thumb" in a.text and "not known" in a.text
    else:
        assert f"the job's {grad / 1e6:,.0f} MB" in a.text


def test_advice_scales_with_the_models_bytes():
    assert advice(1000, 2, 2 * REFERENCE_GRAD_BYTES).sync_s == pytest.approx(2 * advice(1000, 2).sync_s)


@pytest.mark.parametrize("status, expected", [
    (None, None), ({}, None), ({"network": None}, None), ({"network": {"bytes_per_step": 0}}, None),
    ({"network": {"bytes_per_step": "x"}}, None), ({"network": {"bytes_per_step": 4e8}}, 4e8),
])
def test_the_jobs_bytes_per_step_come_from_its_status(status, expected):
    assert grad_bytes_of(status) == expected


def test_doctors_link_check_warns_on_a_slow_or_failed_link():
    fast = [Figure("a", "b", "x", bytes=2 * 10**9, seconds=1.0), Figure("b", "a", "y", bytes=2 * 10**9, seconds=1.0)]
    slow = [fast[0], Figure("b", "a", "y", bytes=125 * 10**6, seconds=1.0)]  # 1 Gbit/s one way
    assert link_check("a", fast, 2).status is Status.OK
    check = link_check("a", slow, 2)
    assert check.status is Status.WARN and "1,000 Mbit/s" in check.detail and 'sync="local"' in check.fix
    failed = link_check("b", [Figure("a", "b", "x", error="no sender connected within 5 s")], 2)
    assert failed.status is Status.WARN and "firewall" in failed.fix
    assert link_check("c", fast, 2) is None
    reports = [Report("a", "x", (Check("python", Status.OK, "3.11"),)), Report("c", "z", ())]
    out = with_link_checks(reports, slow)
    assert [c.name for c in out[0].checks] == ["python", "link"] and out[1] == reports[1]


def test_up_says_nothing_without_figures_and_the_advice_when_slow():
    assert up_lines([]) == []
    fast = up_lines([Figure("a", "b", "x", bytes=2 * 10**9, seconds=1.0)])
    assert len(fast) == 1 and fast[0].startswith("link test: slowest a -> b")
    slow = up_lines([Figure("a", "b", "x", bytes=125 * 10**6, seconds=1.0)], grad_bytes=50e6)
    assert slow[1].startswith("hint: ") and "the job's 50 MB" in slow[1]
    failed = up_lines([Figure("a", "b", error="refused")])
    assert failed == ["warning: link test a -> b: not measured: refused"]


@pytest.mark.parametrize("status, stdout, stderr, expected", [
    (0, '{"sent": 100}\n', "", None),
    (0, '{"error": "cannot connect to 10.0.0.2 port 5: refused"}\n', "", "cannot connect to 10.0.0.2 port 5: refused"),
    (127, "", "sh: 1: python3: not found\n", "exit 127: sh: 1: python3: not found"),
])
def test_why_the_sender_measured_nothing(status, stdout, stderr, expected):
    assert sender_error(status, stdout, stderr) == expected


# --------------------------------------------------------------------------- one pair, through transports

def test_a_pair_through_local_transports_measures_and_a_foreign_address_is_named():
    """measure_pair as probe/doctor/up run it (open_stream for the receiver, run for the
    sender), on this machine's loopback: a figure; on an address this machine lacks
    (TEST-NET-1), the receiver cannot listen and the figure says so."""
    import asyncio

    from eltctl.hosts.local import LocalTransport
    from eltctl.inventory import Host

    a, b = Host("a", "local", python=sys.executable), Host("b", "local", python=sys.executable)
    transports = {"a": LocalTransport(a), "b": LocalTransport(b)}
    good = asyncio.run(measure_pair(Pair("a", "b"), a, b, transports, "127.0.0.1", seconds=0.3,
                                    max_bytes=8 << 20))
    assert good.error is None and good.mbit_s > 0 and good.address == "127.0.0.1", good
    bad = asyncio.run(measure_pair(Pair("a", "b"), a, b, transports, "192.0.2.1", seconds=0.3))
    assert bad.mbit_s is None and "could not listen on 192.0.2.1" in bad.error, bad


# --------------------------------------------------------------------------- on a shaped link


@pytest.fixture(scope="module")
def bed():
    from tests.testbed.netns import Link, NetBed, netns_missing_reason, shaping_missing_reason

    reason = netns_missing_reason() or shaping_missing_reason(Link(rate_mbit=50))
    if reason:
        pytest.skip(reason)
    with NetBed({"h1": Link(rate_mbit=50), "h2": Link(), "h3": Link()}) as bed:
        yield bed


def transfer(bed, sender: str, receiver: str, *, intruder: bool = False) -> Figure:
    """One transfer with the host program, as the SSH path runs it (token on stdin)."""
    source, token, address = programs.source("link_test"), "0123456789abcdef" * 2, bed.address(receiver)
    recv = bed.run_in(receiver, [sys.executable, "-c", source, "recv", address, "10", "1"],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        recv.stdin.write(token + "\n")
        recv.stdin.close()
        word, port = recv.stdout.readline().split()
        assert word == "port"
        if intruder:  # connects first, without the token, and sends plenty
            bed.check_in(sender, [sys.executable, "-c", INTRUDER, address, port], timeout=30)
        send = bed.run_in(sender, [sys.executable, "-c", source, "send", address, port, "1", str(32 << 20)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(send.communicate(token + "\n", timeout=30)[0])["sent"] > 0
        out = recv.stdout.read()  # the receiver ends by itself (ACCEPT_S + SECONDS + 2 s at most)
        recv.wait(timeout=30)
    finally:
        recv.kill()
    return parse_receiver(out, Pair(sender, receiver), address)


INTRUDER = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
try:
    s.sendall(b"not-the-token-" + bytes(4 << 20))
except OSError:
    pass
"""


def test_a_delayed_link_shows_its_round_trip():
    """Five milliseconds each way (through the delay line where the kernel has no netem):
    the receiver's round trip is at least the 10 ms both ways add, an undelayed pair's
    far less, and the figure carries it into JSON and its line."""
    from tests.testbed.netns import Link, NetBed, netns_missing_reason, shaping_missing_reason

    reason = netns_missing_reason() or shaping_missing_reason(Link(delay_ms=5))
    if reason:
        pytest.skip(reason)
    with NetBed({"h1": Link(delay_ms=5), "h2": Link(delay_ms=5), "h3": Link()}) as delayed:
        far, near = transfer(delayed, "h1", "h2"), transfer(delayed, "h3", "h2")
    assert far.error is None and near.error is None, (far, near)
    assert 9.5 <= far.rtt_ms < 40, far
    assert near.rtt_ms < 9.5 and near.rtt_ms < far.rtt_ms - 4, near  # h2's own 5 ms stays in it
    assert Figure.from_json(far.to_json()).rtt_ms == far.rtt_ms
    assert f"round trip {far.rtt_ms:.2f} ms" in far.describe()


def test_a_50mbit_link_measures_far_below_an_unshaped_one_and_strangers_are_not_counted(bed):
    shaped = transfer(bed, "h2", "h1")
    unshaped = transfer(bed, "h2", "h3", intruder=True)
    assert shaped.error is None and unshaped.error is None, (shaped, unshaped)
    assert shaped.mbit_s < 80, shaped
    assert unshaped.mbit_s > 5 * shaped.mbit_s, (shaped, unshaped)
    assert unshaped.rejected == 1 and shaped.rejected == 0
    # the shaped figure is what the verdict reads: a 50 Mbit/s office link sets the job's speed
    assert advice(shaped.mbit_s, 2).network_bound

"""Another account racing the gloo listeners of a real job's new groups (issue 21, data
plane), end to end: the signed pair handshake (collectives.verify_pairs) drops every
hijacked group and the job trains on.

The plan: a job with a secret whose workers listen on this test's own address (a
127.x.y.1 of the loopback: ELTCTL_BIND_ADDRESS, GLOO_SOCKET_IFNAME=lo); as `nobody`,
the attacker connects to every new listener there the moment it appears, naming gloo
pair sequence numbers 0..3 (it takes a pair in about half of the groups formed). Two
workers start (generation 0 is raced), a third joins (a new group, raced). What must
hold: the job reaches three workers and trains; every group the attacker held a pair of
was dropped by the handshake (the workers log it; rank 0's status counts what it saw);
the attacker received no tensor (at most a handshake message); a real stop ends the job
with identical states on every worker and every sample used exactly once (so every
all-reduce carried the honest sum).
"""

from __future__ import annotations

import json
import random
import secrets

import pytest

from eltctl_runtime.store import auth
from eltctl_runtime.netif import BIND_ADDRESS_ENV
from runtime_cluster import SMALL, assert_exactly_once, assert_identical_state
from tests.testbed import attacker

N_SAMPLES = int(SMALL[SMALL.index("--samples") + 1])
BATCH = int(SMALL[SMALL.index("--batch") + 1])
SLOW = ["--steps", "100000", "--step-sleep", "0.1"]
HANDSHAKE_BYTES = 5 + 64 + 1 + 32  # one sealed group id: all a hijacked pair ever carries


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_jobs_hijacked_groups_are_dropped_and_it_trains_on_honest_ones(cluster_factory):
    reason = attacker.can_attack_as_another_account()
    if reason:
        pytest.skip(reason)
    address = f"127.{random.randint(20, 63)}.{random.randint(0, 255)}.1"  # its own, below test beds' 127.64+
    env = {BIND_ADDRESS_ENV: address, "GLOO_SOCKET_IFNAME": "lo"}
    cluster = cluster_factory(secret=secrets.token_bytes(auth.SECRET_BYTES), hang_timeout=30.0)
    race = attacker.ListenerRace(address, seconds=300).start()
    try:
        a, b = cluster.start(2, SLOW, env=env)
        cluster.wait_world(2, steps_after=3, timeout=150)
        (c,) = cluster.start(1, SLOW, env=env)
        g = cluster.wait_world(3, steps_after=3, timeout=150)
        status = cluster.wait_for_status(lambda s: s["generation"] == g)
        seen = race.result(now=True)
    finally:
        race.stop()
    stolen = [m for m in seen["received"] if m["opcode"] in (0, 1)]  # data, not the notifications
    logs = cluster.dump_logs()
    # A hijacked pair is detected where it forms: the job's group (its handshake's missing or
    # forged message, "pair handshake gen/...") or a joiner's catch-up pair (its group's
    # handshake broke: "catch-up transfer ... pair handshake failed"; the transfer is dropped).
    dropped = logs.count("pair handshake gen/") + logs.count("'s pair handshake failed")
    print(f"as {attacker.ATTACKER}: {seen['listeners']} listeners raced, {len(seen['received'])} messages received, "
          f"with data: {json.dumps(stolen[:4])}; handshake warnings in the workers' logs: {dropped}; "
          f"rank 0's forged counts: {status.get('forged')}; generation {g}")
    assert all(m["length"] <= HANDSHAKE_BYTES for m in stolen), f"another account received a tensor: {stolen[:4]}"
    if stolen:
        assert dropped, logs
    cluster.stop()
    cluster.wait_exit([a, b, c])
    assert [w.proc.returncode for w in (a, b, c)] == [0, 0, 0], cluster.dump_logs()
    results = [w.read_result() for w in (a, b, c)]
    assert_identical_state(results)
    assert_exactly_once(cluster.audit, N_SAMPLES, BATCH, results[0]["step"])

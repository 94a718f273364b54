"""An attacker on the job's store (finding 1 of issue 14): a job run with a secret
trains on through every forged control value, counts them, and still obeys real ones.

The plan: three workers of a job with a secret train; an attacker who reaches the
store's port (a plain PrefixStore, no secret) forges a leave and a death report of
every member (with a dead/seq bump), the stop key, the current generation's abort,
the next generation's plan, join entries and a join counter raised to 10^9, the
heartbeats, rank 0's status and the done key. The job keeps training in the same
generation with the same members; rank 0's status counts the forged families; then
a real planned leave forms the next generation (replacing the forged plan), a real
joiner is admitted past the raised counter, and a real stop ends the job with every
sample used exactly once.
"""

from __future__ import annotations

import json
import secrets
from datetime import timedelta

import pytest
import torch.distributed as dist

from eltctl_runtime.store import auth
from eltctl_runtime.member.plan import Plan
from eltctl_runtime.protocol import EventKind, Keys, job_prefix
from runtime_cluster import SMALL, assert_exactly_once, assert_identical_state

N_SAMPLES = int(SMALL[SMALL.index("--samples") + 1])
BATCH = int(SMALL[SMALL.index("--batch") + 1])
FOREVER = ["--steps", "100000", "--step-sleep", "0.03"]

pytestmark = pytest.mark.slow


def attacker(cluster) -> dist.PrefixStore:
    """A client of the job's store port, as anyone on the network can make one."""
    tcp = dist.TCPStore("127.0.0.1", cluster.store.port, is_master=False, timeout=timedelta(seconds=10))
    return dist.PrefixStore(job_prefix(cluster.job), tcp)


def test_forged_control_values_are_ignored_counted_and_real_ones_still_work(cluster_factory):
    cluster = cluster_factory(secret=secrets.token_bytes(auth.SECRET_BYTES))
    workers = cluster.start(3, FOREVER)
    g = cluster.wait_world(3, steps_after=3)
    status = cluster.wait_for_status(lambda s: s["generation"] == g)
    members = status["members"]
    evil = attacker(cluster)

    for w in members:
        evil.set(Keys.leave(w), "1")
        evil.set(Keys.dead(w), "1")
        evil.set(Keys.heartbeat(w), "0")
    evil.add(Keys.DEAD_SEQ, 1)
    evil.set(Keys.STOP, "1")
    evil.set(Keys.abort(g), json.dumps({"reason": "crash", "worker": members[1]}))
    evil.set(Keys.plan(g + 1), Plan(generation=g + 1, members=("evil/0/1",), kind=EventKind.START).to_json())
    n = evil.add(Keys.JOIN_SEQ, 1)
    evil.set(Keys.join(n), "evil/0/2")
    top = evil.add(Keys.JOIN_SEQ, 10**9)
    evil.set(Keys.join(top), "evil/0/3")
    evil.set(Keys.STATUS, json.dumps(dict(status, step=10**12)))

    # The job trains on: same generation, same members, nobody left.
    step = cluster.progress()[0]
    cluster.wait_step(step + 15)
    assert cluster.progress()[1:] == (g, 3), cluster.dump_logs()
    assert len(cluster.running()) == 3, cluster.dump_logs()
    counted = cluster.wait_for_status(
        lambda s: {"stop", "leave", "dead", "gen/abort", "join"} <= set(s.get("forged", {})))
    assert counted["generation"] == g and counted["members"] == members, counted
    assert counted["step"] < 10**12  # rank 0's own status overwrote the forged one

    # A real planned leave: the next generation is the members' plan, not the forged one.
    leaver = next(w for w in workers if w.id == members[-1])
    cluster.leave(leaver)
    g2 = cluster.wait_world(2, min_gen=g + 1, steps_after=3)
    cluster.wait_exit([leaver])
    assert leaver.proc.returncode == 0 and leaver.read_result()["left"], cluster.dump_logs()
    plan = Plan.from_json(cluster.js.get(Keys.plan(g + 1)))
    assert plan.members == tuple(members[:2]) and plan.left == (members[-1],), plan
    # (the member whose proposal came first met the forged plan, counted it and replaced it)
    assert f"ignored a store value of gen/{g + 1}/plan" in cluster.dump_logs()

    # A forged `done` does not send a joiner away; it is admitted past join/seq = 10^9.
    evil.set(Keys.DONE, json.dumps({"step": 1, "reason": "stop"}))
    (joiner,) = cluster.start(1, FOREVER)
    cluster.wait_world(3, min_gen=g2 + 1, steps_after=3)
    cluster.wait_for_status(lambda s: s["members"] == [*members[:2], joiner.id])

    survivors = [w for w in workers if w is not leaver] + [joiner]
    cluster.stop()
    cluster.wait_exit(survivors)
    assert all(w.proc.returncode == 0 for w in survivors), cluster.dump_logs()
    results = [w.read_result() for w in survivors]
    assert_identical_state(results)
    assert_exactly_once(cluster.audit, N_SAMPLES, BATCH, results[0]["step"])
    assert not [e for e in cluster.events() if e["kind"] in ("crash", "hang")], cluster.events()

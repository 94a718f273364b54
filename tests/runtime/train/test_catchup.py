"""Catching up with local steps (train/catchup.py): a joiner is admitted with no share
and takes the round's start in the background while the members train on; at a round's
end it adopts it and averages with weight 0, and from then on it holds the state."""

from __future__ import annotations

import copy
import json
import re
import secrets
import threading

import pytest
import torch

from eltctl_runtime.store import auth
from eltctl_runtime.train import catchup, state as state_mod
from eltctl_runtime.train.sampler import SamplerState
from eltctl_runtime.train.balance import known_paces
from eltctl_runtime.train.shares import READY_SLOT, Shares


@pytest.mark.parametrize("reports, src, need, buffers, ok", [
    ([(True, 8), (True, 8), (False, 0)], 0, [2], False, True),  # a join: rank 2 catches up
    ([(True, 8), (True, 8), (False, 0), (False, 0)], 1, [2, 3], False, True),  # two at once
    ([(True, 8), (True, 8), (False, 0)], 0, [2], True, False),  # buffers ride the tail: the usual transfer
    ([(False, 0), (True, 8), (True, 8)], 1, [0], False, False),  # rank 0 writes the checkpoints
    ([(True, 8), (True, 4), (False, 0)], 0, [1, 2], False, False),  # a rank with an older state
    ([(True, 8), (True, 8)], 0, [], False, False),  # nobody lacks the state
])
def test_which_joiners_catch_up(reports, src, need, buffers, ok):
    assert catchup.eligible(reports, src, need, has_buffers=buffers) is ok


def test_the_averaging_slots_name_who_still_catches_up():
    assert catchup.still_catching_up([0.0, 0.0, catchup.STILL]) == frozenset({2})
    assert catchup.still_catching_up([0.0, catchup.AGAIN, catchup.STILL]) == frozenset({1, 2})
    assert catchup.wants_new_copy([0.0, catchup.AGAIN, catchup.STILL]) == frozenset({1})
    assert catchup.still_catching_up([0.0, 0.0, 0.0]) == frozenset()


def test_replaying_the_missed_rounds_gives_the_members_state_bit_for_bit():
    """A joiner whose state arrived rounds late: from the round start it received and the
    mean deltas it kept, replay_outer_step reaches what the members hold (LocalPath.average's
    arithmetic, done here as the members do it), parameters and outer momentum alike."""
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(4)]
    means = [torch.randn(19), None, torch.randn(19)]  # the second round had no samples

    def outer(params):
        return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)

    members = [t.clone() for t in start]
    m_outer = outer(members)
    saved_outer = copy.deepcopy(m_outer.state_dict())  # the outer state at the round start sent
    for mean in means:
        anchor = [p.detach().clone() for p in members]
        with torch.no_grad():
            for p, a in zip(members, anchor):
                p.copy_(a)
            if mean is not None:
                flat = mean.clone()
                pos = 0
                for p in members:
                    p.grad = flat[pos:pos + p.numel()].view_as(p).to(p.dtype)
                    pos += p.numel()
                m_outer.step()
            for p in members:
                p.grad = None
    joiner = [torch.zeros_like(t) for t in start]
    j_outer = outer(joiner)
    j_outer.load_state_dict(saved_outer)
    anchor = [t.clone() for t in start]
    for mean in means:
        catchup.replay_outer_step(joiner, anchor, j_outer, mean)
    assert all(torch.equal(a, b) for a, b in zip(joiner, members))
    assert all(torch.equal(a, b) for a, b in zip(anchor, members))
    assert all(torch.equal(j_outer.state[p]["momentum_buffer"], m_outer.state[q]["momentum_buffer"])
               for p, q in zip(joiner, members))


def test_a_catching_up_rank_trains_on_nothing_and_the_others_take_the_whole_step():
    s = SamplerState(n_samples=100, global_batch=10, seed=0)
    shares = Shares(balance=True, min_share=1, micro=None)
    before = [shares.indices(s, r, 2, 0) for r in range(2)]
    shares.idle = frozenset({2})
    during = [shares.indices(s, r, 3, 1) for r in range(3)]
    assert during[2] == [] and during[0] + during[1] == before[0] + before[1] == s.global_indices()
    shares.replan([0.0, 0.0, 0.0], 10, 10, 3, 1)
    assert shares.last_counts == [5, 5, 0]
    shares.ready = True  # it took up the state: its pace slot says so in this step's tail
    assert shares.step_slots(0)[0] == READY_SLOT and known_paces([0.5, 0.5, READY_SLOT]) == [0.5, 0.5, 0.5]
    shares.idle, shares.ready = frozenset(), False  # every rank saw it at the tail (CatchUp.tail_seen)
    after = [shares.indices(s, r, 3, 1) for r in range(3)]
    assert all(after) and sum(after, []) == s.global_indices()


def test_the_background_transfer_brings_the_newest_round_start():
    """A real 2-rank gloo group on a store: the source offers the state of step 4, then of
    step 8 (the joiner was not done by the round's end); the joiner waits for step 8."""
    store = torch.distributed.HashStore()
    send = catchup._Transfer(store, "127.0.0.1", catchup.pair_prefix(3, 2), True, "rank 2")
    recv = catchup._Transfer(store, "127.0.0.1", catchup.pair_prefix(3, 2), False, "rank 2")
    try:
        state = {"model": {"w": torch.arange(6.0)}, "step": 4}
        send.offer(4, state_mod.pack(state))
        assert recv.wait_for(4, None)
        send.offer(8, state_mod.pack({**state, "step": 8}))
        assert recv.wait_for(8, None) and recv.failed is None
        got = state_mod.unpack(recv.got[1], recv.got[2])
        assert got["step"] == 8 and torch.equal(got["model"]["w"], torch.arange(6.0))
        assert not recv.wait_for(4, threading.Event())  # an older round's start is stale
    finally:
        send.close()
        recv.close()


@pytest.mark.slow
def test_a_joiner_catches_up_while_the_members_train_on(cluster_factory):
    """Real processes, local steps in rounds of 4: 2 workers, a third joins. The members do
    not stop for its state: they commit steps with it in the group while its transfer runs
    (the joiner's share is empty in those steps, its log says when the state arrived and
    when it caught up), then it trains, its fingerprint equals theirs at the end, and every
    committed sample is in the audit exactly once. (On loopback the toy model's state
arrives within milliseconds; what the test pins down is that no member waited for it:
the steps committed with the joiner in and stateless.)"""
    from eltctl_runtime.protocol import get_status
    from runtime_cluster import assert_exactly_once, assert_identical_state
    from tests.runtime.train.test_elastic_scenarios import BATCH, FOREVER, N_SAMPLES

    args = FOREVER + ["--sync-every", "4"]
    # Signed (the job's secret): the catch-up group forms on signed values and checks its pair.
    cl = cluster_factory(min_workers=2, secret=secrets.token_bytes(auth.SECRET_BYTES))
    a, b = cl.start(2, args)
    g = cl.wait_world(2, steps_after=5)
    (c,) = cl.start(1, args)
    cl.wait_world(3, min_gen=g + 1, steps_after=12)
    cl.stop()  # as test_elastic_scenarios.finish, the status read through the signed store
    cl.wait_exit([a, b, c])
    assert all(w.proc.returncode == 0 for w in (a, b, c)), cl.dump_logs()
    results = [w.read_result() for w in (a, b, c)]
    steps = results[0]["step"]
    assert all(r["step"] == steps and r["world_size"] == 3 and not r["left"] for r in results), results
    assert_identical_state(results)  # the joiner's fingerprint is the members'
    assert_exactly_once(cl.audit, N_SAMPLES, BATCH, steps)
    status = get_status(cl.js)
    assert status["step"] == steps and sorted(status["members"]) == sorted(r["worker"] for r in results), status
    log = c.log_text()
    admitted = int(re.search(r"catching up at step (\d+)", log).group(1))
    received = int(re.search(r"received the state of step (\d+)", log).group(1))
    caught = int(re.search(r"caught up at step (\d+)", log).group(1))
    assert received == admitted and caught > admitted, log
    assert any(re.search(r"rank\(s\) 2 catch up at step %d" % admitted, w.log_text()) for w in (a, b))
    recs = [json.loads(line) for line in cl.audit.read_text().splitlines()]
    mine = {r["step"]: r["indices"] for r in recs if r["worker"] == c.id}
    # The members committed steps admitted+1..caught with the joiner in and without its state.
    assert all(mine[s] == [] for s in range(admitted + 1, caught + 1)), mine
    assert mine[caught + 1], mine  # then it trains


@pytest.mark.slow
def test_catching_up_through_the_sources_and_a_joiners_sigkill(cluster_factory):
    """Rounds too long to end before the stop (sync_every 10000: joiners take up their state
    mid-round, from the round's start, and every rank rolls back to it at a crash). 2
    workers, a third joins and catches up; the member that was its source is SIGKILLed;
    a fourth joins and is SIGKILLed as soon as it is admitted (catching up, or just caught
    up); a fifth joins and the job stops (a joiner still catching up there waits for its
    state). Every survivor ends with the same fingerprint, every committed sample exactly
    once. (On loopback a joiner catches up within a step or two, so which of the two
    SIGKILLs lands during a transfer is up to the machine; either must hold all this.)"""
    from runtime_cluster import assert_exactly_once, assert_identical_state
    from tests.runtime.train.test_elastic_scenarios import BATCH, FOREVER, N_SAMPLES

    args = FOREVER + ["--sync-every", "10000"]
    cl = cluster_factory(min_workers=2)
    a, b = cl.start(2, args)
    g = cl.wait_world(2, steps_after=3)
    (c,) = cl.start(1, args)
    g = cl.wait_world(3, min_gen=g + 1, steps_after=3)
    assert "catching up at step" in c.log_text(), c.log_text()
    source, other = (a, b) if "catch up at step" in a.log_text() else (b, a)
    cl.kill(source)
    g = cl.wait_world(2, min_gen=g + 1, steps_after=3)
    (d,) = cl.start(1, args)
    cl.wait_for(lambda: "catching up at step" in d.log_text(), what="the fourth worker admitted")
    cl.kill(d)
    g = cl.wait_world(2, min_gen=g + 2, steps_after=3)
    (e,) = cl.start(1, args)
    cl.wait_world(3, min_gen=g + 1, steps_after=3)
    cl.stop()
    survivors = [other, c, e]
    cl.wait_exit(survivors)
    assert all(w.proc.returncode == 0 for w in survivors), cl.dump_logs()
    results = [w.read_result() for w in survivors]
    steps = results[0]["step"]
    assert all(r["step"] == steps and r["world_size"] == 3 for r in results), results
    assert_identical_state(results)
    assert_exactly_once(cl.audit, N_SAMPLES, BATCH, steps)
    assert "caught up at step" in c.log_text() and "caught up at step" in e.log_text()

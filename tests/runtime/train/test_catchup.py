"""Catching up (train/catchup.py): a joiner is admitted with no share and takes the state
in the background while the members train on. Local steps: the round's start, adopted at
a round's end (it averages with weight 0 until then). Synchronous steps: the state of the
join's boundary, brought to the members' present by replaying the optimizer steps it kept
meanwhile. From then on it holds the state."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import secrets
import threading
import time
import types

import pytest
import torch

from eltctl_runtime.store import auth
from eltctl_runtime.train import catchup, catchup_pair, gradients, state as state_mod
from eltctl_runtime.train.sampler import SamplerState
from eltctl_runtime.train.balance import known_paces
from eltctl_runtime.train.shares import AGAIN_SLOT, READY_SLOT, Shares


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


@pytest.mark.parametrize("replicated, scaler, hook, refused", [
    (True, False, False, None),  # fp32 or bf16 on the wire: the joiner replays the steps it missed
    (False, False, False, "replicated"),  # shard= or compress=: each rank's own part of the state
    (True, True, False, "GradScaler"),
    (True, False, True, "before_optimizer_step"),
])
def test_which_synchronous_joiners_catch_up(replicated, scaler, hook, refused):
    why = catchup.steps_refusal(replicated=replicated, scaler=scaler, hook=hook)
    assert (why is None) if refused is None else (refused in why)


@pytest.mark.parametrize("step_bytes, cap", [
    (200_000_000, catchup.MAX_KEPT_BYTES // 200_000_000),  # the 50 M-parameter model: 21 steps
    (2_000_000_000, catchup.MIN_KEPT_STEPS),  # a step's gradient near the budget: still a few steps
    (0, catchup.MAX_KEPT_BYTES),
])
def test_how_many_steps_a_synchronous_joiner_keeps(step_bytes, cap):
    assert catchup.kept_cap(step_bytes) == cap


class _TwoDtypes(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = torch.nn.Linear(4, 6)
        self.vec = torch.nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64))
        with torch.no_grad():
            for p in self.lin.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_replaying_the_kept_steps_gives_the_members_state_bit_for_bit(max_norm):
    """Synchronous steps: a joiner admitted at step 2 (the scheduler's state and the
    hyperparameters in the generation change) keeps, for steps 3..7, the gradient the
    members' optimizer step read (after clipping) and its param_groups' hyperparameters,
    while its own chainable scheduler (ExponentialLR: each LR is the last one times gamma)
    steps in its loop as theirs does. take_up_steps on the state of step 2 then gives the
    members' parameters and AdamW state bit for bit (the job's fingerprint) and their
    current hyperparameters; the same replay at the snapshot's LR does not."""
    torch.manual_seed(0)

    def optimizer_of(model):
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        return opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)

    members = _TwoDtypes(0)
    opt, sched = optimizer_of(members)
    params = list(members.parameters())
    layout = gradients.layout_for(params, 0.0001)  # two dtype buffers, several buckets
    assert len(layout.groups) == 2

    def member_step() -> list[torch.Tensor]:
        """One committed step as ReplicatedPath runs it: the gradients are views of the
        flat buffers, clipped in place; returns what a joiner copies (gradient_copy)."""
        flats = [torch.randn(n, dtype=state_mod.dtype_named(kind)) for kind, n in zip(layout.groups, layout.lengths)]
        for p, s in zip(params, layout.slots):
            p.grad = flats[s.group][s.offset:s.offset + s.numel].view_as(p)
        if max_norm is not None:
            gradients.clip_global_norm_(flats, max_norm)
        kept = [f.clone() for f in flats]
        opt.step()
        return kept

    for _ in range(2):
        member_step()
        sched.step()
    saved = state_mod.unpack(*state_mod.pack(state_mod.capture(members, opt, {}, {})))  # the copy of step 2

    joiner = _TwoDtypes(1)  # its own initial parameters: nothing of them may survive
    jopt, jsched = optimizer_of(joiner)
    jsched.load_state_dict(sched.state_dict())  # admission: the extra state and the hyperparameters
    catchup.set_hyperparameters(jopt, catchup.hyperparameters(opt))
    kept = []
    for step in range(3, 8):
        kept.append(catchup.record_step(step, member_step(), jopt))
        sched.step()
        jsched.step()  # the joiner runs the script's loop too
    assert len({r.groups[0]["lr"] for r in kept}) == len(kept)  # an LR per step

    catchup.take_up_steps(joiner, list(joiner.parameters()), jopt, saved, kept, layout.slots, torch.device("cpu"))
    assert state_mod.fingerprint(joiner, jopt) == state_mod.fingerprint(members, opt)
    assert jopt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert all(torch.equal(a, b) for a, b in zip(joiner.parameters(), members.parameters()))

    # What the kept hyperparameters are for: the same steps replayed at the snapshot's LR differ.
    stale = [dataclasses.replace(r, groups=tuple({k: v for k, v in g.items() if k != "params"}
                                                 for g in saved["optimizer"]["param_groups"])) for r in kept]
    other = _TwoDtypes(1)
    other_opt, _ = optimizer_of(other)
    catchup.take_up_steps(other, list(other.parameters()), other_opt, saved, stale, layout.slots,
                          torch.device("cpu"))
    assert state_mod.fingerprint(other, other_opt) != state_mod.fingerprint(members, opt)


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
    shares.ready, shares.again = False, True  # synchronous: it asks for a newer copy
    assert shares.step_slots(0)[0] == AGAIN_SLOT and known_paces([0.5, 0.5, AGAIN_SLOT]) == [0.5, 0.5, 0.5]
    shares.again = False
    shares.idle, shares.ready = frozenset(), False  # every rank saw it at the tail (CatchUp.tail_seen)
    after = [shares.indices(s, r, 3, 1) for r in range(3)]
    assert all(after) and sum(after, []) == s.global_indices()


def test_the_background_transfer_brings_the_newest_round_start():
    """A real 2-rank gloo group on a store: the source offers the state of step 4, then of
    step 8 (the joiner was not done by the round's end); the joiner waits for step 8."""
    store = torch.distributed.HashStore()
    send = catchup.Transfer(store, "127.0.0.1", catchup.pair_prefix(3, 2), True, "rank 2")
    recv = catchup.Transfer(store, "127.0.0.1", catchup.pair_prefix(3, 2), False, "rank 2")
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


@pytest.mark.parametrize("n, chunk, bounds", [
    (10, 4, [(0, 4), (4, 8), (8, 10)]),
    (8, 4, [(0, 4), (4, 8)]),
    (3, 8, [(0, 3)]),
    (0, 8, []),
])
def test_the_state_goes_in_chunks_the_receiver_computes_alike(n, chunk, bounds):
    assert catchup_pair.chunk_bounds(n, chunk) == bounds


def test_the_chunked_transfer_gives_way_to_the_jobs_reduction():
    """A real 2-rank gloo pair on loopback: while the source's Link says the job's
    all-reduce is on the wire, no chunk of the state goes; once it is free, every chunk
    goes (chunks of 1 KiB: several) and the joiner gets the same bytes."""
    store = torch.distributed.HashStore()
    link = catchup.Link()
    send = catchup.Transfer(store, "127.0.0.1", catchup.pair_prefix(3, 2), True, "rank 2", link=link, chunk=1024)
    recv = catchup.Transfer(store, "127.0.0.1", catchup.pair_prefix(3, 2), False, "rank 2")
    try:
        state = {"model": {"w": torch.randn(3000)}, "step": 4}
        packed = state_mod.pack(state)
        n = len(catchup_pair.chunk_bounds(packed[1].numel(), 1024))
        assert n >= 10
        link.busy()
        send.offer(4, packed)
        assert not recv.wait_for(4, _set_after(0.5))  # it waited the half second for nothing
        assert send.chunks == 0 and recv.chunks == 0 and recv.got is None
        link.free()
        assert recv.wait_for(4, None) and recv.failed is None
        assert recv.chunks == n
        _wait(lambda: send.chunks == n, "the sender's count of its last chunk")  # counted after its send returns
        assert torch.equal(recv.got[2], packed[1]) and recv.got[1] == packed[0]
        got = state_mod.unpack(recv.got[1], recv.got[2])
        assert torch.equal(got["model"]["w"], state["model"]["w"])
    finally:
        send.close()
        recv.close()


def _set_after(seconds: float) -> threading.Event:
    """An Event set after `seconds` (an abort for a wait that must not end otherwise)."""
    e = threading.Event()
    threading.Timer(seconds, e.set).start()
    return e


class _WithBuffer(_TwoDtypes):
    """_TwoDtypes with a buffer (a running count): the model's state dict holds more than
    its parameters."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.register_buffer("seen", torch.full((3,), float(seed)))


def _adamw_exponential(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)


def _members_run(steps: int, saved_at: int):
    """The members' side of a join at step `saved_at` (ReplicatedPath's steps: the gradients
    views of the flat buffers of two dtypes, the LR changed every step): their model and
    optimizer after `steps`, the packed state of step `saved_at` (the buffer last changed
    there), what a joiner admitted then receives (the scheduler's state, the live
    hyperparameters), the StepRecords of the steps after it, and the layout."""
    torch.manual_seed(0)
    members = _WithBuffer(0)
    opt, sched = _adamw_exponential(members)
    params = list(members.parameters())
    layout = gradients.layout_for(params, 0.0001)
    saved, admitted, records = None, None, []
    for step in range(1, steps + 1):
        flats = [torch.randn(n, dtype=state_mod.dtype_named(kind)) for kind, n in zip(layout.groups, layout.lengths)]
        if step > saved_at:
            records.append(catchup.record_step(step, [f.clone() for f in flats], opt))
        for p, s in zip(params, layout.slots):
            p.grad = flats[s.group][s.offset:s.offset + s.numel].view_as(p)
        opt.step()
        sched.step()
        if step <= saved_at:
            members.seen.add_(1.0)
        if step == saved_at:
            saved = state_mod.pack(state_mod.capture(members, opt, {}, {}))
            admitted = (copy.deepcopy(sched.state_dict()), catchup.hyperparameters(opt))
    assert len({r.groups[0]["lr"] for r in records}) == len(records)
    return members, opt, admitted, saved, records, layout


def _joiner_of(admitted):
    """A joiner as admitted: its own initial parameters and buffer, the members' scheduler
    state and live hyperparameters (the generation change), no optimizer state."""
    model = _WithBuffer(1)
    o, sc = _adamw_exponential(model)
    sc.load_state_dict(admitted[0])
    catchup.set_hyperparameters(o, admitted[1])
    return model, o, sc


def _pair(prefix: str):
    """The catch-up pair's two Transfers on a real 2-rank gloo group (source, joiner)."""
    store = torch.distributed.HashStore()
    return (catchup.Transfer(store, "127.0.0.1", prefix, True, "rank 1"),
            catchup.Transfer(store, "127.0.0.1", prefix, False, "rank 1"))


def _wait(pred, what: str, timeout: float = 60.0) -> None:
    """Wait for a thread's work (no timing asserted: the timeout only ends a hung test)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("left", [0, 2])
def test_the_shadow_replay_gives_what_the_direct_replay_gives_bit_for_bit(left):
    """Synchronous steps: the joiner's shadow (_Shadow: from the admission on, a thread
    waits for the state on the catch-up pair, unpacks it into tensors of its own and an
    optimizer over them as soon as it arrives, and replays the kept steps as they are
    kept) swapped into the model and the optimizer equals take_up_steps on the same
    state and records (the replay in the step), bit for bit: parameters, the buffer (the
    received state dict's entries beyond the parameters), AdamW's state (moved into the
    joiner's own optimizer, keyed by its own parameters), and the joiner's live
    hyperparameters; also with `left` records kept after the thread stopped (replayed at
    the swap). Records kept before the state arrived wait for it. The joiner's model and
    optimizer are untouched until the swap."""
    members, opt, admitted, saved, records, layout = _members_run(8, 2)

    def joiner():  # its scheduler stepped in its loop as the members' did: their live hyperparameters
        model, o, sc = _joiner_of(admitted)
        for _ in records:
            sc.step()
        return model, o

    direct, dopt = joiner()
    catchup.take_up_steps(direct, list(direct.parameters()), dopt, state_mod.unpack(*saved), records,
                          layout.slots, torch.device("cpu"))
    assert state_mod.fingerprint(direct, dopt) == state_mod.fingerprint(members, opt)

    model, jopt = joiner()
    before = copy.deepcopy(model.state_dict())
    first = records[:len(records) - left]
    send, recv = _pair(catchup.pair_prefix(3, 1))
    shadow = catchup._Shadow(recv, 2, model, list(model.parameters()), jopt, layout.slots, torch.device("cpu"))
    try:
        shadow.start()
        for rec in first[:2]:  # kept before the state arrives
            shadow.add(rec)
        assert not shadow.built and shadow.behind() > len(first)
        send.offer(2, saved)
        for rec in first[2:]:
            shadow.add(rec)
        _wait(lambda: shadow.behind() == 0, "the shadow's replay")  # the thread replays them all
        assert shadow.error is None and shadow.built
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched meanwhile
        assert not jopt.state  # and the joiner's optimizer
        rest = shadow.take() + records[len(records) - left:]
        assert len(rest) == left
        shadow.swap_into(model, jopt, rest)
    finally:
        shadow.close()
        send.close()
        recv.close()
    assert torch.equal(model.seen, members.seen) and not torch.equal(model.seen, before["seen"])
    assert state_mod.fingerprint(model, jopt) == state_mod.fingerprint(direct, dopt)
    assert jopt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert all(torch.equal(jopt.state[p][k], opt.state[q][k]) for p, q in zip(model.parameters(), members.parameters())
               for k in opt.state[q])


def test_a_joiner_whose_state_arrived_between_two_steps_takes_it_up_at_the_next_ones_start():
    """Synchronous steps: the state arrives after the joiner kept steps 3 and 4; at the
    next step's start (`poll`) the joiner takes it up and says so in that step's tail
    (Shares.ready: READY_SLOT), holding the members' state of step 4, bit for bit: the
    step the replay in the step took it up in. Its shadow waited for the state since the
    admission and unpacked it on arrival, so the poll finds it built; a shadow started by
    that poll (2028edd) took it up a step later, and the joiner committed that step with
    its stale state (tests/security/test_attacks_sshd.py: "the ranks' states differ")."""
    members, opt, admitted, saved, records, layout = _members_run(4, 2)
    model, jopt, jsched = _joiner_of(admitted)
    job = types.SimpleNamespace(
        _rank=1, world_size=2, _step=2, worker_id="w1", model=model, _params=list(model.parameters()),
        optimizer=jopt, _grads=types.SimpleNamespace(layout=layout), _device=torch.device("cpu"),
        _shares=Shares(balance=False, min_share=1, micro=None), _agreement=types.SimpleNamespace(has_state=False))
    cu = catchup.CatchUp(job, None)
    send, recv = _pair(catchup.pair_prefix(3, 1))
    try:
        cu._await(recv, 2)  # admitted at step 2 (CatchUp.admit)
        cu._set_idle(frozenset({1}))
        for rec in records:  # steps 3 and 4 committed while the state travels: kept
            cu.replaces_step(types.SimpleNamespace(gradient_copy=lambda rec=rec: list(rec.grads)), jopt)
            job._step += 1
            jsched.step()  # the joiner runs the script's loop too
        assert not cu._ready and [r.step for r in cu._kept] == [3, 4]
        send.offer(2, saved)
        _wait(lambda: recv.got is not None and cu._shadow.behind() == 0, "the state and its replay")
        cu.poll()  # step 5's start
        assert cu._ready and job._shares.ready and job._shares.step_slots(0)[0] == READY_SLOT
    finally:
        cu.reset()
        send.close()
    assert state_mod.fingerprint(model, jopt) == state_mod.fingerprint(members, opt)
    assert jopt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


# The modes a joiner catches up in, as examples/train.py's flags: local steps in rounds of 4,
# and synchronous steps (the default; bf16 on the wire changes nothing of the catch-up). fp32
# without the step's sleep: the toy model's steps are then shorter than the catch-up pair's
# forming, so the members commit steps while the transfer runs and the joiner replays them
# (1 or 2 in the runs seen; the assertions hold for any number).
MODES = {"local": ["--sync-every", "4"], "steps": ["--step-sleep", "0"], "steps-bf16": ["--grad-dtype", "bf16"]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "steps", "steps-bf16"])
def test_a_joiner_catches_up_while_the_members_train_on(cluster_factory, mode):
    """Real processes: 2 workers, a third joins. The members do not stop for its state:
    they commit steps with it in the group while its transfer runs (the joiner's share is
    empty in those steps, its log says when the state arrived and when it caught up), then
    it trains, its fingerprint equals theirs at the end, and every committed sample is in
    the audit exactly once. Synchronous steps: it replayed exactly the optimizer steps
    committed between its admission and its catching up, beside the job (a shadow of
    the state, swapped in at a step's start: catchup._Shadow), not in the step. (On loopback the toy model's
state arrives within a few steps; what the test pins down is that no member waited for
it: the steps committed with the joiner in and stateless.)"""
    from eltctl_runtime.protocol import get_status
    from runtime_cluster import assert_exactly_once, assert_identical_state
    from tests.runtime.train.test_elastic_scenarios import BATCH, FOREVER, N_SAMPLES

    args = FOREVER + MODES[mode]
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
    if mode != "local":  # the steps since the admission were replayed, the step it caught up in taken
        found = re.search(r"the state of step %d arrived; the (\d+) optimizer step\(s\) since replayed \((\d+) of "
                          r"them beside the job\)" % admitted, log)
        assert found, log  # the replay ran beside the job (catchup._Shadow), then the swap
        replayed, beside = int(found.group(1)), int(found.group(2))
        assert replayed == caught - admitted - 1 and beside <= replayed, log


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "steps"])
def test_catching_up_through_the_sources_and_a_joiners_sigkill(cluster_factory, mode):
    """Local steps in rounds too long to end before the stop (sync_every 10000: joiners
    take up their state mid-round, from the round's start, and every rank rolls back to it
    at a crash), or synchronous steps (joiners replay the steps they kept; a crash drops
    the step in flight). 2 workers, a third joins and catches up; the member that was its
    source is SIGKILLed; a fourth joins and is SIGKILLed as soon as it is admitted
    (catching up, or just caught up); a fifth joins and the job stops (synchronous: as soon
    as it is admitted; a joiner still catching up there waits for its state). Every
    survivor ends with the same fingerprint, every committed sample exactly once. (On
    loopback a joiner catches up within a step or two, so which of the two SIGKILLs lands
    during a transfer is up to the machine; either must hold all this.)"""
    from runtime_cluster import assert_exactly_once, assert_identical_state
    from tests.runtime.train.test_elastic_scenarios import BATCH, FOREVER, N_SAMPLES

    args = FOREVER + (["--sync-every", "10000"] if mode == "local" else [])
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
    if mode == "local":
        cl.wait_world(3, min_gen=g + 1, steps_after=3)
    else:  # the stop as soon as it is admitted: it takes up its state at the stop (StateAgreement.caught_up_at_end)
        cl.wait_for(lambda: "catching up at step" in e.log_text(), what="the fifth worker admitted")
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

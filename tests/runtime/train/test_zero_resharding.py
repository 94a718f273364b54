"""Live resharding (train/zero/resharding.py): the transfer plan is pure (tables); the
moves run real gloo groups, one thread per rank on one HashStore, and compare every
parameter and the gathered state with the replicated run."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from runtime_cluster import gloo_group as group, run_threads as run_ranks
from zero_ranks import F32, OTHER_KINDS, Worker, assert_params_match, assert_state_matches, members, replicated

from eltctl_runtime.train.zero import Member, ShardsLost, ShardLayout, plan_shards, plan_transfers, reshard, shard_layout


def test_a_crash_without_replicas_loses_shards_and_with_replicas_does_not():
    kinds, numels, sizes = [(F32, 0)], [12], [4]
    old = plan_shards(kinds, numels, sizes, members("a", "b", "c"))
    new = plan_shards(kinds, numels, sizes, members("a", "b"))
    with pytest.raises(ShardsLost, match="w2"):
        plan_transfers(old, new, ["w0", "w1"])
    old2 = plan_shards(kinds, numels, sizes, members("a", "b", "c"), replicas=2)
    segs = plan_transfers(old2, new, ["w0", "w1"])
    assert {s.src for s in segs} <= {"w0", "w1"}
    assert sum(s.hi - s.lo for s in segs if s.old_chunk == 2) == 4  # w2's chunk, from its backup


def test_a_joiner_gets_its_parameters_from_every_member_not_rank_0():
    kinds, numels, sizes = [(F32, 0)], [12], [4]
    old = plan_shards(kinds, numels, sizes, members("a", "b"))
    new = plan_shards(kinds, numels, sizes, members("a", "b", "c"))
    segs = plan_transfers(old, new, ["w0", "w1", "w2"])
    assert {s.src for s in segs if s.dst == "w2" and s.what == "param"} == {"w0", "w1"}


def test_after_a_broken_gather_every_member_gets_every_chunks_parameters_from_its_holders():
    kinds, numels, sizes = [(F32, 0)], [12], [4]
    old = plan_shards(kinds, numels, sizes, members("a", "b", "c"), replicas=2)
    new = plan_shards(kinds, numels, sizes, members("a", "b"))
    segs = plan_transfers(old, new, ["w0", "w1"], all_params=True)
    for dst in ("w0", "w1"):
        got = [s for s in segs if s.dst == dst and s.what == "param"]
        assert sorted(s.old_chunk for s in got) == [0, 1, 2] and {s.src for s in got} <= {"w0", "w1"}
        assert all(s.src == dst for s in got if dst in [old.members[r].id for r in old.holders[s.old_chunk]])


def test_a_member_back_without_its_state_is_served_like_a_joiner_never_a_source():
    kinds, numels, sizes = [(F32, 0)], [12], [4]
    lay = plan_shards(kinds, numels, sizes, members("a", "b"), replicas=2)
    segs = plan_transfers(lay, lay, ["w0", "w1"], fresh=frozenset({"w1"}))
    assert {s.src for s in segs} == {"w0"}
    assert sorted(s.old_chunk for s in segs if s.dst == "w1" and s.what == "param") == [0, 1]
    with pytest.raises(ShardsLost):  # one holder per chunk: w1's chunk is nowhere else
        plan_transfers(plan_shards(kinds, numels, sizes, members("a", "b")), lay, ["w0", "w1"],
                       fresh=frozenset({"w1"}))


@pytest.mark.parametrize("kind", ["adamw"] + OTHER_KINDS)
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_a_planned_leave_3_to_2_then_a_join_2_to_3_keep_training_replicated(shard, kind):
    """w0 (rank 0) leaves after step 3, handing its shards over; after step 6 w3
    joins with other initial weights and receives parameters and state (each state
    tensor and the step count of every supported optimizer that keeps one)."""
    ref_model, ref_opt, _ = replicated(kind, 9)
    store = dist.HashStore()
    ids_a, ids_b, ids_c = ["w0", "w1", "w2"], ["w1", "w2"], ["w1", "w2", "w3"]
    hosts = {"w0": "h0", "w1": "h1", "w2": "h2", "w3": "h3"}

    def layout(w: Worker, ids: list[str]) -> ShardLayout:
        return shard_layout(w.params, w.opt, [Member(i, hosts[i]) for i in ids], bucket_mb=0.0002)

    def member(me: str):
        w = Worker(kind, shard)
        lay_a, lay_b, lay_c = layout(w, ids_a), layout(w, ids_b), layout(w, ids_c)
        w.sg = w.path(lay_a, me)
        pg_a = group(store, "a", ids_a.index(me), 3)
        w.train(pg_a, range(0, 3))
        if me == "w0":
            reshard(lay_a, lay_b, pg_a, ids_a, old=w.sg, new=None)
            return None
        new = w.path(lay_b, me)
        reshard(lay_a, lay_b, pg_a, ids_a, old=w.sg, new=new)
        w.sg = new
        w.train(group(store, "b", ids_b.index(me), 2), range(3, 6))
        pg_c = group(store, "c", ids_c.index(me), 3)
        new = w.path(lay_c, me)
        reshard(lay_b, lay_c, pg_c, ids_c, old=w.sg, new=new)
        w.sg = new
        w.train(pg_c, range(6, 9))
        return w, w.sg.full_state_dict()

    def joiner():
        w = Worker(kind, shard, seed=7)  # other weights: they must come from the members
        lay_b, lay_c = layout(w, ids_b), layout(w, ids_c)
        w.sg = w.path(lay_c, "w3")
        pg_c = group(store, "c", 2, 3)
        moved = reshard(lay_b, lay_c, pg_c, ids_c, old=None, new=w.sg)
        assert moved["from"] == [0, 1] and moved["sent_bytes"] == 0, moved  # from both members, not rank 0 alone
        w.train(pg_c, range(6, 9))
        return w, w.sg.full_state_dict()

    out = run_ranks({"w0": lambda: member("w0"), "w1": lambda: member("w1"), "w2": lambda: member("w2"),
                     "w3": joiner})
    for name in ids_c:
        w, full = out[name]
        assert_params_match(w.model, ref_model)
        assert_state_matches(full, ref_opt.state_dict())


@pytest.mark.parametrize("reduce_scatter", [True, False])
def test_with_two_replicas_a_lost_rank_costs_no_state(reduce_scatter):
    """w1 stops answering after step 3 (w0 and w1 share a host); w0 and w2 take
    its chunk from its backup and train on, as the replicated run. ZeRO-2 both
    ways: reduce_scatter_tensor plus the backup's chunk by point-to-point, and
    gloo's default (an all-reduce of each bucket)."""
    ref_model, ref_opt, _ = replicated("sgd", 6)
    store = dist.HashStore()
    hosts = {"w0": "h0", "w1": "h0", "w2": "h1"}
    ids_a, ids_b = ["w0", "w1", "w2"], ["w0", "w2"]

    def rank(me: str):
        w = Worker("sgd", "gradients", reduce_scatter=reduce_scatter)
        lay_a = shard_layout(w.params, w.opt, [Member(i, hosts[i]) for i in ids_a], replicas=2, bucket_mb=0.0002)
        lay_b = shard_layout(w.params, w.opt, [Member(i, hosts[i]) for i in ids_b], replicas=2, bucket_mb=0.0002)
        w.sg = w.path(lay_a, me)
        w.train(group(store, "a", ids_a.index(me), 3), range(0, 3))
        if me == "w1":
            return None  # gone: no hand-over
        pg_b = group(store, "b", ids_b.index(me), 2)
        new = w.path(lay_b, me)
        reshard(lay_a, lay_b, pg_b, ids_b, old=w.sg, new=new)
        w.sg = new
        w.train(pg_b, range(3, 6))
        return w, w.sg.full_state_dict()

    out = run_ranks({i: (lambda i=i: rank(i)) for i in ids_a})
    for name in ids_b:
        w, full = out[name]
        assert_params_match(w.model, ref_model)
        assert_state_matches(full, ref_opt.state_dict())

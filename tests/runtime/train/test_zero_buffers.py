"""One rank's buffers of the sharded state (train/zero/buffers.py): what a new layout's
path keeps of the previous one's, and the masters of a rank that holds every chunk."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime_cluster import gloo_group as group, run_threads as run_ranks
from zero_ranks import Worker, assert_params_match, assert_state_matches, replicated

from eltctl_runtime.train.zero import Member, ShardedGradients, ShardLayout, reshard, shard_layout


def test_a_leave_2_to_1_and_a_join_1_to_2_keep_the_parameter_buffer_where_the_padding_is_unchanged():
    """w1 leaves after step 3, w2 joins after step 6; w0 binds each new path with its
    previous one to reuse. Three of the four flat buffers (per dtype and param group)
    hold buckets of 24, 8 and 48 elements, which pad alike at worlds 1 and 2: w0 keeps
    them (its parameters stay views of them, nothing is copied); the float32 biases' (3
    elements) pad differently, so that group gets a new buffer.
    Training and the gathered state equal the replicated run's either way, and each move
    reports what it sent and received."""
    ref_model, ref_opt, _ = replicated("adamw", 9)
    store = dist.HashStore()
    ids_a, ids_b, ids_c = ["w0", "w1"], ["w0"], ["w0", "w2"]
    hosts = {"w0": "h0", "w1": "h1", "w2": "h2"}

    def layout(w: Worker, ids: list[str]) -> ShardLayout:
        return shard_layout(w.params, w.opt, [Member(i, hosts[i]) for i in ids], bucket_mb=0.0002)

    def path(w: Worker, lay: ShardLayout, me: str, reuse: ShardedGradients | None) -> ShardedGradients:
        sg = ShardedGradients(w.params, w.opt, lay, lay.rank_of(me), w.shard)
        sg.bind(reuse=reuse)
        return sg

    def member(me: str):
        w = Worker("adamw", "optimizer")
        lay_a, lay_b, lay_c = layout(w, ids_a), layout(w, ids_b), layout(w, ids_c)
        w.sg = w.path(lay_a, me)
        pg_a = group(store, "a", ids_a.index(me), 2)
        w.train(pg_a, range(0, 3))
        if me == "w1":
            moved = reshard(lay_a, lay_b, pg_a, ids_a, old=w.sg, new=None)
            assert moved["to"] == [0] and moved["sent_bytes"] > 0 and moved["received_bytes"] == 0, moved
            return None
        flats = [f.data_ptr() for f in w.sg.flat_params]
        assert lay_a.groups[0] == ("torch.float32", 1) and lay_a.buckets[0].numel == 3
        new = path(w, lay_b, me, reuse=w.sg)
        ptrs = [f.data_ptr() for f in new.flat_params]
        assert ptrs[0] != flats[0] and ptrs[1:] == flats[1:], (ptrs, flats)
        moved = reshard(lay_a, lay_b, pg_a, ids_a, old=w.sg, new=new)
        assert moved["from"] == [1] and moved["received_bytes"] > 0, moved
        w.sg = new
        w.train(group(store, "b", 0, 1), range(3, 6))
        pg_c = group(store, "c", 0, 2)
        new = path(w, lay_c, me, reuse=w.sg)
        assert [f.data_ptr() for f in new.flat_params][1:] == flats[1:]
        for p, slot in zip(w.params, lay_c.slots):  # still views of the kept buffers
            f = new.flat_params[slot.group]
            assert f.data_ptr() <= p.data_ptr() < f.data_ptr() + f.numel() * f.element_size()
        reshard(lay_b, lay_c, pg_c, ids_c, old=w.sg, new=new)
        w.sg = new
        w.train(pg_c, range(6, 9))
        return w, w.sg.full_state_dict()

    def joiner():
        w = Worker("adamw", "optimizer", seed=7)  # other weights: they come from w0
        lay_b, lay_c = layout(w, ids_b), layout(w, ids_c)
        # bound as ShardedPath binds a joiner: its own values are not copied (values=False),
        # so whatever its fresh buffers held must be overwritten by what the members send
        w.sg = ShardedGradients(w.params, w.opt, lay_c, lay_c.rank_of("w2"), w.shard)
        w.sg.bind(values=False)
        with torch.no_grad():
            for p in w.params:
                p.fill_(float("nan"))
        pg_c = group(store, "c", 1, 2)
        moved = reshard(lay_b, lay_c, pg_c, ids_c, old=None, new=w.sg)
        assert moved["from"] == [0] and moved["sent_bytes"] == 0, moved
        w.train(pg_c, range(6, 9))
        return w, w.sg.full_state_dict()

    out = run_ranks({"w0": lambda: member("w0"), "w1": lambda: member("w1"), "w2": joiner})
    for name in ids_c:
        w, full = out[name]
        assert_params_match(w.model, ref_model)
        assert_state_matches(full, ref_opt.state_dict())


def test_a_path_that_holds_every_chunk_steps_the_parameters_and_keeps_its_gradient_buffer():
    """With two replicas at world 2 every rank holds both chunks (`holds_every_chunk`): its masters only
    key the optimizer state (nothing refreshes them from the parameters, nothing writes
    them back: they hold no memory), and the step still equals replicated training's. Its world-1 successor
    holds the one chunk of the same total size, so binding it with the old path to reuse
    keeps the chunk-gradient buffers (zeroed) as well as the parameter buffers."""
    ref_model, ref_opt, _ = replicated("adamw", 4)
    store = dist.HashStore()
    ids = ["w0", "w1"]

    def member(me: str):
        w = Worker("adamw", "gradients")
        lay = shard_layout(w.params, w.opt, [Member(i, f"h{i}") for i in ids], replicas=2, bucket_mb=0.0002)
        w.sg = w.path(lay, me)
        assert w.sg.holds_every_chunk
        # the masters take no memory: one element each, expanded to the chunk's size
        assert all(m.numel() == one_chunk and m.untyped_storage().nbytes() == m.element_size()
                   for ms, one_chunk in zip(w.sg.masters, (w.sg.layout.shard_len(g) for g in range(4)))
                   for m in ms)
        assert w.sg.memory()["shard_params"] == sum(len(ms) * ms[0].element_size() for ms in w.sg.masters)
        w.train(group(store, "full", ids.index(me), 2), range(0, 4))
        one = shard_layout(w.params, w.opt, [Member(me, f"h{me}")], bucket_mb=0.0002)
        new = ShardedGradients(w.params, w.opt, one, 0, w.shard)
        old = [(t.data_ptr(), t.numel()) for t in w.sg.chunk_grads]
        new.bind(reuse=w.sg)
        now = [(t.data_ptr(), t.numel()) for t in new.chunk_grads]
        # kept where the total size is the same (all but the 3-element biases' group, which pads otherwise)
        assert [a == b for a, b in zip(old, now)] == [o[1] == n[1] for o, n in zip(old, now)]
        assert sum(a == b for a, b in zip(old, now)) == len(now) - 1, (old, now)
        assert all(not t.any() for t in new.chunk_grads)
        return w

    out = run_ranks({me: (lambda me=me: member(me)) for me in ids})
    for w in out.values():
        assert_params_match(w.model, ref_model)

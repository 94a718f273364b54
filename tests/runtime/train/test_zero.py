"""Sharded optimizer state (runtime/zero.py): the layout and the transfer plan are
pure (tables); the rest runs real gloo groups, one thread per rank on one
HashStore, and compares every parameter with one process training the global
batch with the plain optimizer (replicated training)."""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from runtime_cluster import gloo_group as group, run_threads as run_ranks

from eltctl_runtime.train.zero.sharded import PAD_MIN_QUANTA, PAD_QUANTUM, Member, ShardedGradients, ShardsLost, ShardLayout, plan_shards, plan_transfers, reshard, shard_layout

F32, F64 = "torch.float32", "torch.float64"
ROWS = 12
RTOL = 1e-5


# -- pure: the layout and the transfer plan -------------------------------------------------


def members(*hosts: str) -> list[Member]:
    return [Member(f"w{i}", h) for i, h in enumerate(hosts)]


def test_buckets_are_padded_to_the_world_and_each_rank_owns_one_chunk_of_each():
    lay = plan_shards([(F32, 0), (F32, 0), (F64, 0)], [5, 3, 4], [4, 4, 8], members("a", "b", "c"),
                      bucket_bytes=1 << 30)
    # reverse parameter order: the float64 parameter opens group 0, the float32 ones group 1
    assert lay.groups == ((F64, 0), (F32, 0))
    assert [(b.group, b.numel, b.chunk, b.pstart) for b in lay.buckets] == [(0, 4, 2, 0), (1, 8, 3, 0)]
    assert lay.padded(0) == 6 and lay.padded(1) == 9
    assert lay.buckets[1].span(2) == (6, 8)  # the last chunk carries the padding
    assert lay.holders == ((0,), (1,), (2,)) and lay.held(1) == (1,)


def test_a_large_bucket_pads_alike_at_every_world_size_up_to_8_so_its_buffers_stay():
    big = PAD_MIN_QUANTA * PAD_QUANTUM + 7  # a bucket just large enough to pad to the quantum
    widths = {w: plan_shards([(F32, 0)], [big], [4], members(*"abcdefgh"[:w]), bucket_bytes=1 << 30).padded(0)
              for w in range(1, 9)}
    assert set(widths.values()) == {(PAD_MIN_QUANTA + 1) * PAD_QUANTUM}  # the same width at 1..8 ranks
    assert all(widths[w] - big < PAD_QUANTUM for w in widths)  # under one quantum of padding
    # beyond 8: the multiple of lcm(840, world), still one width for all those a quantum divides
    assert plan_shards([(F32, 0)], [big], [4], members(*"abcdefghij"), bucket_bytes=1 << 30).padded(0) == widths[1]
    nine = plan_shards([(F32, 0)], [PAD_MIN_QUANTA * 2520], [4], members(*"abcdefghi"), bucket_bytes=1 << 30)
    assert nine.padded(0) == PAD_MIN_QUANTA * 2520 and nine.buckets[0].chunk * 9 == nine.padded(0)
    # a small bucket pads to the world size only (its chunks stay as even as they can be)
    small = PAD_MIN_QUANTA * PAD_QUANTUM - 1
    assert plan_shards([(F32, 0)], [small], [4], members("a", "b", "c"), bucket_bytes=1 << 30).padded(0) == \
        math.ceil(small / 3) * 3


def test_replicas_sit_on_other_hosts_and_every_rank_backs_up_one_chunk():
    lay = plan_shards([(F32, 0)], [10], [4], members("x", "y", "x", "y"), replicas=2)
    hosts = [m.host for m in lay.members]
    assert all(len(h) == 2 and hosts[h[0]] != hosts[h[1]] for h in lay.holders)
    assert sorted(h[1] for h in lay.holders) == [0, 1, 2, 3]
    assert all(len(lay.held(r)) == 2 for r in range(4))


@pytest.mark.parametrize("hosts", [("a",), ("a", "a"), ("a", "a", "b"), ("a", "b", "c")])
def test_the_layout_is_a_function_of_the_member_list_alone(hosts):
    one = plan_shards([(F32, 0), (F32, 1)], [7, 9], [4, 4], members(*hosts), replicas=2, bucket_bytes=16)
    again = plan_shards([(F32, 0), (F32, 1)], [7, 9], [4, 4], members(*hosts), replicas=2, bucket_bytes=16)
    assert one == again == ShardLayout.from_json(one.to_json())
    assert one.replicas == min(2, len(hosts))
    assert all(len(set(h)) == len(h) for h in one.holders)


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


class SGDWithATwist(torch.optim.SGD):
    """A subclass may change step(): refused like any other optimizer."""


def test_an_unsupported_optimizer_is_refused_naming_the_supported_ones():
    model = torch.nn.Linear(2, 2)
    params = list(model.parameters())
    opt = SGDWithATwist(params, lr=0.1)
    with pytest.raises(ValueError, match="supports AdamW, Adam, SGD, RMSprop, Adamax, RAdam, Adadelta .*got SGDWithATwist"):
        ShardedGradients(params, opt, shard_layout(params, opt, members("a")), 0)
    for opt, why in ((torch.optim.Adagrad(params), "made when it is built"),
                     (torch.optim.NAdam(params), "mu_product"),
                     (torch.optim.Adam(params, capturable=True), "capturable=True"),
                     (torch.optim.RMSprop(params, foreach=False, differentiable=True), "differentiable=True")):
        with pytest.raises(ValueError, match=why):
            ShardedGradients(params, opt, shard_layout(params, opt, members("a")), 0)


# -- real gloo groups --------------------------------------------------------------------------


_INIT = threading.Lock()  # the ranks are threads: the global RNG that initialises layers is shared


class Net(torch.nn.Module):
    """Mixed dtypes: a float64 layer, then a float32 one."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with _INIT:
            torch.manual_seed(seed)
            self.a = torch.nn.Linear(6, 8).double()
            self.b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).float()).double()


def make_opt(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":  # two param groups: no decay on biases
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=0.01)
    params = model.parameters()
    if kind == "adam":  # L2 weight decay (added to the gradient) and the running maximum
        return torch.optim.Adam(params, lr=0.01, weight_decay=0.05, amsgrad=True)
    if kind == "rmsprop":  # every state tensor it has: square_avg, momentum_buffer, grad_avg
        # eps 1: its momentum buffer sums g / (sqrt(v) + eps), at the first step sign(g) / 0.1
        # with a small eps, so a gradient element summed to near zero (float32 rounding of a
        # cancelling sum) flips it: at the default eps replicated training itself, its batch
        # split in 3 micro-batches, ends 6e-5 apart (relative) in that buffer of this model.
        # With eps 1 the buffer is as exact as the gradients' reduction order.
        return torch.optim.RMSprop(params, lr=0.01, eps=1.0, momentum=0.5, centered=True, weight_decay=0.01)
    if kind == "adamax":
        return torch.optim.Adamax(params, lr=0.02, weight_decay=0.01)
    if kind == "radam":  # its rectified update starts at step 6 (default betas): the 9-step tests reach it
        return torch.optim.RAdam(params, lr=0.01, weight_decay=0.01, decoupled_weight_decay=True)
    if kind == "adadelta":
        return torch.optim.Adadelta(params, lr=1.0, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


# The supported optimizers other than AdamW and SGD (tested at fewer world sizes)
OTHER_KINDS = ["adam", "rmsprop", "adamax", "radam", "adadelta"]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, 6, generator=g, dtype=torch.float64), torch.randn(ROWS, 3, generator=g,
                                                                                dtype=torch.float64)


def loss_of(model, rows: torch.Tensor, step: int) -> torch.Tensor:
    x, y = batch(step)
    return ((model(x[rows]) - y[rows]) ** 2).sum() / ROWS  # rank shares add up to the global mean


def replicated(kind: str, steps: int, clip: float | None = None, scale: bool = False, inf_at: int = -1):
    model = Net()
    opt = make_opt(kind, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if scale else None
    for t in range(steps):
        loss = loss_of(model, torch.arange(ROWS), t)
        (scaler.scale(loss) if scaler else loss).backward()
        if t == inf_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        if scaler:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return model, opt, scaler


class Worker:
    """One rank: its model, the script's optimizer, its sharded path."""

    def __init__(self, kind: str, shard: str, seed: int = 0, scale: bool = False,
                 reduce_scatter: bool | None = None, p2p_gather: bool | None = None) -> None:
        self.reduce_scatter = reduce_scatter
        self.p2p_gather = p2p_gather
        self.model = Net(seed)
        self.opt = make_opt(kind, self.model)
        self.params = list(self.model.parameters())
        self.shard = shard
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if scale else None
        self.sg: ShardedGradients | None = None

    def path(self, lay: ShardLayout, me: str) -> ShardedGradients:
        sg = ShardedGradients(self.params, self.opt, lay, lay.rank_of(me), self.shard, self.reduce_scatter,
                              self.p2p_gather)
        sg.bind()
        return sg

    def train(self, pg, steps: range, clip: float | None = None, inf_at: int = -1) -> list:
        sg = self.sg
        results = []
        rank, world = pg.rank(), pg.size()
        with sg.attached():
            for t in steps:
                sg.begin(pg)
                loss = loss_of(self.model, torch.tensor_split(torch.arange(ROWS), world)[rank], t)
                if t == inf_at and rank == world - 1:
                    loss = loss * float("inf")
                (self.scaler.scale(loss) if self.scaler else loss).backward()
                sg.finish()
                results.append(sg.step(clip, self.scaler))
                sg.zero_grad()
        return results


def assert_params_match(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=1e-7, msg=name)


def assert_state_matches(full: dict, ref: dict) -> None:
    assert full["param_groups"] == ref["param_groups"]
    assert full["state"].keys() == ref["state"].keys()
    for i, entry in ref["state"].items():
        assert full["state"][i].keys() == entry.keys()
        for k, v in entry.items():
            torch.testing.assert_close(full["state"][i][k], v, rtol=RTOL, atol=1e-7, msg=lambda m, i=i, k=k: f"{i}/{k}: {m}")


@pytest.mark.parametrize("world,kind", [(w, k) for w in (1, 2, 3) for k in ("adamw", "sgd")]
                         + [(2, k) for k in OTHER_KINDS])
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_training_equals_replicated_and_the_gathered_state_too(shard, kind, world):
    steps = 4
    ref_model, ref_opt, _ = replicated(kind, steps)
    store = dist.HashStore()

    def rank(me: str):
        w = Worker(kind, shard)
        lay = shard_layout(w.params, w.opt, members(*"abc"[:world]), bucket_mb=0.0002)
        w.sg = w.path(lay, me)
        pg = group(store, "g", lay.rank_of(me), world)
        w.train(pg, range(steps))
        return w, w.sg.full_state_dict(), w.sg.memory()

    out = run_ranks({f"w{r}": (lambda r=r: rank(f"w{r}")) for r in range(world)})
    for name, (w, full, _mem) in out.items():
        assert_params_match(w.model, ref_model)
        assert_state_matches(full, ref_opt.state_dict())
    # ZeRO-2 keeps only the shard's gradients between steps
    if shard == "gradients":
        assert all(p.grad is None for w, _f, _m in out.values() for p in w.params)


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_frozen_parameters_in_the_optimizer_are_left_out_and_training_equals_replicated(shard):
    """Fine-tuning's usual form: AdamW(model.parameters()) with weight decay, then part of
    the model frozen (requires_grad=False). The frozen parameters are not sharded and never
    change (as under the replicated optimizer, which skips a parameter without a
    gradient); the rest train as replicated, and the gathered state is the replicated
    optimizer's: no state for the frozen ones."""
    steps, world = 4, 2

    def build(seed: int = 0):
        model = Net(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        model.a.weight.requires_grad_(False)
        model.b.bias.requires_grad_(False)
        return model, opt

    ref, ref_opt = build()
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    for t in range(steps):
        loss_of(ref, torch.arange(ROWS), t).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    store = dist.HashStore()

    def rank(r: int):
        model, opt = build()
        params = [p for p in model.parameters() if p.requires_grad]
        lay = shard_layout(params, opt, members("a", "b"), bucket_mb=0.0002)
        sg = ShardedGradients(params, opt, lay, r, shard)
        sg.bind()
        pg = group(store, "g", r, world)
        with sg.attached():
            for t in range(steps):
                sg.begin(pg)
                loss_of(model, torch.tensor_split(torch.arange(ROWS), world)[r], t).backward()
                sg.finish()
                sg.step()
                sg.zero_grad()
        return model, sg.full_state_dict()

    out = run_ranks({f"w{r}": (lambda r=r: rank(r)) for r in range(world)})
    for model, full in out.values():
        assert_params_match(model, ref)
        for n, p in model.named_parameters():
            if n in frozen:
                assert torch.equal(p.detach(), frozen[n]), n
        assert_state_matches(full, ref_opt.state_dict())
        assert len(full["state"]) == 2  # a.bias and b.weight


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_the_parameters_gather_by_point_to_point_and_by_all_gather_give_the_same_bits(monkeypatch, shard):
    """gloo gathers the stepped chunks into every rank's parameters by point-to-point
    sends and receives (its all-gather was 2-2.6x slower here), NCCL by
    all_gather_into_tensor: both give every rank the same parameters, bit for bit, and
    the replicated run's; each gathers (no other way in)."""
    steps, world = 3, 3
    ref_model, _ref_opt, _ = replicated("adamw", steps)
    used = {"send": 0, "allgather": 0}
    real_send, real_allgather = dist.ProcessGroupGloo.send, dist.ProcessGroupGloo._allgather_base
    monkeypatch.setattr(dist.ProcessGroupGloo, "send",
                        lambda pg, *a: used.__setitem__("send", used["send"] + 1) or real_send(pg, *a))
    monkeypatch.setattr(dist.ProcessGroupGloo, "_allgather_base",
                        lambda pg, *a: used.__setitem__("allgather", used["allgather"] + 1) or real_allgather(pg, *a))
    params = {}
    for p2p in (True, False):
        store = dist.HashStore()
        used.update(send=0, allgather=0)

        def rank(me: str, p2p=p2p):
            w = Worker("adamw", shard, p2p_gather=p2p)
            lay = shard_layout(w.params, w.opt, members(*"abc"), bucket_mb=0.0002)
            w.sg = w.path(lay, me)
            w.train(group(store, "g", lay.rank_of(me), world), range(steps))
            return w

        out = run_ranks({f"w{r}": (lambda r=r: rank(f"w{r}")) for r in range(world)})
        n_buckets = len(out["w0"].sg.layout.buckets)
        assert n_buckets > 1
        # every rank sends its chunk of every bucket to each other rank at every step, or all-gathers it
        assert used == ({"send": steps * n_buckets * world * (world - 1), "allgather": 0} if p2p
                        else {"send": 0, "allgather": steps * n_buckets * world})
        params[p2p] = [[p.detach().clone() for p in w.params] for w in out.values()]
        for w in out.values():
            assert_params_match(w.model, ref_model)
    for ranks in params.values():
        for got in ranks:
            assert all(torch.equal(a, b) for a, b in zip(got, ranks[0]))
    assert all(torch.equal(a, b) for a, b in zip(params[True][0], params[False][0]))


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_a_shard_stepped_in_small_pieces_with_one_staging_buffer_trains_as_replicated(monkeypatch, shard, kind):
    """The per-step path's economies keep the step exact: each chunk steps in pieces of
    5 elements (PIECE_ELEMS; its state views of the chunk's, the first step's state joined
    from the pieces), and ZeRO-2 has one staging buffer per dtype, so each float64 bucket
    waits in backward for the one before to be reduced and taken out of it."""
    from eltctl_runtime.train.zero import sharded as zero

    monkeypatch.setattr(zero, "PIECE_ELEMS", 5)
    monkeypatch.setattr(zero, "STAGING_BUFFERS", 1)
    steps = 4
    ref_model, ref_opt, _ = replicated(kind, steps)
    store = dist.HashStore()

    def rank(me: str):
        w = Worker(kind, shard)
        lay = shard_layout(w.params, w.opt, members("a", "b"), bucket_mb=0.00005)  # a bucket per parameter
        w.sg = w.path(lay, me)
        w.train(group(store, "g", lay.rank_of(me), 2), range(steps))
        return w, w.sg.full_state_dict(), w.sg.memory()

    out = run_ranks({f"w{r}": (lambda r=r: rank(f"w{r}")) for r in range(2)})
    for w, full, mem in out.values():
        assert [w.sg.layout.groups[b.group][0] for b in w.sg.layout.buckets].count(F64) == 2
        assert_params_match(w.model, ref_model)
        assert_state_matches(full, ref_opt.state_dict())
        # between steps ZeRO-2 keeps its chunks' gradients and one staging buffer per dtype
        assert (mem["staging"] > 0) == (shard == "gradients")
        assert mem["step_undo"] > 0


@pytest.mark.parametrize("shard,replicas", [("gradients", 1), ("optimizer", 1), ("optimizer", 2)])
def test_clipping_and_an_inf_in_one_shard_skip_the_step_everywhere_as_replicated(shard, replicas):
    """ZeRO-1's pieces unscale and clip the all-reduced gradients where they lie (no copy of
    the held chunks'), a backup's too."""
    steps, clip, inf_at = 5, 0.05, 2
    ref_model, ref_opt, ref_scaler = replicated("adamw", steps, clip=clip, scale=True, inf_at=inf_at)
    store = dist.HashStore()

    def rank(r: int):
        w = Worker("adamw", shard, scale=True, reduce_scatter=True)
        lay = shard_layout(w.params, w.opt, members("a", "b", "c"), replicas=replicas, bucket_mb=0.0002)
        w.sg = w.path(lay, f"w{r}")
        results = w.train(group(store, "g", r, 3), range(steps), clip=clip, inf_at=inf_at)
        return w, results

    out = run_ranks({f"w{r}": (lambda r=r: rank(r)) for r in range(3)})
    for w, results in out.values():
        assert [res.skipped for res in results] == [t == inf_at for t in range(steps)]
        assert all(res.grad_norm is not None and res.grad_norm > clip for i, res in enumerate(results) if i != inf_at)
        assert w.scaler.get_scale() == ref_scaler.get_scale()
        assert_params_match(w.model, ref_model)


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


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_where_every_rank_holds_every_chunk_the_step_needs_no_gather_and_stays_exact(monkeypatch, shard):
    """shard_replicas=2 at 2 ranks: each rank holds both chunks, so after the gradients'
    all-reduce it steps them all and writes its parameters itself (no all-gather, no
    all-reduce of the norm or the inf flag, no pre-step copy). Clipping, a GradScaler and
    an inf in one rank's gradients still give the replicated run, bit for bit alike on both."""
    steps, clip, inf_at = 5, 0.05, 2
    ref_model, _ref_opt, ref_scaler = replicated("adamw", steps, clip=clip, scale=True, inf_at=inf_at)
    store = dist.HashStore()

    def no_gather(self, b):
        raise AssertionError("an all-gather where every rank holds every chunk")

    monkeypatch.setattr(ShardedGradients, "_gather_bucket", no_gather)
    copies = []
    real_copy = ShardedGradients._held_copy
    monkeypatch.setattr(ShardedGradients, "_held_copy", lambda self, *a: copies.append(1) or real_copy(self, *a))

    def rank(r: int):
        w = Worker("adamw", shard, scale=True, reduce_scatter=True)
        lay = shard_layout(w.params, w.opt, members("a", "b"), replicas=2, bucket_mb=0.0002)
        assert lay.held(r) == ((0, 1) if r == 0 else (1, 0))
        w.sg = w.path(lay, f"w{r}")
        results = w.train(group(store, "g", r, 2), range(steps), clip=clip, inf_at=inf_at)
        return w, results

    out = run_ranks({f"w{r}": (lambda r=r: rank(r)) for r in range(2)})
    (w0, res0), (w1, res1) = out["w0"], out["w1"]
    for w, results in ((w0, res0), (w1, res1)):
        assert [res.skipped for res in results] == [t == inf_at for t in range(steps)]
        assert w.scaler.get_scale() == ref_scaler.get_scale()
        assert_params_match(w.model, ref_model)
    assert [r.grad_norm for r in res0] == [r.grad_norm for r in res1]
    for p, q in zip(w0.model.parameters(), w1.model.parameters()):
        assert torch.equal(p, q)
    assert not copies


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


def test_a_full_state_loads_at_another_world_size_and_a_shard_reloads_itself():
    ref_model, ref_opt, _ = replicated("adamw", 3)
    full = ref_opt.state_dict()
    store = dist.HashStore()

    def rank(r: int):
        w = Worker("adamw", "optimizer")
        with torch.no_grad():
            for p, q in zip(w.params, ref_model.parameters()):
                p.copy_(q)
        lay = shard_layout(w.params, w.opt, members("a", "b", "c"), bucket_mb=0.0002)
        w.sg = w.path(lay, f"w{r}")
        w.sg.load_full_state_dict(full)
        again = w.path(lay, f"w{r}")
        again.load_shard_state_dict(w.sg.shard_state_dict())
        w.sg = again
        w.sg.begin(group(store, "g", r, 3))
        return w.sg.full_state_dict()

    out = run_ranks({f"w{r}": (lambda r=r: rank(r)) for r in range(3)})
    for got in out.values():
        assert_state_matches(got, full)


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
        flats = [f.data_ptr() for f in w.sg._flat]
        assert lay_a.groups[0] == ("torch.float32", 1) and lay_a.buckets[0].numel == 3
        new = path(w, lay_b, me, reuse=w.sg)
        ptrs = [f.data_ptr() for f in new._flat]
        assert ptrs[0] != flats[0] and ptrs[1:] == flats[1:], (ptrs, flats)
        moved = reshard(lay_a, lay_b, pg_a, ids_a, old=w.sg, new=new)
        assert moved["from"] == [1] and moved["received_bytes"] > 0, moved
        w.sg = new
        w.train(group(store, "b", 0, 1), range(3, 6))
        pg_c = group(store, "c", 0, 2)
        new = path(w, lay_c, me, reuse=w.sg)
        assert [f.data_ptr() for f in new._flat][1:] == flats[1:]
        for p, slot in zip(w.params, lay_c.slots):  # still views of the kept buffers
            f = new._flat[slot.group]
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
    """With two replicas at world 2 every rank holds both chunks (`_full`): its masters only
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
        assert w.sg._full
        # the masters take no memory: one element each, expanded to the chunk's size
        assert all(m.numel() == one_chunk and m.untyped_storage().nbytes() == m.element_size()
                   for ms, one_chunk in zip(w.sg._masters, (w.sg.layout.shard_len(g) for g in range(4)))
                   for m in ms)
        assert w.sg.memory()["shard_params"] == sum(len(ms) * ms[0].element_size() for ms in w.sg._masters)
        w.train(group(store, "full", ids.index(me), 2), range(0, 4))
        one = shard_layout(w.params, w.opt, [Member(me, f"h{me}")], bucket_mb=0.0002)
        new = ShardedGradients(w.params, w.opt, one, 0, w.shard)
        old = [(t.data_ptr(), t.numel()) for t in w.sg._shard_grads]
        new.bind(reuse=w.sg)
        now = [(t.data_ptr(), t.numel()) for t in new._shard_grads]
        # kept where the total size is the same (all but the 3-element biases' group, which pads otherwise)
        assert [a == b for a, b in zip(old, now)] == [o[1] == n[1] for o, n in zip(old, now)]
        assert sum(a == b for a, b in zip(old, now)) == len(now) - 1, (old, now)
        assert all(not t.any() for t in new._shard_grads)
        return w

    out = run_ranks({me: (lambda me=me: member(me)) for me in ids})
    for w in out.values():
        assert_params_match(w.model, ref_model)


def test_a_collective_waited_on_without_an_abort_event_waits_for_a_late_peer():
    """checkpoint.restore_chunks and zero's helpers take abort=None outside a generation
    (tests, tools): a peer that comes late (hashing its shard files, here 0.3 s) must be
    waited for, not end the wait with an AttributeError on the missing event."""
    from eltctl_runtime.member import collectives

    store = dist.HashStore()

    def rank(r: int):
        pg = group(store, "late", r, 2)
        if r == 1:
            time.sleep(0.3)
        t = torch.tensor([float(r + 1)])
        collectives.allreduce(pg, t, None)
        b = collectives.broadcast(pg, torch.tensor([float(r)]), 1, None)
        done = collectives.run_abortable(lambda: 7, None, "a call")
        return float(t[0]), float(b[0]), done

    out = run_ranks({f"w{r}": (lambda r=r: rank(r)) for r in range(2)})
    assert out == {"w0": (3.0, 1.0, 7), "w1": (3.0, 1.0, 7)}


@pytest.mark.parametrize("keep", [False, True])
def test_the_own_chunk_steps_the_parameters_in_place_and_a_broken_gather_settles_either_way(keep):
    """A rank's own chunk steps the parameters' buffer itself (no stepped copy: at world 3
    with two replicas only the backup has one) and the all-gather sends it from there. A
    step whose gather never ran (its launch failed) is in doubt: settle(keep=False) puts the
    own chunk and its state back to the step before, settle(keep=True) keeps the step (the
    gather, run again, then gives the parameters of the step)."""
    ref_before, opt_before, _ = replicated("adamw", 2)
    ref_after, opt_after, _ = replicated("adamw", 3)
    store = dist.HashStore()
    ids = ["w0", "w1", "w2"]

    def rank(me: str):
        w = Worker("adamw", "gradients")
        lay = shard_layout(w.params, w.opt, [Member(i, f"h{i}") for i in ids], replicas=2, bucket_mb=0.0002)
        w.sg = w.path(lay, me)
        assert len(w.sg._held) == 2 and not w.sg._full
        for g, (own, backup) in enumerate(w.sg._masters):
            assert own.untyped_storage().nbytes() == own.element_size()  # a key, no copy
            assert backup.untyped_storage().nbytes() == lay.shard_len(g) * backup.element_size()
        pg = group(store, f"settle-{keep}", lay.rank_of(me), 3)
        w.train(pg, range(2))
        sg = w.sg
        with sg.attached():
            sg.begin(pg)
            loss_of(w.model, torch.tensor_split(torch.arange(ROWS), 3)[lay.rank_of(me)], 2).backward()
            sg.finish()
            launch = sg._gather_bucket
            sg._gather_bucket = lambda b: (_ for _ in ()).throw(RuntimeError("the gather broke"))
            with pytest.raises(RuntimeError, match="the gather broke"):
                sg.step()
            sg._gather_bucket = launch
        assert sg.step_in_doubt
        sg.settle(keep)
        assert not sg.step_in_doubt
        if keep:
            sg.gather_params()
        return w, sg.full_state_dict()

    out = run_ranks({me: (lambda me=me: rank(me)) for me in ids})
    for w, full in out.values():
        assert_params_match(w.model, ref_after if keep else ref_before)
        assert_state_matches(full, (opt_after if keep else opt_before).state_dict())


PEER_THAT_GOES = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=timedelta(seconds=30))
opts = dist.ProcessGroupGloo._Options()
opts._timeout = timedelta(seconds=30)
opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
pg = dist.ProcessGroupGloo(dist.PrefixStore("gone", store), 1, 2, opts)
pg.send([torch.ones(4)], 0, 0).wait()
os._exit(0)  # its sockets close with it, as a SIGKILLed rank's do
"""


@pytest.mark.parametrize("post", ["send", "recv"])
def test_a_transfer_posted_to_a_peer_already_gone_is_an_abort_with_a_backend_error(post):
    """gloo raises at once when a send or receive is posted on a pair whose peer has
    already closed its end (a rank SIGKILLed before the writer posts the receive of its
    checkpoint shard: the writer then left the job with that RuntimeError, 1 run in 8 of
    test_sharded_job's checkpoint-kill test under load). Posted through
    collectives.send/recv it is an Aborted with backend_error, as a failure in the wait
    is: the caller abandons the transfer and the generation goes on without the peer."""
    import subprocess
    import sys

    from eltctl_runtime.member import collectives

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", PEER_THAT_GOES, str(store.port)])
    try:
        pg = group(store, "gone", 0, 2)
        collectives.wait_p2p([collectives.recv(pg, torch.zeros(4), 1)], None, "a first message")  # the pair is up
        assert peer.wait(timeout=30) == 0
        time.sleep(0.3)  # its end of the pair is closed
        with pytest.raises(collectives.Aborted) as got:
            work = (collectives.send(pg, torch.ones(4), 1) if post == "send"
                    else collectives.recv(pg, torch.zeros(4), 1))
            collectives.wait_p2p([work], threading.Event(), "a transfer to a peer gone")
        assert got.value.backend_error, got.value
        assert "Connection closed" in str(got.value) or "closed" in str(got.value).lower(), got.value
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_a_dropped_step_keeps_its_buffers_where_its_reductions_ended_and_replaces_them_where_one_runs_on(shard):
    """Step 2 is dropped on both ranks. w0 drops it with its reductions still in flight
    (w1 has not reached them: a survivor whose ring neighbour left its own) and redoes it
    at once, so its old gradient buffers are stale: w1's late reductions write into them
    while w0's redo is under way, which must not use them. w1 drops it after its
    reductions completed and keeps its buffers. Both end exactly as the replicated run
    (with the stale buffers reused, the late write would land in w0's redo)."""
    steps = 4
    ref_model, ref_opt, _ = replicated("adamw", steps)
    store = dist.HashStore()
    w0_redoing = threading.Event()

    def rank(me: str):
        w = Worker("adamw", shard)
        lay = shard_layout(w.params, w.opt, members("a", "b"), bucket_mb=1.0)  # one bucket: no pool wait
        w.sg = w.path(lay, me)
        r = lay.rank_of(me)
        pg = group(store, "g", r, 2)
        w.train(pg, range(2))
        sg = w.sg
        rows = torch.tensor_split(torch.arange(ROWS), 2)[r]
        with sg.attached():
            if me == "w0":
                sg.begin(pg)
                loss_of(w.model, rows, 2).backward()  # every bucket launched; w1 is not there yet
                assert not dist_settled(sg)
                old = sg._grads + sg._shard_grads + [t for ts in sg._pool.values() for t in ts]
                sg.drop()
                assert sg._stale
                sg.begin(pg)  # the redo: fresh buffers
                assert not sg._stale
                assert not {t.data_ptr() for t in sg._grads + sg._shard_grads} & {t.data_ptr() for t in old}
                loss_of(w.model, rows, 2).backward()
                w0_redoing.set()
                sg.finish()  # after w1's late match of the dropped reductions
                assert any(t.abs().sum() > 0 for t in old), "the late reductions wrote into the old buffers"
            else:
                w0_redoing.wait(30)
                sg.begin(pg)
                loss_of(w.model, rows, 2).backward()
                sg.finish()  # its reductions complete (w0's dropped ones are their peers)
                kept = [t.data_ptr() for t in sg._grads + sg._shard_grads]
                sg.drop()  # w0 did not step: w1 drops the step too, its reductions all ended
                assert not sg._stale
                sg.begin(pg)
                assert [t.data_ptr() for t in sg._grads + sg._shard_grads] == kept
                loss_of(w.model, rows, 2).backward()
                sg.finish()
            sg.step(None, None)
            sg.zero_grad()
        w.train(pg, range(3, steps))
        return w, sg.full_state_dict()

    out = run_ranks({f"w{r}": (lambda r=r: rank(f"w{r}")) for r in range(2)})
    for w, full in out.values():
        assert_params_match(w.model, ref_model)
        assert_state_matches(full, ref_opt.state_dict())


def dist_settled(sg: ShardedGradients) -> bool:
    from eltctl_runtime.member import collectives

    return collectives.settled(sg._works)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("reduce_scatter", [False, True])
def test_zero2_reducing_each_micro_batch_equals_replicated_with_uneven_counts_and_keeps_no_full_gradient(
        reduce_scatter, replicas):
    """ElasticJob(reduce_each_micro_batch=True)'s rounds. At world 3 each step rank 0 runs
    its share in 3 micro-batches, rank 1 in 2, rank 2 in 1: each micro-batch before the last
    is reduced into the held chunks (begin(accumulate=True), finish_round), added to the
    rounds before; a rank with fewer reduces empty rounds (zeros) before its last. With
    clipping, the parameters equal replicated training's on the global batch, and between
    micro-batches no rank keeps a full gradient (every .grad is None)."""
    steps, world, clip, counts = 4, 3, 0.05, (3, 2, 1)
    ref_model, _ref_opt, _ = replicated("adamw", steps, clip=clip)
    store = dist.HashStore()

    def rank(r: int):
        w = Worker("adamw", "gradients", reduce_scatter=reduce_scatter)
        lay = shard_layout(w.params, w.opt, members("a", "b", "c"), replicas=replicas, bucket_mb=0.0002)
        sg = w.sg = w.path(lay, f"w{r}")
        pg = group(store, "g", r, world)
        between, norms = [], []
        with sg.attached():
            for t in range(steps):
                parts = torch.tensor_split(torch.tensor_split(torch.arange(ROWS), world)[r], counts[r])
                for rows in parts[:-1]:
                    sg.begin(pg, accumulate=True)
                    loss_of(w.model, rows, t).backward()
                    sg.finish_round()
                    between.append(all(p.grad is None for p in w.params))
                for _ in range(max(counts) - counts[r]):
                    sg.begin(pg, accumulate=True)
                    sg.finish_round()
                sg.begin(pg)
                loss_of(w.model, parts[-1], t).backward()
                sg.finish()
                norms.append(sg.step(clip).grad_norm)
                sg.zero_grad()
        return w, between, norms

    out = run_ranks({f"w{r}": (lambda r=r: rank(r)) for r in range(world)})
    assert len({tuple(norms) for _w, _b, norms in out.values()}) == 1  # every rank clipped alike
    for w, between, norms in out.values():
        assert_params_match(w.model, ref_model)
        assert all(between) and all(n > clip for n in norms)
    assert [len(out[f"w{r}"][1]) for r in range(world)] == [steps * (c - 1) for c in counts]


def test_only_zero2_reduces_each_micro_batch():
    w = Worker("adamw", "optimizer")
    sg = w.path(shard_layout(w.params, w.opt, members("a")), "w0")
    with pytest.raises(ValueError, match="only ZeRO-2"):
        sg.begin(None, accumulate=True)

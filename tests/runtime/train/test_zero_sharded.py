"""One rank's sharded state (train/zero/sharded.py) on real gloo groups, one thread per
rank on one HashStore: training and the gathered state equal the replicated run's, and a
full or a shard's state loads back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from runtime_cluster import gloo_group as group, run_threads as run_ranks
from zero_ranks import OTHER_KINDS, ROWS, Net, Worker, assert_params_match, assert_state_matches, loss_of, members, replicated

from eltctl_runtime.train.zero import ShardedGradients, shard_layout


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

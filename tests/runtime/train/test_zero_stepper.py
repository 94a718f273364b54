"""The sharded step (train/zero/stepper.py): the parameters' gather, clipping and the
GradScaler's skip alike on every rank, the step with every chunk held, and a step in doubt
settled either way; against the replicated run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from runtime_cluster import gloo_group as group, run_threads as run_ranks
from zero_ranks import ROWS, Worker, assert_params_match, assert_state_matches, loss_of, members, replicated

from eltctl_runtime.train.zero import Member, shard_layout
from eltctl_runtime.train.zero.stepper import Stepper


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

    monkeypatch.setattr(Stepper, "gather_bucket", no_gather)
    copies = []
    real_copy = Stepper.held_copy
    monkeypatch.setattr(Stepper, "held_copy", lambda self, *a: copies.append(1) or real_copy(self, *a))

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
        assert len(w.sg.held) == 2 and not w.sg.holds_every_chunk
        for g, (own, backup) in enumerate(w.sg.masters):
            assert own.untyped_storage().nbytes() == own.element_size()  # a key, no copy
            assert backup.untyped_storage().nbytes() == lay.shard_len(g) * backup.element_size()
        pg = group(store, f"settle-{keep}", lay.rank_of(me), 3)
        w.train(pg, range(2))
        sg = w.sg
        with sg.attached():
            sg.begin(pg)
            loss_of(w.model, torch.tensor_split(torch.arange(ROWS), 3)[lay.rank_of(me)], 2).backward()
            sg.finish()
            stepper = sg.stepper  # the step launches each bucket's gather through its own gather_bucket
            stepper.gather_bucket = lambda b: (_ for _ in ()).throw(RuntimeError("the gather broke"))
            with pytest.raises(RuntimeError, match="the gather broke"):
                sg.step()
            del stepper.gather_bucket  # the class's again
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

"""The sharded gradient reduction (train/zero/reducer.py): small pieces and one staging
buffer, a dropped step's buffers, ZeRO-2 reducing each micro-batch; against the replicated run."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from runtime_cluster import gloo_group as group, run_threads as run_ranks
from zero_ranks import F64, ROWS, Worker, assert_params_match, assert_state_matches, dist_settled, loss_of, members, replicated

from eltctl_runtime.train.zero import shard_layout


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_a_shard_stepped_in_small_pieces_with_one_staging_buffer_trains_as_replicated(monkeypatch, shard, kind):
    """The per-step path's economies keep the step exact: each chunk steps in pieces of
    5 elements (PIECE_ELEMS; its state views of the chunk's, the first step's state joined
    from the pieces), and ZeRO-2 has one staging buffer per dtype, so each float64 bucket
    waits in backward for the one before to be reduced and taken out of it."""
    from eltctl_runtime.train.zero import buffers, reducer

    monkeypatch.setattr(buffers, "PIECE_ELEMS", 5)
    monkeypatch.setattr(reducer, "STAGING_BUFFERS", 1)
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
                old = list(sg.flat_grads + sg.chunk_grads) + list(sg.staging_buffers)
                sg.drop()
                assert sg.stale
                sg.begin(pg)  # the redo: fresh buffers
                assert not sg.stale
                assert not {t.data_ptr() for t in list(sg.flat_grads + sg.chunk_grads)} & {t.data_ptr() for t in old}
                loss_of(w.model, rows, 2).backward()
                w0_redoing.set()
                sg.finish()  # after w1's late match of the dropped reductions
                assert any(t.abs().sum() > 0 for t in old), "the late reductions wrote into the old buffers"
            else:
                w0_redoing.wait(30)
                sg.begin(pg)
                loss_of(w.model, rows, 2).backward()
                sg.finish()  # its reductions complete (w0's dropped ones are their peers)
                kept = [t.data_ptr() for t in list(sg.flat_grads + sg.chunk_grads)]
                sg.drop()  # w0 did not step: w1 drops the step too, its reductions all ended
                assert not sg.stale
                sg.begin(pg)
                assert [t.data_ptr() for t in list(sg.flat_grads + sg.chunk_grads)] == kept
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

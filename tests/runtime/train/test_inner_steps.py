"""Local steps' inner steps of a fixed size (`ElasticJob(sync="local", inner_batch=b)`,
train/inner.py): a rank's share of a step taken in inner steps of at most b samples, so
a rank with a bigger share (a faster one, under speed-proportional shares) takes more
inner steps, and the round's samples-weighted average counts them all."""

from __future__ import annotations

import threading

import pytest
import torch

from eltctl_runtime.train import local
from eltctl_runtime.train.inner import micro_limit, step_ends
from eltctl_runtime.train.pipeline import micro_chunks
from eltctl_runtime.train.shares import Shares
from eltctl_runtime.train.step import OptimizerStep
from eltctl_runtime.train.tail import Control, layout as tail_layout
from runtime_cluster import gloo_group, run_threads
from tests.runtime.train.test_local_steps import (local_sgd, make_model, mean_loss, outer_nesterov, shares_of,
                                                  thread_rank)


@pytest.mark.parametrize("indices, inner_batch, micro, chunks, ends", [
    ([1, 2, 3, 4, 5], None, None, [[1, 2, 3, 4, 5]], set()),  # off: the share in micro-batches, one inner step
    ([1, 2, 3, 4, 5], None, 2, [[1, 2], [3, 4], [5]], set()),
    ([1, 2, 3, 4, 5], 2, None, [[1, 2], [3, 4], [5]], {1, 2}),  # steps after the 1st and 2nd; the 3rd is the step's
    ([1, 2, 3, 4, 5], 4, 3, [[1, 2], [3, 4], [5]], {2}),  # micro-batches of 2: the largest divisor of 4 within 3
    ([1, 2, 3, 4, 5, 6, 7], 3, 1, [[1], [2], [3], [4], [5], [6], [7]], {3, 6}),
    ([1, 2, 3], 8, None, [[1, 2, 3]], set()),  # a share smaller than inner_batch: one inner step
    ([], 2, None, [[]], set()),  # no share: the rank still takes part in the step
])
def test_a_share_is_cut_into_groups_of_inner_batch_then_micro_batches(indices, inner_batch, micro, chunks, ends):
    m = micro_limit(inner_batch, micro)  # as ElasticJob cuts a share: the micro-batch size, then where groups end
    cut = micro_chunks(indices, m)
    assert (cut, step_ends(len(cut), inner_batch, m)) == (chunks, ends)


def run_inner_ranks(shares: list[list[list[int]]], sync_every: int, inner_batch: int, micro: int | None) -> list[dict]:
    """Two ranks (threads, gloo) run one round as ElasticJob's loop does with inner_batch:
    the share's micro-batches (InnerSteps.micro_limit, begin_step), each loss scaled by m / global_count, an
    inner step where a group ends (InnerSteps.micro_batch_done), the last one after the
    tail's all-reduce (finish, the OptimizerStep), then the round's averaging."""
    store = torch.distributed.HashStore()
    init = threading.Lock()  # the ranks are threads: the global RNG is shared

    def rank(r: int) -> dict:
        model, params, inner, job = thread_rank(init, r)
        job._abort, job._shares = threading.Event(), Shares(balance=False, min_share=1, micro=None)
        job._update = OptimizerStep(inner, scaler=None, max_grad_norm=None, before=None)
        path = local.LocalPath(job, sync_every, None, inner_batch=inner_batch)
        path.bind(gloo_group(store, "i", r, 2), r, ["a", "b"], threading.Event())
        path.start_round()
        lay = tail_layout(2)
        computed, inner_steps = [], []
        inner.register_step_post_hook(lambda *_: inner_steps.append(1))
        for t in range(sync_every):
            idx = shares[r][t]
            total = len(idx) + len(shares[1 - r][t])
            m = path.inner.micro_limit(micro)
            chunks = micro_chunks(idx, m)
            path.inner.begin_step(len(chunks), m)
            for k, chunk in enumerate(chunks):
                if k == len(chunks) - 1:
                    path.begin(lay.size)
                (mean_loss(model, chunk) * (len(chunk) / total)).backward()
                path.end_backward()
                if k < len(chunks) - 1:
                    path.inner.micro_batch_done(path, job, len(chunk), total)
            path.tail().copy_(lay.encode(r, Control(False, False, len(idx), 0.0, False, False, False, False, 0.0, 0)))
            path.finish(threading.Event())
            job._update.run(job, path, threading.Event())
            path.zero()
            job._step = t + 1
            computed.append(job._shares.compute_s)
            job._shares.compute_s = 0.0
        assert path.round_samples == sum(len(s) for s in shares[r][:sync_every])
        path.average(threading.Event())
        return {"params": [p.detach().clone() for p in params], "inner_steps": len(inner_steps), "computed": computed,
                "mode": job._status.network.mode, "fingerprint": path.fingerprint(model, inner, {})}

    return [v for _k, v in sorted(run_threads({r: (lambda r=r: rank(r)) for r in range(2)}).items())]


@pytest.mark.parametrize("micro", [None, 1], ids=["whole-groups", "micro-batches-of-1"])
def test_a_bigger_share_takes_more_inner_steps_and_the_round_weighs_them_by_samples(micro):
    """Rank 0 takes 3 samples a step, rank 1 takes 7, inner_batch 2: rank 0 takes 2 inner
    steps a step (2 + 1 samples), rank 1 takes 4 (2 + 2 + 2 + 1). After a round of 3 steps the
    parameters are the outer Nesterov step along (9 d0 + 21 d1) / 30, d_r the delta of the
    rank's own SGD steps on those groups' local mean losses, computed here by hand; the
    same whether a group is one micro-batch or two (float tolerance). The inner steps before
    a step's last count as the rank's compute (its pace)."""
    H, b = 3, 2
    shares = shares_of(5, H)
    out = run_inner_ranks(shares, H, b, micro)
    assert [o["inner_steps"] for o in out] == [2 * H, 4 * H]
    assert out[0]["mode"] == {"mode": "local", "sync_every": H, "inner_batch": b}
    assert all(c > 0 for o in out for c in o["computed"])
    assert out[0]["fingerprint"] == out[1]["fingerprint"]
    assert all(torch.equal(x, y) for x, y in zip(out[0]["params"], out[1]["params"]))

    start = [p.detach().clone() for p in make_model().parameters()]
    groups = [[s[g:g + b] for s in shares[r][:H] for g in range(0, len(s), b)] for r in range(2)]
    ends = [local_sgd(start, groups[r]) for r in range(2)]
    delta = [(9 * (s - e0) + 21 * (s - e1)) / 30 for s, e0, e1 in zip(start, *ends)]
    want, _ = outer_nesterov(start, None, delta)
    for got, w in zip(out[0]["params"], want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
    # one inner step per job step (inner_batch off) would land elsewhere: the test tells them apart
    whole = [local_sgd(start, shares[r][:H]) for r in range(2)]
    other, _ = outer_nesterov(start, None, [(9 * (s - e0) + 21 * (s - e1)) / 30 for s, e0, e1 in zip(start, *whole)])
    assert max(float((g - o).abs().max()) for g, o in zip(out[0]["params"], other)) > 1e-4

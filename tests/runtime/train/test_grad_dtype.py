"""bf16 on the wire (`ElasticJob(grad_dtype="bf16")`, gradients.py): float32 buckets are
all-reduced as bfloat16 copies and cast back once; the float32 tail, other dtypes'
buckets and the job's elastic life are unaffected."""

from __future__ import annotations

import threading

import pytest
import torch

import eltctl_runtime as elt
from runtime_cluster import gloo_group, run_threads

U = 2.0 ** -8  # bfloat16's unit roundoff (8-bit significand)
TAIL = [1_000_001.0, 0.1, 3.0, 16_777_215.0]  # none of them a bfloat16 value: a bf16 tail would show


class Mixed(torch.nn.Module):
    """Two float32 parameters and a float64 one: buckets of both dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 40))
        self.b = torch.nn.Parameter(torch.randn(64))
        self.c = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w.T + self.b)
        return (h ** 2).sum() * 1e-3 + (h.sum() * 1e-2) ** 3 + ((self.c ** 3) * x.sum().double()).sum()


@pytest.mark.parametrize("grad_dtype", ["bf16", "fp32"])
def test_the_bf16_path_sums_bf16_rounded_gradients_and_keeps_the_tail_and_float64_exact(grad_dtype):
    """Two ranks (threads, gloo), a bucket per parameter. bf16: each float32 gradient is the
    bfloat16 sum of the ranks' bfloat16-cast gradients, bit for bit (the backend adds two
    bfloat16 values exactly and rounds once), within 2u(|g0| + |g1|) of the float32 sum and
    not equal to it; "fp32" (as None) gives the float32 sum exactly. Either way the float32
    tail's sum and the float64 gradient are exact."""
    from eltctl_runtime.train.gradients import ReplicatedPath

    init = threading.Lock()  # the ranks are threads: the global RNG is shared
    store = torch.distributed.HashStore()

    def rank(r: int) -> dict:
        with init:
            torch.manual_seed(5)
            m = Mixed()
            x = torch.randn(16, 40, generator=torch.Generator().manual_seed(r)) * (1 + 3 * r)
        params = list(m.parameters())
        local = [g.detach().clone() for g in torch.autograd.grad(m.loss(x), params)]  # no hooks fire
        path = ReplicatedPath(params, bucket_mb=0.0001, grad_dtype=grad_dtype)
        path.pg = gloo_group(store, "g", r, 2)
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: path.grad_ready(i, p))
        path.begin(len(TAIL))
        m.loss(x).backward()
        path.end_backward()
        path.tail().copy_(torch.tensor(TAIL) * (r + 1))
        tail = path.finish(threading.Event())
        return {"local": local, "reduced": [p.grad.clone() for p in params], "tail": tail}

    out = run_threads({r: (lambda r=r: rank(r)) for r in range(2)})
    g0, g1 = out[0]["local"], out[1]["local"]
    worst = 0.0
    for r in range(2):
        red = out[r]["reduced"]
        assert [g.dtype for g in red] == [torch.float32, torch.float32, torch.float64]
        assert torch.equal(out[r]["tail"], torch.tensor(TAIL) * 3), out[r]["tail"]  # float32: exact
        assert torch.equal(red[2], g0[2] + g1[2])  # the float64 bucket goes as it is
        for got, a, b in zip(red[:2], g0[:2], g1[:2]):
            exact = a + b
            if grad_dtype == "fp32":
                assert torch.equal(got, exact)
                continue
            rounded = (a.bfloat16().float() + b.bfloat16().float()).bfloat16().float()
            assert torch.equal(got, rounded)
            bound = 2 * U * (1 + U) * (a.abs() + b.abs())
            assert ((got - exact).abs() <= bound).all()
            assert not torch.equal(got, exact)  # it did go as bfloat16
            worst = max(worst, float(((got - exact).abs() / (a.abs() + b.abs()).clamp_min(1e-30)).max()))
    if grad_dtype == "bf16":
        print(f"largest |bf16 - fp32| / (|g0| + |g1|): {worst:.2e} (bound {2 * U * (1 + U):.2e})")
        assert worst > 0


def test_bad_grad_dtypes_and_sharded_jobs_are_refused_naming_the_choices():
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"grad_dtype must be None or one of 'fp32', 'bf16', got 'fp16'"):
        elt.ElasticJob(model, sgd, data, global_batch_size=2, max_steps=1, grad_dtype="fp16")
    with pytest.raises(ValueError, match=r"grad_dtype must be None or one of .*got 'fp16'"):
        elt.ElasticJob(model, sgd, data, global_batch_size=2, max_steps=1, shard="optimizer", grad_dtype="fp16")
    for shard in ("optimizer", "gradients"):
        with pytest.raises(ValueError, match=rf"grad_dtype='bf16' applies to replicated training .*shard='{shard}'"):
            elt.ElasticJob(model, sgd, data, global_batch_size=2, max_steps=1, shard=shard, grad_dtype="bf16")
    for ok in (None, "fp32", "bf16"):
        elt.ElasticJob(model, sgd, data, global_batch_size=2, max_steps=1, grad_dtype=ok)


@pytest.mark.slow
def test_bf16_gradients_through_a_join_and_a_leave(cluster_factory):
    """Real processes with --grad-dtype bf16 and a bucket per parameter: 2 -> 3 (join)
    -> 2 (leave); every rank ends with the same state, each sample is committed exactly
    once, and training learns."""
    from tests.runtime.train.test_elastic_scenarios import FOREVER, finish

    args = FOREVER + ["--bucket-mb", "0.0001", "--grad-dtype", "bf16"]
    c = cluster_factory(min_workers=2)
    ws = c.start(2, args)
    g = c.wait_world(2, steps_after=3)
    (d,) = c.start(1, args)
    g = c.wait_world(3, min_gen=g + 1, steps_after=3)
    c.leave(ws[1])
    c.wait_world(2, min_gen=g + 1, steps_after=3)
    final = finish(c, None, [ws[0], d], 2)[0]["loss"]
    first = float(ws[0].progress.read_text().splitlines()[0].split()[4])
    assert final < first, (first, final)

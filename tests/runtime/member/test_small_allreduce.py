"""collectives.allreduce_small: a small tensor summed by a direct exchange (every rank to
every other), the same bits on every rank, in several rounds in a row; an abort leaves a
wait on a rank that never sends."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from eltctl_runtime.member import collectives
from eltctl_runtime.member.collectives import Aborted
from runtime_cluster import gloo_group, run_threads


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_gets_the_rank_order_sum_bit_for_bit_round_after_round(world):
    store = dist.HashStore()
    g = torch.Generator().manual_seed(11)
    # values whose float32 sum depends on the order (large and small mixed)
    inputs = [[(torch.randn(37, generator=g) * 10.0 ** torch.randint(-6, 7, (37,), generator=g)).float()
               for _ in range(world)] for _ in range(3)]

    def rank(r: int) -> list[torch.Tensor]:
        pg = gloo_group(store, "s", r, world)
        out = []
        for step in range(3):  # back to back: each round's messages match their own round
            t = inputs[step][r].clone()
            got = collectives.allreduce_small(pg, t, threading.Event())
            assert got is t
            out.append(t.clone())
        return out

    out = run_threads({r: (lambda r=r: rank(r)) for r in range(world)})
    for step in range(3):
        expect = inputs[step][0].clone()
        for x in inputs[step][1:]:
            expect += x
        for r in range(world):
            assert torch.equal(out[r][step], expect), (step, r)


def test_an_abort_ends_the_wait_for_a_rank_that_never_sends():
    store = dist.HashStore()
    abort, done = threading.Event(), threading.Event()

    def rank(r: int):
        pg = gloo_group(store, "a", r, 2)
        if r == 1:
            done.wait(30)  # in the group (its connections open), but never takes part
            return pg
        threading.Timer(0.3, abort.set).start()
        try:
            with pytest.raises(Aborted, match="aborted"):
                collectives.allreduce_small(pg, torch.ones(4), abort)
        finally:
            done.set()
        return "aborted"

    assert run_threads({r: (lambda r=r: rank(r)) for r in range(2)})[0] == "aborted"


def test_a_world_of_one_and_a_large_tensor_take_the_plain_paths():
    store = dist.HashStore()
    pg = gloo_group(store, "one", 0, 1)
    t = torch.arange(5.0)
    assert torch.equal(collectives.allreduce_small(pg, t, None), torch.arange(5.0))

    def rank(r: int) -> torch.Tensor:
        pg2 = gloo_group(store, "big", r, 2)
        t = torch.full((collectives.SMALL_MAX + 1,), float(r + 1))
        return collectives.allreduce_small(pg2, t, None)

    out = run_threads({r: (lambda r=r: rank(r)) for r in range(2)})
    assert torch.all(out[0] == 3) and torch.all(out[1] == 3)

"""Table tests of the runtime's pure parts: the sampler, the generation
decisions, the state codec and the environment contract."""

from __future__ import annotations

import random

import pytest
import torch

from eltctl_runtime import ConfigError, RuntimeConfig, SamplerState, epoch_order, share_bounds
from eltctl_runtime.member.plan import Plan, Transfer, Verdict, choose_source, propose, receivers, roll_call
from eltctl_runtime.protocol import EventKind
from eltctl_runtime.train import state as st
from eltctl_runtime.train.job import bucket_layout


@pytest.mark.parametrize("total,world", [(10, 3), (7, 7), (3, 5), (64, 4), (65, 4), (0, 2)])
def test_shares_are_contiguous_cover_the_slice_and_differ_by_at_most_one(total, world):
    bounds = [share_bounds(total, r, world) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_epoch_order_is_a_permutation_fixed_by_seed_and_epoch():
    assert sorted(epoch_order(100, 3, 0)) == list(range(100))
    assert epoch_order(100, 3, 0) == epoch_order(100, 3, 0)
    assert epoch_order(100, 3, 0) != epoch_order(100, 3, 1)
    assert epoch_order(100, 3, 0) != epoch_order(100, 4, 0)


def test_any_sequence_of_world_sizes_consumes_each_epoch_exactly_once():
    rng = random.Random(7)
    s = SamplerState(n_samples=103, global_batch=16, seed=1)
    seen: dict[int, list[int]] = {}
    while s.epoch < 3:
        world = rng.randint(1, 9)
        taken = [i for r in range(world) for i in s.local_indices(r, world)]
        assert taken == s.global_indices()
        seen.setdefault(s.epoch, []).extend(taken)
        s = s.advanced()
    assert all(sorted(v) == list(range(103)) for v in seen.values())


def test_last_batch_of_an_epoch_is_short_and_the_next_epoch_starts_at_zero():
    s = SamplerState(n_samples=10, global_batch=4, seed=0, position=8)
    assert s.step_size() == 2
    assert s.advanced() == SamplerState(n_samples=10, global_batch=4, seed=0, epoch=1, position=0)


G2 = Plan(generation=2, members=("a", "b", "c"), join_upto=3)


@pytest.mark.parametrize(
    "survivors,queue,upto,cap,kind,members,joined,left,lost,gen_kind",
    [
        (["a", "c"], [], 3, None, EventKind.LEAVE, ("a", "c"), (), ("b",), (), EventKind.LEAVE),
        (["b", "c"], [], 3, None, EventKind.LEAVE, ("b", "c"), (), ("a",), (), EventKind.LEAVE),
        (["a", "b", "c"], [(4, "d"), (5, "e")], 5, None, EventKind.JOIN, ("a", "b", "c", "d", "e"), ("d", "e"), (), (), EventKind.JOIN),
        (["a", "b"], [(4, "d")], 4, None, EventKind.LEAVE, ("a", "b", "d"), ("d",), ("c",), (), EventKind.LEAVE),
        (["a", "c"], [], 3, None, EventKind.CRASH, ("a", "c"), (), (), ("b",), EventKind.CRASH),
        (["a", "b", "c"], [(4, "d"), (5, "e")], 5, 4, EventKind.JOIN, ("a", "b", "c", "d"), ("d",), (), (), EventKind.JOIN),
        (["a", "b", "c"], [], 6, None, EventKind.JOIN, ("a", "b", "c"), (), (), (), EventKind.JOIN),
    ],
)
def test_next_generation_keeps_survivor_order_and_appends_joiners(
    survivors, queue, upto, cap, kind, members, joined, left, lost, gen_kind
):
    p = propose(G2, survivors, queue, upto, cap, kind, now=1.0)
    assert (p.generation, p.members, p.joined, p.left, p.lost, p.kind) == (3, members, joined, left, lost, gen_kind)
    if cap is not None:
        assert p.join_upto == 4  # "e" stays queued
    else:
        assert p.join_upto == upto


def test_plan_survives_json():
    p = propose(None, [], [(1, "x"), (2, "y")], 2, None, EventKind.START, now=5.0)
    assert Plan.from_json(p.to_json()) == p and p.members == ("x", "y") and p.generation == 0


@pytest.mark.parametrize(
    "alive,dead,silent,verdict",
    [
        (True, False, 0.0, Verdict.SURVIVOR),
        (False, True, 0.0, Verdict.GONE),
        (True, True, 0.0, Verdict.GONE),
        (False, False, 2.9, Verdict.UNKNOWN),
        (False, False, 3.0, Verdict.GONE),
        (True, False, 99.0, Verdict.SURVIVOR),
    ],
)
def test_roll_call(alive, dead, silent, verdict):
    assert roll_call(alive, dead, silent, hang_timeout_s=3.0) is verdict


@pytest.mark.parametrize(
    "reports,transfer",
    [
        ([(True, 5), (True, 5)], Transfer(0, False, False)),
        ([(True, 5), (True, 5), (False, 0)], Transfer(0, True, False)),
        ([(True, 5), (True, 6), (True, 6)], Transfer(1, True, False)),  # a step only some committed
        ([(False, 0), (True, 9)], Transfer(1, True, False)),
        ([(False, 0), (False, 0)], Transfer(0, True, True)),  # nobody holds state: restore
    ],
)
def test_state_source_is_the_lowest_rank_with_the_newest_step(reports, transfer):
    assert choose_source(reports) == transfer


@pytest.mark.parametrize(
    "reports,need",
    [
        ([(True, 5), (True, 5)], []),  # nothing to agree on
        ([(True, 5), (True, 5), (True, 5), (False, 0)], [3]),  # a join: only the joiner receives
        ([(True, 5), (True, 6), (True, 6), (False, 0)], [0, 3]),  # a rank that missed a commit, and a joiner
        ([(False, 0), (True, 9), (False, 0)], [0, 2]),
        ([(False, 0), (False, 0), (False, 0)], [1, 2]),  # a restore: every rank but the reader
    ],
)
def test_only_the_ranks_without_the_sources_state_receive_it(reports, need):
    assert receivers(reports, choose_source(reports)) == need


def test_state_pack_round_trips_model_optimizer_and_rng():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    header, flat = st.pack(st.capture(model, opt, {"step": 3, "epoch": 1, "position": 8, "generation": 2}))
    assert isinstance(header, bytes) and header.startswith(b"{")  # JSON, not pickle

    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    progress = st.apply(st.unpack(header, flat), other, other_opt)
    assert progress["step"] == 3
    assert st.fingerprint(other, other_opt) == st.fingerprint(model, opt)
    assert torch.equal(torch.get_rng_state(), st.rng_state()["torch"])


def test_state_pack_copies_a_part_first_and_says_so_before_the_rest():
    """pack(first=, then=): the optimizer's tensors are in the buffer when `then` runs and
    the model's are not yet; the result is the same bytes as without."""
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 64)).sum().backward()
    opt.step()
    state = st.capture(model, opt, {"step": 1})
    plain = st.pack(state)
    seen = {}

    def then() -> None:  # the optimizer's part is copied: mutate the model to see it is copied after
        seen["called"] = True
        with torch.no_grad():
            model.weight.add_(1.0)
        for v in opt.state.values():
            v["exp_avg"].add_(1.0)  # copied already: the packed bytes keep the old values

    header, flat = st.pack(state, first=state["optimizer"], then=then)
    assert seen == {"called": True}
    got = st.unpack(header, flat)
    want = st.unpack(*plain)
    for k in ("weight", "bias"):
        assert torch.equal(got["model"][k], want["model"][k] + (1.0 if k == "weight" else 0.0))
    for i, s in want["optimizer"]["state"].items():
        assert torch.equal(got["optimizer"]["state"][i]["exp_avg"], s["exp_avg"])


BASE = {"ELTCTL_STORE": "127.0.0.1:29400", "ELTCTL_JOB": "j", "ELTCTL_WORKER_ID": "h/gpu0/1"}


def test_config_from_env_defaults():
    c = RuntimeConfig.from_env(BASE)
    assert (c.store_host, c.store_port, c.hang_timeout_s, c.audit_path, c.max_workers) == ("127.0.0.1", 29400, 10.0, None, None)


@pytest.mark.parametrize(
    "extra",
    [
        {"ELTCTL_STORE": "nohost"},
        {"ELTCTL_JOB": ""},
        {"ELTCTL_HANG_TIMEOUT": "31"},
        {"ELTCTL_HANG_TIMEOUT": "soon"},
        {"ELTCTL_DEVICE": "tpu"},
        {"ELTCTL_MIN_WORKERS": "3", "ELTCTL_MAX_WORKERS": "2"},
    ],
)
def test_config_rejects_bad_values_naming_the_variable(extra):
    with pytest.raises(ConfigError) as e:
        RuntimeConfig.from_env({**BASE, **extra})
    assert list(extra)[0] in str(e.value) or "ELTCTL_" in str(e.value)


@pytest.mark.parametrize("numels, per_bucket, offsets, buckets", [
    # reverse parameter order; a bucket closes once it holds at least per_bucket elements
    ([10, 20, 30], 25, [(50, 10), (30, 20), (0, 30)], [(0, 30, (2,)), (30, 60, (1, 0))]),
    ([10, 20, 30], 1000, [(50, 10), (30, 20), (0, 30)], [(0, 60, (2, 1, 0))]),  # one bucket
    ([5, 5, 5, 5], 10, [(15, 5), (10, 5), (5, 5), (0, 5)], [(0, 10, (3, 2)), (10, 20, (1, 0))]),
    ([7], 1, [(0, 7)], [(0, 7, (0,))]),
    ([], 4, [], [(0, 0, ())]),
])
def test_bucket_layout(numels, per_bucket, offsets, buckets):
    got_offsets, got_buckets = bucket_layout(numels, per_bucket)
    assert got_offsets == offsets and got_buckets == buckets
    # every gradient lies inside exactly one bucket, and the buckets tile the buffer
    assert [b[0] for b in got_buckets[1:]] == [b[1] for b in got_buckets[:-1]]
    for start, end, members in got_buckets:
        assert all(start <= offsets[i][0] and offsets[i][0] + offsets[i][1] <= end for i in members)

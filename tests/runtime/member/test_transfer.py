"""How members move bytes and state to each other (member/transfer.py), on a real gloo
group of three ranks (threads), and the member's pure pieces beside it: the host of a
worker id and the shape of a generation's event."""

from __future__ import annotations

import torch
import torch.distributed as dist

from eltctl_runtime.member import transfer
from eltctl_runtime.member.plan import Plan, host_of
from eltctl_runtime.member.report import generation_event
from eltctl_runtime.protocol import EventKind
from eltctl_runtime.train import state as state_mod
from runtime_cluster import gloo_group as group, run_threads


def on_three_ranks(name: str, fn) -> dict[int, object]:
    store = dist.HashStore()
    out = run_threads({f"r{r}": (lambda r=r: fn(group(store, name, r, 3), r)) for r in range(3)})
    return {int(k[1:]): v for k, v in out.items()}


def test_the_holders_are_gathered_and_the_newest_one_is_the_source():
    holdings = {0: (False, 0), 1: (True, 7), 2: (True, 9)}

    def rank(pg, r):
        has, step = holdings[r]
        rows = transfer.gather_holdings(pg, has, step, [10 + r], None)
        return rows, transfer.choose(rows)

    out = on_three_ranks("hold", rank)
    rows, (reports, source) = out[0]
    assert rows == [(0, 0, 10), (1, 7, 11), (1, 9, 12)]
    assert reports == [(False, 0), (True, 7), (True, 9)]
    assert (source.needed, source.source, source.restore) == (True, 2, False)
    assert all(v == out[0] for v in out.values())  # every rank decides alike


def test_bytes_json_and_an_empty_value_reach_every_rank_from_the_source():
    blob = bytes(range(256)) * 3

    def rank(pg, r):
        got = transfer.broadcast_bytes(pg, blob if r == 1 else None, 1, r, None, meta=[5, -2])
        empty = transfer.broadcast_bytes(pg, b"" if r == 0 else None, 0, r, None, meta=[4])
        told = transfer.broadcast_json(pg, {"path": "/c/step-3", "n": [1, 2]} if r == 2 else None, 2, r, None)
        return got, empty, told

    for got, empty, told in on_three_ranks("bytes", rank).values():
        assert got == (blob, [5, -2])
        assert empty == (b"", [4])
        assert told == {"path": "/c/step-3", "n": [1, 2]}


def test_a_packed_state_goes_only_to_the_ranks_that_need_it():
    saved = {"w": torch.arange(6, dtype=torch.float64).reshape(2, 3), "step": 4}

    def rank(pg, r):
        one = transfer.send_packed(pg, state_mod.pack(saved) if r == 0 else None, 0, r, [2], None)  # sent to 2 alone
        both = transfer.send_packed(pg, state_mod.pack(saved) if r == 0 else None, 0, r, [1, 2], None)  # a broadcast
        return [None if got is None else state_mod.unpack(*got) for got in (one, both)]

    out = on_three_ranks("packed", rank)
    assert out[0] == [None, None] and out[1][0] is None  # the source and a holder unpack nothing
    for got in (out[2][0], out[1][1], out[2][1]):
        assert got["step"] == 4 and torch.equal(got["w"], saved["w"])


def test_the_host_of_a_worker_id_is_its_first_part():
    assert host_of("gpu-3/1/4242") == "gpu-3"
    assert host_of("solo") == "solo"


def test_a_generations_event_names_its_plan_then_the_callers_fields():
    plan = Plan(generation=4, members=("a/0/1", "b/0/2"), joined=("b/0/2",), left=("c/0/3",),
                kind=EventKind.JOIN)
    ev = generation_event(EventKind.RESTORE, plan, from_step=9, pause_s=None)
    assert ev == {"kind": "restore", "generation": 4, "world_size": 2, "members": ["a/0/1", "b/0/2"],
                  "joined": ["b/0/2"], "left": ["c/0/3"], "lost": [], "from_step": 9, "pause_s": None}
    assert list(ev)[:2] == ["kind", "generation"]

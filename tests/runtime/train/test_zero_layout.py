"""Sharded optimizer state's layout (train/zero/layout.py): pure, tested as tables."""

from __future__ import annotations

import math

import pytest

from zero_ranks import F32, F64, members

from eltctl_runtime.train.zero import PAD_MIN_QUANTA, PAD_QUANTUM, ShardLayout, plan_shards


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

"""The control tail (tail.py): every rank encodes its part, the gradient all-reduce sums
the parts, every rank decodes the same sum with named fields."""

from __future__ import annotations

import pytest
import torch

from eltctl_runtime.train.tail import N_SCALARS, PER_RANK, Control, TailLayout, layout, set_averaging


def part(**kw) -> Control:
    fields = dict(join_ready=False, stop=False, samples=0, loss_sum=0.0, checkpoint=False, leave_ready=False,
                  restore_bad=False, leave=False, pace=0.0, oom=0)
    fields.update(kw)
    return Control(**fields)


def summed(lay: TailLayout, parts: list[Control]) -> torch.Tensor:
    """What the gradient path's all-reduce hands back: the sum of every rank's tail, the
    buffers' updates after it."""
    total = sum(lay.encode(r, c) for r, c in enumerate(parts))
    return torch.cat([total, torch.full((5,), 9.0)])  # the buffers' updates follow the control tail


def test_one_rank_round_trips_every_field():
    lay = layout(1)
    c = part(join_ready=True, stop=True, samples=7, loss_sum=3.25, checkpoint=True, leave_ready=True,
             restore_bad=True, leave=True, pace=0.5, oom=4, averaging=True)
    got = lay.decode(summed(lay, [c]))
    assert got == (1.0, 1.0, 7.0, 3.25, 1.0, 1.0, 1.0, [1.0], [0.5], [4.0], 1.0)
    assert lay.size == N_SCALARS + 3


def test_the_sum_over_ranks_counts_flags_adds_samples_and_keeps_each_ranks_own_slots():
    lay = layout(3)
    parts = [part(join_ready=True, samples=5, loss_sum=1.5, pace=0.25, leave_ready=True),
             part(join_ready=True, samples=4, loss_sum=2.0, pace=0.125, leave=True, checkpoint=True),
             part(samples=0, stop=True, oom=3, restore_bad=True)]
    got = lay.decode(summed(lay, parts))
    assert got.join_ready == 2.0 and got.leave_ready == 1.0  # ranks ready (a join needs all 3)
    assert got.stop == 1.0 and got.checkpoint == 1.0 and got.restore_bad == 1.0
    assert got.samples == 9.0 and got.loss_sum == 3.5
    assert got.leave == [0.0, 1.0, 0.0]  # rank 1 leaves
    assert got.pace == [0.25, 0.125, 0.0]  # rank 2 unmeasured
    assert got.oom == [0.0, 0.0, 3.0]  # rank 2 redoes the step in micro-batches of 3


def test_encode_is_float32_and_writes_only_this_ranks_slots():
    lay = layout(4)
    t = lay.encode(2, part(leave=True, pace=0.75, oom=2))
    assert t.dtype == torch.float32 and t.numel() == lay.size == N_SCALARS + 12
    nonzero = {i: float(t[i]) for i in range(lay.size) if t[i] != 0}
    assert nonzero == {N_SCALARS + 2: 1.0, N_SCALARS + 4 + 2: 0.75, N_SCALARS + 8 + 2: 2.0}


def test_the_averaging_field_is_zero_by_default_and_sums_to_zero_only_when_every_rank_is_done():
    """Local steps' overlap (local.py): each rank sets its `averaging` slot in its encoded
    tail while its averaging is on the wire; the sum is 0 (every rank done: the min over the
    ranks of "done") only when no rank set it."""
    lay = layout(3)
    parts = [lay.encode(r, part(samples=r)) for r in range(3)]
    assert sum(parts)[7] == 0.0 and lay.decode(sum(parts)).averaging == 0.0  # the default: nothing in flight
    set_averaging(parts[1], True)
    assert lay.decode(sum(parts)).averaging == 1.0 and lay.decode(sum(parts)).samples == 3.0
    set_averaging(parts[1], False)
    assert lay.decode(sum(parts)).averaging == 0.0


def test_the_loss_sum_rides_as_float32_as_the_tail_always_carried_it():
    lay = layout(1)
    got = lay.decode(lay.encode(0, part(samples=3, loss_sum=0.1)))
    assert got.loss_sum == float(torch.tensor(0.1, dtype=torch.float32))


def test_a_layout_is_computed_once_per_world_size_and_needs_a_rank():
    assert layout(2) is layout(2) and layout(2) is not layout(3)
    with pytest.raises(ValueError, match="at least 1"):
        TailLayout(0)


@pytest.mark.parametrize("name", Control._fields)
def test_every_field_of_control_rides_alone_under_its_own_name(name):
    """The tail is `Control`: each field, set alone, fills its own slot (its rank's slot
    for a per-rank field) and comes back by the same name; every other field reads 0. So a
    field added to Control is carried without touching encode or decode."""
    lay = layout(3)
    value = 2.0 if isinstance(Control._field_defaults[name], (int, float)) and \
        not isinstance(Control._field_defaults[name], bool) else True
    t = lay.encode(1, Control(**{name: value}))
    assert int((t != 0).sum()) == 1
    got = lay.decode(t)
    assert got._fields == Control._fields
    for other in Control._fields:
        want = float(value) if other == name else 0.0
        if other in PER_RANK:
            assert getattr(got, other) == [0.0, want, 0.0], other
        else:
            assert getattr(got, other) == want, other
    assert lay.size == len(Control._fields) - len(PER_RANK) + len(PER_RANK) * 3

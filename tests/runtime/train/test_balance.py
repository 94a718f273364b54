"""Speed-proportional shares: the pure planning (table tests) and real runs
whose workers are slowed per sample in known ratios (gloo on loopback)."""

from __future__ import annotations

import json
import random

import pytest

from eltctl_runtime import ConfigError, RuntimeConfig, SamplerState, read_status
from eltctl_runtime.train.balance import DEAD_BAND, EMA_ALPHA, Pace, Split, known_paces, predicted_step_s, relative_speed, speedup_without, worker_report
from eltctl_runtime.protocol import WORKER_FIELDS
from eltctl_runtime.train.sampler import counts_bounds, proportional_counts
from runtime_cluster import SMALL, assert_exactly_once, assert_identical_state

N_SAMPLES = int(SMALL[SMALL.index("--samples") + 1])
BATCH = int(SMALL[SMALL.index("--batch") + 1])

# -- pure ----------------------------------------------------------------------


@pytest.mark.parametrize("total,weights,counts", [
    (24, [1, 1, 1], [8, 8, 8]),
    (24, [3, 3, 1], [11, 10, 3]),          # 3.67, 3.33, 3 s beat 10, 10, 4's 3.33, 3.33, 4 s
    (42, [3, 3, 1], [18, 18, 6]),
    (10, [1, 1, 1], [4, 3, 3]),            # the leftover goes to the lower rank
    (24, [1000, 1, 1], [22, 1, 1]),        # a very slow rank keeps one sample: it stays measured
    (2, [1, 1, 1], [1, 1, 0]),             # fewer samples than ranks: the equal split
    (0, [1, 2], [0, 0]),
    (7, [0.5], [7]),
])
def test_proportional_counts(total, weights, counts):
    assert proportional_counts(total, weights) == counts


@pytest.mark.parametrize("weights", [[], [1, 0], [1, -1], [1, float("nan")], [float("inf"), 1]])
def test_proportional_counts_refuses_weights_that_are_not_speeds(weights):
    with pytest.raises(ValueError):
        proportional_counts(10, weights)


def test_proportional_counts_sum_to_the_total_are_near_proportional_and_no_move_shortens_the_step():
    rng = random.Random(3)
    for _ in range(500):
        n = rng.randint(1, 9)
        weights = [rng.uniform(0.01, 10) for _ in range(n)]
        total = rng.randint(n, 300)
        counts = proportional_counts(total, weights)
        assert sum(counts) == total and min(counts) >= 1
        free = total - n
        for c, w in zip(counts, weights):  # the minimum taken out, then proportional
            assert free * w / sum(weights) - 1 < c < total * w / sum(weights) + 2
        times = [c / w for c, w in zip(counts, weights)]
        slow = max(range(n), key=times.__getitem__)
        if counts[slow] > 1:
            for r in range(n):
                if r != slow:
                    assert (counts[r] + 1) / weights[r] >= times[slow] - 1e-12


def test_any_sequence_of_world_sizes_and_speeds_consumes_each_epoch_exactly_once():
    rng = random.Random(11)
    s = SamplerState(n_samples=103, global_batch=16, seed=1)
    seen: dict[int, list[int]] = {}
    while s.epoch < 3:
        world = rng.randint(1, 9)
        weights = [rng.uniform(0.1, 5) for _ in range(world)]
        taken = [i for r in range(world) for i in s.local_indices(r, world, weights)]
        assert taken == s.global_indices()
        counts = s.share_counts(world, weights)
        assert [counts_bounds(counts, r)[1] - counts_bounds(counts, r)[0] for r in range(world)] == counts
        seen.setdefault(s.epoch, []).extend(taken)
        s = s.advanced()
    assert all(sorted(v) == list(range(103)) for v in seen.values())


def test_pace_is_a_moving_average_of_seconds_per_sample():
    p = Pace().observed(1.0, 10)
    assert p.seconds_per_sample == pytest.approx(0.1)
    assert p.observed(1.3, 10).seconds_per_sample == pytest.approx(0.1 + EMA_ALPHA * 0.03)
    assert p.observed(1.0, 0) == p  # a step with no samples tells nothing


def test_one_jump_is_a_hiccup_two_in_a_row_are_a_new_speed():
    p = Pace(0.1)
    hiccup = p.observed(2.0, 10)  # 0.2 s a sample: more than JUMP away
    assert hiccup.seconds_per_sample == 0.1 and hiccup.jump == pytest.approx(0.2)
    assert hiccup.observed(1.0, 10) == Pace(0.1)  # back to normal: the hiccup is forgotten
    assert hiccup.observed(4.0, 10) == Pace(0.4)  # slower again: the speed changed, taken whole
    assert hiccup.observed(0.4, 10).jump == pytest.approx(0.04)  # a jump the other way starts over
    assert Pace().slot == 0.0 and p.slot == pytest.approx(0.1)


def test_unmeasured_ranks_count_as_the_mean_of_the_measured():
    assert known_paces([0.0, 0.0]) is None
    assert known_paces([0.1, 0.0, 0.3]) == pytest.approx([0.1, 0.2, 0.3])


@pytest.mark.parametrize("current,slots,total,expect", [
    (Split(), [0.01, 0.01, 0.03], 24, (11, 10, 3)),           # 1 : 1 : 1/3 from equal shares
    (Split(), [0.01, 0.0101, 0.0099], 24, (8, 8, 8)),         # alike: stays equal
    (Split((100.0, 100.0, 100 / 3)), [0.01, 0.0101, 0.03], 24, (11, 10, 3)),  # noise that moves no sample
    (Split((1.0, 1.0, 1.0)), [0.01, 0.01, 0.0104], 240, (80, 80, 80)),  # 81, 81, 78 gains 2 %: dead band
    (Split((1.0, 1.0, 1.0)), [0.01, 0.01, 0.0110], 240, (83, 82, 75)),  # gains 6 %: re-planned
    (Split((100.0, 100.0, 100 / 3)), [0.01, 0.01, 0.0025], 24, (4, 4, 16)),  # the slow one got 4x faster
    (Split((1.0, 1.0)), [0.01, 0.01, 0.01], 24, (8, 8, 8)),  # a resize: the old weights do not fit
    (Split(), [0.0, 0.0], 24, (12, 12)),                       # nothing measured yet
])
def test_split_is_replanned_only_when_it_shortens_the_step_beyond_the_dead_band(current, slots, total, expect):
    new = current.replanned(slots, total)
    assert tuple(new.counts(total, len(slots))) == expect
    if new.weights != current.weights:
        paces = known_paces(slots)
        before = predicted_step_s(current.counts(total, len(slots)), paces)
        assert predicted_step_s(new.counts(total, len(slots)), paces) < (1 - DEAD_BAND) * before


def test_split_is_looked_at_again_only_when_a_pace_moved_beyond_the_pace_band():
    planned = Split().replanned([0.01, 0.01, 0.03], 24)
    assert planned.counts(24, 3) == [11, 10, 3] and planned.basis == (0.01, 0.01, 0.03)
    # Rank 0 measured 12 % slower: 10, 11, 3 would be better, but that is noise.
    assert planned.replanned([0.0112, 0.01, 0.03], 24) is planned
    # Rank 2 slowed down 4x: far beyond the band, re-planned.
    slowed = planned.replanned([0.01, 0.01, 0.12], 24)
    assert slowed.counts(24, 3) == [12, 11, 1] and slowed.basis == (0.01, 0.01, 0.12)
    # Moved beyond the band but no better split: the shares stay, the basis moves.
    same = planned.replanned([0.01, 0.01, 0.0345], 24)
    assert same.weights == planned.weights and same.basis == (0.01, 0.01, 0.0345)
    # A resize: the basis of another world size does not hold.
    assert Split(None, (0.01, 0.01)).replanned([0.01, 0.01, 0.03], 24).counts(24, 3) == [11, 10, 3]


def test_a_worker_that_holds_the_job_back_is_a_straggler():
    # 24 samples; the third rank needs 1 s a sample: even its minimum share of
    # one sample takes longer than the others' whole step.
    slots = [0.01, 0.01, 1.0]
    assert speedup_without(slots, 24, 2) > 1.0
    assert speedup_without(slots, 24, 0) == 1.0  # c sets the pace either way
    assert speedup_without([0.01, 0.01, 0.03], 24, 2) < 1.0
    assert relative_speed(slots, 2) == pytest.approx(0.01)
    report = worker_report(["a", "b", "c"], [22, 1, 1], slots, 24)
    assert list(report["a"]) == list(WORKER_FIELDS)
    assert report["c"]["straggler"] and not report["a"]["straggler"]
    assert report["a"]["samples_per_s"] == 100.0 and report["c"]["share"] == 1
    # 3x slower is no straggler: it adds its speed to the job's.
    assert not any(r["straggler"] for r in worker_report(["a", "b", "c"], [11, 10, 3], [0.01, 0.01, 0.03],
                                                         24).values())


def test_max_micro_batch_comes_from_the_environment():
    env = {"ELTCTL_STORE": "h:1", "ELTCTL_JOB": "j", "ELTCTL_WORKER_ID": "w"}
    assert RuntimeConfig.from_env(env).max_micro_batch is None
    assert RuntimeConfig.from_env({**env, "ELTCTL_MAX_MICRO_BATCH": "6"}).max_micro_batch == 6
    with pytest.raises(ConfigError, match="ELTCTL_MAX_MICRO_BATCH"):
        RuntimeConfig.from_env({**env, "ELTCTL_MAX_MICRO_BATCH": "0"})


# -- real runs -------------------------------------------------------------------


def splits(audit) -> dict[int, tuple[int, dict[str, int]]]:
    """step -> (generation, {worker: its share}) of the commit that stands (the newest generation's)."""
    recs: dict[int, dict[int, list[dict]]] = {}
    for line in audit.read_text().splitlines():
        r = json.loads(line)
        recs.setdefault(r["step"], {}).setdefault(r["generation"], []).append(r)
    out = {}
    for step, gens in recs.items():
        g = max(gens)
        out[step] = (g, {r["worker"]: r["split"][r["rank"]] for r in gens[g]})
    return out


def finish(cluster, members: list, steps: int | None = None) -> list[dict]:
    if steps is None:
        cluster.stop()
    cluster.wait_exit(members)
    assert all(w.proc.returncode == 0 for w in members), cluster.dump_logs()
    results = [r for r in (w.read_result() for w in members) if r and not r["left"]]
    assert_identical_state(results)
    assert_exactly_once(cluster.audit, N_SAMPLES, BATCH, results[0]["step"])
    return results


@pytest.mark.slow
def test_shares_follow_speeds_in_known_ratios_and_follow_a_change_mid_run(cluster_factory):
    # a and b compute 3 ms a sample, c 9 ms (1 : 1 : 1/3): balanced shares of
    # 24 are 11, 10, 3 (10, 10, 4 as the measured compute adds to the sleep).
    # From step 25, c computes 1 ms a sample: 3x faster than the others, it
    # takes the largest share.
    c = cluster_factory(min_workers=3)
    run = ["--steps", "50"]
    a, b = c.start(2, run + ["--slow-per-sample", "0.003"])
    (s,) = c.start(1, run + ["--slow-per-sample", "0.009", "--slow-at", "25=0.001"])
    finish(c, [a, b, s], 50)
    by_step = {k: [shares[w.id] for w in (a, b, s)] for k, (_g, shares) in splits(c.audit).items()}
    assert by_step[1] == [8, 8, 8], "the first step of a generation splits equally"
    # Balanced from some step on (by step 12 on a quiet machine; a loaded one measures noisier
    # paces, and a split is adopted once proposed at CONFIRM_COMMITS commits in a row: a CI
    # run under load adopted it at step 16), and it stays balanced up to the change at 25.
    def balanced(x: list[int]) -> bool:
        return 9 <= x[0] <= 12 and 9 <= x[1] <= 12 and 2 <= x[2] <= 5

    first = next((k for k in range(2, 25) if balanced(by_step[k])), None)
    settled = [by_step[k] for k in range(first or 2, 25)]
    assert first is not None and first <= 20 and all(balanced(x) for x in settled), [by_step[k] for k in range(2, 25)]
    after = [by_step[k] for k in range(45, 51)]
    assert all(x[2] > x[0] + 4 and x[2] > x[1] + 4 for x in after), after
    # rank 0's status document: each worker's share and speed at the last step.
    workers = read_status(c.store, c.job)["workers"]
    assert [workers[w.id]["share"] for w in (a, b, s)] == by_step[50]
    assert workers[s.id]["samples_per_s"] > 1.5 * workers[a.id]["samples_per_s"], workers


@pytest.mark.slow
def test_balanced_shares_through_resizes_stay_exactly_once_and_identical(cluster_factory):
    # Three workers at 1 : 1 : 1/3; the slow one leaves (3 -> 2), a newcomer
    # slower still joins (2 -> 3): the split is re-planned in every generation,
    # the data is exactly-once and the ranks agree bit for bit. The newcomer catches
    # up in the background (catchup.py): until it holds the state it trains on
    # nothing and the others split each step equally; how many steps that takes is
    # the machine's (the transfer's, the replay's), the rest is not.
    c = cluster_factory(min_workers=3)
    forever = ["--steps", "100000", "--step-sleep", "0.01"]
    a, b = c.start(2, forever + ["--slow-per-sample", "0.002"])
    (s,) = c.start(1, forever + ["--slow-per-sample", "0.006"])
    g = c.wait_world(3, steps_after=8)
    c.leave(s)
    g = c.wait_world(2, min_gen=g + 1, steps_after=4)
    (d,) = c.start(1, forever + ["--slow-per-sample", "0.012"])
    c.wait_world(3, min_gen=g + 1, steps_after=10)
    finish(c, [a, b, s, d])
    by_gen: dict[int, list[dict[str, int]]] = {}
    for _step, (gen, shares) in sorted(splits(c.audit).items()):
        by_gen.setdefault(gen, []).append(shares)
    wide = {gen: v for gen, v in by_gen.items() if len(v[0]) == 3}
    assert len(wide) >= 2, by_gen
    for gen, shares in wide.items():  # each 3-wide generation starts equal, ends with the slow one on less
        slow = s.id if s.id in shares[0] else d.id
        trains = next((i for i, x in enumerate(shares) if min(x.values()) > 0), None)  # every rank has a share
        assert trains is not None, (gen, shares)
        assert all(x[slow] == 0 and sorted(x.values()) == [0, 12, 12] for x in shares[:trains]), (gen, shares)
        assert trains == 0 or slow == d.id, (gen, shares)  # only the newcomer catches up
        assert sorted(shares[trains].values()) == [8, 8, 8], (gen, shares)
        assert shares[-1][slow] < min(shares[-1][a.id], shares[-1][b.id]) - 2, (gen, shares)


@pytest.mark.slow
def test_a_hosts_micro_batch_limit_and_an_out_of_memory_share_train_like_whole_shares(cluster_factory):
    # Equal shares of 12. In the second run, a's host computes at most 5
    # samples at once (micro-batches 5, 5, 2) and b runs out of memory once on
    # its share: every rank redoes that step, b in micro-batches of 6 from then
    # on. The data, the agreement and the training are as in the first run.
    whole = cluster_factory(min_workers=2)
    ref = finish(whole, whole.start(2, ["--steps", "12", "--no-balance"]), 12)[0]
    limited = cluster_factory(min_workers=2)
    (a,) = limited.start(1, ["--steps", "12", "--no-balance"], env={"ELTCTL_MAX_MICRO_BATCH": "5"})
    (b,) = limited.start(1, ["--steps", "12", "--no-balance", "--oom-once-above", "8"])
    got = finish(limited, [a, b], 12)[0]
    assert abs(got["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (got, ref)
    assert "at most 5 samples at once on this host" in a.log_text()
    assert "out of memory on 12 samples at step 1; the step is redone in micro-batches of at most 6" in b.log_text()
    assert "step 1 redone (out of memory on rank(s)" in a.log_text()


@pytest.mark.slow
def test_zero2_reducing_each_micro_batch_through_a_hosts_limit_and_an_out_of_memory_redo(cluster_factory):
    """As above with shard="gradients", reduce_each_micro_batch=True: a's host computes at
    most 5 samples (micro-batches 5, 5, 2), b's 10 (10, 2), and b runs out of memory in its
    first micro-batch, one reduced on its own (a round), then redoes the step in
    micro-batches of 5 (5, 5, 2); the missing rounds are reduced empty. The training is
    that of whole shares."""
    args = ["--steps", "12", "--no-balance", "--shard", "gradients", "--optimizer", "adamw"]
    whole = cluster_factory(min_workers=2)
    ref = finish(whole, whole.start(2, args), 12)[0]
    limited = cluster_factory(min_workers=2)
    each = args + ["--reduce-each-micro-batch"]
    (a,) = limited.start(1, each, env={"ELTCTL_MAX_MICRO_BATCH": "5"})
    (b,) = limited.start(1, each + ["--oom-once-above", "8"], env={"ELTCTL_MAX_MICRO_BATCH": "10"})
    got = finish(limited, [a, b], 12)[0]
    assert abs(got["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (got, ref)
    assert "out of memory on 10 samples at step 1; the step is redone in micro-batches of at most 5" in b.log_text()
    assert "step 1 redone (out of memory on rank(s)" in a.log_text()


@pytest.mark.slow
def test_a_worker_that_holds_the_job_back_is_reported_a_straggler_in_the_status(cluster_factory):
    # s computes 100 ms a sample, a and b 1 ms: even s's minimum share of one
    # sample takes longer than the others' whole step.
    c = cluster_factory(min_workers=3)
    a, b = c.start(2, ["--steps", "12", "--slow-per-sample", "0.001"])
    (s,) = c.start(1, ["--steps", "12", "--slow-per-sample", "0.1"])
    finish(c, [a, b, s], 12)
    workers = read_status(c.store, c.job)["workers"]
    assert workers[s.id]["share"] == 1 and workers[s.id]["straggler"], workers
    assert workers[s.id]["speedup_without"] > 2 and workers[s.id]["relative_speed"] < 0.1, workers
    assert not workers[a.id]["straggler"] and not workers[b.id]["straggler"], workers


def test_a_balanced_split_keeps_batchnorm_ranks_at_two_samples_or_more():
    from eltctl_runtime.train.balance import Split

    slots = [0.001, 0.001, 0.05]  # the third rank is 50x slower
    assert Split().replanned(slots, 24).counts(24, 3)[2] == 1
    assert Split(minimum=2).replanned(slots, 24).counts(24, 3)[2] == 2
    assert sum(Split(minimum=2).replanned(slots, 24).counts(24, 3)) == 24

"""The benchmarks' pure figures: the steady step at each world size and what an event cost.

Pure functions over step records and worker logs (no processes): the resize and sharded
benchmarks compare eltctl's events against torchrun's, and one tree against another, with them."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_baselines.py"


def _loaded(file: str):
    """A benchmark module loaded from benchmarks/ (not a package) under a name of its own,
    with benchmarks/ on sys.path for the helpers it imports beside it; undone after."""
    name = f"_bench_{file[:-3].lstrip('_')}_under_test"
    spec = importlib.util.spec_from_file_location(name, _PATH.parent / file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is made
    saved = list(sys.path)
    sys.path.insert(0, str(_PATH.parent))
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(name, None)
        sys.path[:] = saved


@pytest.fixture(scope="module")
def baselines():
    yield from _loaded("_baselines.py")


def test_the_steady_step_leaves_out_each_generations_first_interval_and_the_gaps_between_them(baselines):
    recs = []
    # generation 1 at world 2: steps 0..4 a second apart, but its first interval is slow (3 s)
    for step, t in zip(range(5), (0.0, 3.0, 4.0, 5.0, 6.0)):
        recs += [(1, step, 2, t), (1, step, 2, t + 0.05)]  # two workers: the earliest counts
    # generation 2 at world 1, 30 s later, redoing steps 3..6 two seconds apart (first interval 9 s)
    for step, t in zip(range(3, 8), (36.0, 45.0, 47.0, 49.0, 51.0)):
        recs.append((2, step, 1, t))
    # generation 3 at world 2 with a single interval: all warm-up, nothing measured
    recs += [(3, 8, 2, 60.0), (3, 9, 2, 70.0)]
    assert baselines.step_s_by_world(recs) == {1: 2.0, 2: 1.0}
    with_warmup = baselines.step_s_by_world(recs, skip=0)
    assert with_warmup[2] == 1.0 and with_warmup[1] == 2.0  # medians: the slow first intervals are outliers


def test_an_interval_across_a_world_change_or_a_missing_step_is_not_a_step(baselines):
    # one run whose world changes in place (a worker generation never does, a torchrun pid neither,
    # but the figure must not mix sizes) and which skips step 3
    recs = [("a", 0, 2, 0.0), ("a", 1, 2, 1.0), ("a", 2, 2, 2.0), ("a", 4, 2, 10.0), ("a", 5, 3, 11.5),
            ("a", 6, 3, 13.0), ("a", 7, 3, 14.5)]
    assert baselines.step_s_by_world(recs) == {2: 1.0, 3: 1.5}


def test_time_lost_is_the_pause_less_one_step_plus_the_steps_redone(baselines):
    assert baselines.time_lost(3.0, 0, 1.0) == 2.0  # nothing redone: the first step was due anyway
    assert baselines.time_lost(3.0, 2, 1.0) == 4.0  # two steps done again cost their time
    assert baselines.time_lost(40.0, 5, 1.25) == 45.0
    assert baselines.time_lost(0.5, 0, 1.0) == -0.5  # a first step faster than the steady one: not hidden
    assert baselines.time_lost(None, 0, 1.0) is None
    assert baselines.time_lost(1.0, None, 1.0) is None
    assert baselines.time_lost(1.0, 0, None) is None


@pytest.fixture(scope="module")
def sharded_bench():
    yield from _loaded("sharded.py")


def test_repeated_jobs_give_each_events_median_and_keep_every_sample(sharded_bench):
    def job(pause, lost, redone):
        return [{"event": "join", "pause_s": pause, "lost_s": lost, "steps_lost": redone, "phases": {"w0": []}},
                {"event": "kill", "pause_s": None, "error": "not resumed"}]

    got = sharded_bench._sampled([job(2.0, 1.0, 0), job(9.0, 8.0, 2), job(3.0, None, 0)])
    assert got["pauses_s"] == {"join": 3.0, "kill": None}  # the outlier 9.0 does not move it
    assert got["lost_s"] == {"join": 4.5, "kill": None}  # the median of the two samples that have one
    assert got["steps_redone"] == {"join": 0, "kill": None}
    assert got["samples"] == 3
    assert [s["join"] for s in got["per_sample"]["pauses_s"]] == [2.0, 9.0, 3.0]
    assert got["events"][0]["phases"] == {"w0": []}  # the first job's events whole, the others beside them
    assert [e[0]["pause_s"] for e in got["events_of_later_samples"]] == [9.0, 3.0]


@pytest.fixture(scope="module")
def eltctl_side():
    yield from _loaded("_eltctl_side.py")


def _line(text):
    return f"2026-12-07 16:32:38,191 bench2/cpu/1 INFO worker bench2/cpu/1: {text}"


def test_a_joiner_is_catching_up_from_its_line_until_it_says_it_caught_up(eltctl_side):
    began = _line("catching up at step 19: the state comes from rank 0 in the background")
    done = _line("caught up at step 22; it trains from the next step")
    other = _line("rank 1 of 2 in generation 2 (join) at step 19")
    assert not eltctl_side.catching_up([])
    assert not eltctl_side.catching_up([other])  # a tree without the catch-up never says either
    assert eltctl_side.catching_up([other, began])
    assert not eltctl_side.catching_up([other, began, other, done])
    assert eltctl_side.catching_up([began, done, other, began])  # a second join, not over yet


def test_a_workers_rank_is_its_last_generations(eltctl_side):
    lines = [_line("rank 0 of 2 in generation 0 (start) at step 0"), _line("left the job"),
             _line("rank 1 of 3 in generation 12 (join) at step 40"), _line("event {}")]
    assert eltctl_side.rank_in(lines) == (12, 1)
    assert eltctl_side.rank_in([_line("waiting to be admitted (join #1)")]) is None


@pytest.fixture(scope="module")
def resize_bench():
    yield from _loaded("resize.py")


def test_repeated_event_runs_give_each_pause_its_median_and_the_most_steps_lost(resize_bench):
    def run(leave, join, kill, lost=0):
        return {"events": [{"event": "leave", "pause_s": leave, "runtime_pause_s": leave, "steps_lost": lost},
                           {"event": "join", "pause_s": join, "steps_lost": 0},
                           {"event": "kill", "pause_s": kill, "steps_lost": 0} if kill else
                           {"event": "kill", "resumed": False}]}
    one = run(0.05, 0.08, 0.1)
    assert resize_bench.median_events([one]) is one
    got = resize_bench.median_events([run(0.05, 0.08, 0.1), run(0.09, 0.07, None, lost=1), run(0.06, 0.2, 0.3)])
    by = {e["event"]: e for e in got["events"]}
    assert by["leave"]["pause_s"] == 0.06 and by["leave"]["runtime_pause_s"] == 0.06
    assert by["leave"]["steps_lost"] == 1  # the worst run's, not a median's
    assert by["join"]["pause_s"] == 0.08 and by["join"]["pause_samples"] == [0.08, 0.07, 0.2]
    assert by["kill"]["pause_s"] == 0.2 and by["kill"]["pause_samples"] == [0.1, None, 0.3]
    assert by["join"]["runtime_pause_s"] is None
    assert len(got["runs"]) == 3
    none = resize_bench.median_events([{"error": "timed out", "events": []}, {"events": []}])
    assert all(not e["resumed"] and e["error"] == "timed out" for e in none["events"])

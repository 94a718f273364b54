"""benchmarks/network.py's training part, its pure figures: the corpus of the stdlib's
sources, its windows, the mode table's refusals, utilization and the loss comparison.
No processes, no torch workers (the benchmark itself runs them, as root)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    saved = list(sys.path)  # network.py puts its folder first to import _textlm: not for the other tests
    spec = importlib.util.spec_from_file_location(f"_bench_{name}_under_test", _DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved
    return mod


lm = _load("_textlm")
net = _load("network")


def test_corpus_order_is_sorted_python_sources_without_installed_packages():
    paths = ["json/decoder.py", "abc.py", "site-packages/foo/bar.py", "json/__pycache__/x.py",
             "README.txt", "asyncio/base_events.py", "dist-packages/x.py"]
    assert lm.corpus_order(paths) == ["abc.py", "asyncio/base_events.py", "json/decoder.py"]


def test_concatenate_cuts_at_max_bytes_and_reads_no_further_chunk():
    read = []

    def chunks():
        for c in (b"abc", b"defg", b"hij"):
            read.append(c)
            yield c

    assert lm.concatenate(chunks(), 5) == b"abcde"
    assert read == [b"abc", b"defg"]
    assert lm.concatenate(iter([b"ab"]), 10) == b"ab"
    with pytest.raises(ValueError, match="at least one byte"):
        lm.concatenate(iter([b"ab"]), 0)


def test_build_corpus_is_deterministic_and_reads_files_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "b" / "z.py").write_bytes(b"BZ")
    (tmp_path / "a.py").write_bytes(b"A1")
    (tmp_path / "c.py").write_bytes(b"C123")
    (tmp_path / "site-packages" / "s.py").write_bytes(b"SS")
    (tmp_path / "notes.txt").write_bytes(b"TT")
    assert lm.build_corpus(7, tmp_path) == b"A1BZC12"
    with pytest.raises(ValueError, match="fewer than the 100 asked for"):
        lm.build_corpus(100, tmp_path)


def test_windows_hold_out_one_block_in_every_few_and_never_cross_parts():
    # blocks of 20 bytes; every 3rd (indices 2, 5, ...) held out; the last block is short
    w = lm.Windows(size=130, context=4, stride=2, block=20, heldout_every=3)
    held = {b for b in range(7) if b % 3 == 2}  # bytes 40-59, 100-119
    offs = [w.train_offset(i) for i in range(w.train_samples)]
    # training runs [0, 40), [60, 100), [120, 130): windows of 5 bytes every 2 inside each
    assert offs == [*range(0, 36, 2), *range(60, 96, 2), *range(120, 126, 2)]
    assert all({(o + k) // 20 for k in range(5)}.isdisjoint(held) for o in offs)
    with pytest.raises(IndexError):
        w.train_offset(w.train_samples)
    assert w.heldout_offsets(100) == [40, 44, 48, 52, 100, 104, 108, 112]
    assert w.heldout_offsets(2) == [40, 100]  # spread over the held-out part, not its start
    with pytest.raises(ValueError, match="too small"):
        lm.Windows(size=40, context=4, block=20, heldout_every=3)
    with pytest.raises(ValueError, match="block > context"):
        lm.Windows(size=1000, context=30, block=20)


def test_shapes_parameter_count_matches_the_model():
    torch = pytest.importorskip("torch")
    shape = lm.LMShape(context=4, embed=3, hidden=5, layers=2)
    model = lm.make_model(shape, seed=0)
    assert sum(p.numel() for p in model.parameters()) == shape.parameters
    assert model(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 256)
    assert 45e6 < lm.SHAPES["50m"].parameters < 55e6  # issue 51's ~200 MB of fp32 gradients


def test_halved_needs_the_end_at_most_half_the_start():
    assert lm.halved(5.5, 2.7) is True
    assert lm.halved(5.5, 2.8) is False
    assert lm.halved(None, 2.0) is None
    assert lm.halved(5.5, float("nan")) is None


def test_a_mode_whose_arguments_the_runtime_lacks_is_refused_by_name():
    before = ["model", "optimizer", "dataset", "global_batch_size", "grad_dtype"]
    modes = net.train_modes(8)
    assert modes[net.SYNC] == {}
    assert net.refusal(before, modes[net.SYNC]) is None
    assert net.refusal(before, modes["bf16"]) is None
    why = net.refusal(before, modes["local"])
    assert "'sync'" in why and "'sync_every'" in why
    assert modes["local"]["sync_every"] == 8
    assert net.refusal([*before, "**"], modes["lowrank"]) is None


def test_utilization_is_compute_over_step_time():
    assert net.utilization(10.0, 2.5) == 0.75
    assert net.utilization(10.0, None) is None
    assert net.utilization(10.0, 12.0) == 0.0  # clamped: a wait measured past the window


def _rank(rank, window, wait, tx, job_bytes=None, **kw):
    return {"rank": rank, "steps": 20, "measured_steps": 10, "window_s": window, "wait_s": wait,
            "tx_bytes": tx, "job_bytes": job_bytes, "job_bytes_per_step": 100,
            "start_loss": 5.5 if rank == 0 else None, "end_loss": 3.0 if rank == 0 else None,
            "eval_loss_start": 5.5 if rank == 0 else None, "eval_loss": kw.get("eval_loss"),
            "optimizer_steps": 20 + 10 * rank, "samples_trained": 100 + rank}


def test_summarize_train_per_rank_utilization_and_bytes_per_sample():
    case = net.Case(1000, 0)
    row = net.summarize_train(2, case, "bf16", [_rank(1, 4.0, 3.0, 6400, 3200),
                                                _rank(0, 5.0, 1.0, 3200, 3200, eval_loss=2.5)], 32)
    assert row["utilization_per_rank"] == [0.8, 0.25]  # rank order
    assert row["optimizer_steps_per_rank"] == [20, 30] and row["samples_per_rank"] == [100, 101]
    assert row["utilization"] == 0.525 and row["utilization_min"] == 0.25
    assert row["step_s"] == 0.5  # the slower rank's window over the measured steps
    assert row["wire_bytes_per_sample"] == 15.0  # mean tx 4800 over 10 steps x 32 samples
    assert row["job_bytes_per_sample"] == 10.0
    assert row["samples"] == 640 and row["eval_loss"] == 2.5 and row["halved"] is True
    unmeasured = net.summarize_train(2, case, "x", [_rank(0, 5.0, None, 1, eval_loss=2.0),
                                                    _rank(1, 5.0, 1.0, 1)], 32)
    assert unmeasured["utilization"] is None and unmeasured["job_bytes_per_sample"] is None


def test_losses_compare_with_sync_fp32_on_the_same_world_and_link():
    rows = [{"world": 2, "rate_mbit": 1000, "delay_ms": 0, "mode": m, "eval_loss": v}
            for m, v in (("sync_fp32", 2.0), ("bf16", 2.01), ("local", 1.94))]
    rows.append({"world": 4, "rate_mbit": 1000, "delay_ms": 0, "mode": "bf16", "eval_loss": 2.0})
    out = net.compare_losses(rows)
    assert [r["loss_vs_sync"] for r in out] == [0.0, 0.005, -0.03, None]
    # the matrix part's local jobs train longer than its synchronous ones: no comparison
    rows = [{"world": 2, "rate_mbit": 100, "delay_ms": 5, "mode": m, "eval_loss": 2.0, "steps": n}
            for m, n in (("sync_fp32", 48), ("bf16", 48), ("local_overlap", 288))]
    assert [r["loss_vs_sync"] for r in net.compare_losses(rows)] == [0.0, 0.0, None]


def test_the_outer_sgd_flags_go_to_the_local_mode_only_when_given():
    assert net.outer_sgd(None, None) is None
    assert net.train_modes(16)["local"] == {"sync": "local", "sync_every": 16}
    assert net.outer_sgd(1.0, 0.0) == {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    assert net.outer_sgd(None, 0.5) == {"lr": 0.7, "momentum": 0.5, "nesterov": True}
    modes = net.train_modes(8, net.outer_sgd(1.0, 0.0))
    assert modes["local"]["outer_optimizer"] == {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    assert "outer_optimizer" not in modes["sync_fp32"]
    assert net.refusal(["sync", "sync_every", "outer_optimizer"], modes["local"]) is None


def test_local_inner_takes_the_inner_batch_and_slow_names_a_rank_and_its_seconds_per_sample():
    assert net.train_modes(16, None, 8)["local_inner"] == {"sync": "local", "sync_every": 16, "inner_batch": 8}
    assert net.train_modes(16)["local_bf16"] == {"sync": "local", "sync_every": 16, "grad_dtype": "bf16"}
    assert net.train_modes(16)["local_overlap_bf16"] == {"sync": "local", "sync_every": 16, "sync_overlap": True,
                                                         "grad_dtype": "bf16"}
    assert net.parse_slow(None) == (-1, 0.0)
    assert net.parse_slow("1=0.002") == (1, 0.002)
    for bad in ("1", "x=0.1", "-1=0.1", "1=-0.1", "1=nan"):
        with pytest.raises(ValueError, match=r"--slow takes RANK=SECONDS"):
            net.parse_slow(bad)


def test_the_status_column_says_what_eltctl_status_would_name_as_the_job_s_speed():
    """rank 0's status `network` read through eltctl status's own hint: over half the step
    in the wait names the network; local steps with a small share do not; no figures, n/a."""
    sync = net.status_verdict({"wait_s": 0.3, "compute_s": 0.1, "share": 0.75, "bytes_per_step": 18_000_000})
    local = net.status_verdict({"wait_s": 0.01, "compute_s": 0.1, "share": 0.09, "bytes_per_step": 1_000_000,
                                "mode": "local", "sync_every": 16})
    assert sync == {"status_share": 0.75, "status_names_network": True}
    assert local == {"status_share": 0.09, "status_names_network": False}
    assert net.status_verdict(None) == {"status_share": None, "status_names_network": None}
    assert net._status_cell(sync) == "0.75 network" and net._status_cell(local) == "0.09 compute"
    assert net._status_cell({}) == "n/a"


# --- the matrix part (benchmarks/_matrix.py, _trainrank.py): one job per mode through every link ---

rank_mod, matrix = net._trainrank, net._matrix


class _Timing:
    def __init__(self, wait_s, nbytes):
        self.wait_s, self.bytes = wait_s, nbytes


def test_a_rank_closes_a_window_per_segment_after_its_warm_up():
    segs = rank_mod.Segments([(2, 3), (1, 2)])
    ended = [segs.step(t, 100 * t, _Timing(0.1 * t, 10 * t)) for t in range(1, 9)]
    assert ended == [False, False, False, False, True, False, False, True] and segs.finished
    first, second = segs.done
    # segment 0: the window opens at step 2's end and closes at step 5's: steps 3-5 measured
    assert first["measured_steps"] == 3 and first["window_s"] == 3 and first["tx_bytes"] == 300
    assert first["wait_s"] == pytest.approx(0.3 + 0.4 + 0.5) and first["job_bytes"] == 30 + 40 + 50
    assert first["job_bytes_per_step"] == 50
    # segment 1: opens at step 6's end (its one warm-up step), steps 7-8 measured
    assert second["measured_steps"] == 2 and second["window_s"] == 2 and second["wait_s"] == pytest.approx(1.5)
    unmeasured = rank_mod.Segments([(1, 2)])
    for t in range(1, 4):
        unmeasured.step(t, 0, None)
    assert unmeasured.done[0]["wait_s"] is None and unmeasured.done[0]["job_bytes"] is None


def test_a_job_without_segments_is_one_of_the_warm_up_and_the_rest():
    assert rank_mod.segments_of({"warmup": 5, "steps": 40}) == [(5, 35)]
    assert rank_mod.segments_of({"warmup": 5, "steps": 40, "segments": [[3, 5], [3, 5]]}) == [(3, 5), (3, 5)]


def test_the_matrix_measures_local_steps_over_whole_rounds_and_the_others_after_their_warm_up():
    assert matrix.schedule({}, 3, 8, 3, 16) == [(3, 5)] * 3
    assert matrix.schedule({"grad_dtype": "bf16"}, 2, 10, 2, 16) == [(2, 8)] * 2
    assert matrix.schedule({"sync": "local", "sync_every": 16}, 2, 8, 3, 16) == [(16, 32)] * 2


def test_a_links_row_reads_its_own_segment_and_rank_0s_status_on_that_link():
    seg = {"measured_steps": 5, "window_s": 2.0, "wait_s": 1.0, "tx_bytes": 10, "job_bytes": 8,
           "job_bytes_per_step": 2}
    r0 = {**_rank(0, 9.0, 9.0, 9, eval_loss=2.5), "segments": [{**seg, "status_network": {"share": 0.1}},
                                                                 {**seg, "window_s": 4.0, "status_network": None}]}
    r1 = {**_rank(1, 9.0, 9.0, 9), "segments": [seg, {**seg, "wait_s": 3.0}]}
    first = matrix.segment_records([r0, r1], 0)
    assert first[0]["window_s"] == 2.0 and first[0]["status_network"] == {"share": 0.1}
    assert first[0]["eval_loss"] == 2.5 and first[1]["status_network"] is None
    second = matrix.segment_records([r0, r1], 1)
    assert second[0]["window_s"] == 4.0 and second[1]["wait_s"] == 3.0
    row = net.summarize_train(2, net.Case(100, 5), "sync_fp32", second, 32)
    assert row["utilization_per_rank"] == [0.75, 0.0] and row["step_s"] == 0.8


def test_the_driver_reshapes_when_rank_0_hands_off_and_rank_0_waits_for_it(tmp_path):
    """Rank 0's side (hand_off, in a thread) against the driver's (watcher), real ranks
    (sleep processes) that end once rank 0 has passed both hand-offs."""
    import subprocess
    import threading
    import time

    handoff = tmp_path / "job.link"
    reshaped: list[tuple[int, float]] = []
    passed: list[tuple[int, float]] = []
    go = tmp_path / "go"
    procs = [(subprocess.Popen(["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done"]), None) for _ in range(2)]

    def rank0():
        for i in (1, 2):
            rank_mod.hand_off(handoff, i, timeout_s=30)
            passed.append((i, time.monotonic()))
        go.touch()

    t = threading.Thread(target=rank0)
    t.start()
    try:
        watch = matrix.watcher(lambda i: reshaped.append((i, time.monotonic())), handoff, poll_s=0.01)
        assert watch(procs, time.monotonic() + 60) is None
    finally:
        go.touch()
        t.join()
        for p, _ in procs:
            p.wait()
    assert [i for i, _ in reshaped] == [1, 2] and [i for i, _ in passed] == [1, 2]
    assert all(r[1] <= p[1] for r, p in zip(reshaped, passed))  # the link changed before rank 0 went on
    with pytest.raises(TimeoutError, match="did not acknowledge segment 3"):
        rank_mod.hand_off(handoff, 3, timeout_s=0.1)


def test_the_driver_says_a_rank_failed_without_waiting_for_the_deadline(tmp_path):
    import subprocess
    import time

    procs = [(subprocess.Popen(["sh", "-c", "exit 3"]), None), (subprocess.Popen(["sleep", "30"]), None)]
    try:
        t0 = time.monotonic()
        why = matrix.watcher(lambda i: None, tmp_path / "job.link", poll_s=0.01)(procs, time.monotonic() + 60)
        assert why == "a rank exited with status 3 before the job's end" and time.monotonic() - t0 < 30
    finally:
        procs[1][0].kill()
        for p, _ in procs:
            p.wait()


# --- benchmarks/_torchft.py: torchft's DiLoCo beside the local row (pure parts; no torchft) ---

tft = _load("_torchft")


def test_torchft_rounds_count_the_partial_last_round_the_job_end_closes():
    assert tft.rounds(40, 16) == 3  # syncs at 16, 32 and the job's end (8 steps)
    assert tft.rounds(32, 16) == 2
    assert tft.rounds(1, 16) == 1
    with pytest.raises(ValueError, match="sync_every"):
        tft.rounds(40, 0)


def test_torchft_row_takes_share_weighted_replica_losses_and_the_fewest_committed_rounds():
    records = [{"rank": 1, "share": 1, "start_loss": 6.0, "end_loss": 3.0, "commits": 2, "eval_loss": None},
               {"rank": 0, "share": 3, "start_loss": 5.0, "end_loss": 2.0, "commits": 3, "eval_loss": 2.6}]
    got = tft.replica_fields(records, steps=40, sync_every=16)
    assert got["start_loss"] == 5.25 and got["end_loss"] == 2.25  # rank 0 alone would say 5.0 and 2.0
    assert got["halved"] is True  # rank 0's held-out 2.6 <= 5.25 / 2
    assert got["rounds"] == 3 and got["rounds_committed"] == 2  # a replica lost a round


def test_torchft_pythonpath_puts_its_dirs_before_the_runtime_and_refuses_none():
    assert tft.pythonpath("/opt/tft:/opt/tft-deps", "/rt") == "/opt/tft:/opt/tft-deps:/rt"
    with pytest.raises(ValueError, match="--torchft"):
        tft.pythonpath(":", "/rt")
    row = net.torchft_skip(None)
    assert row["mode"] == "torchft_diloco" and "--no-deps" in row["reason"] and "--torchft" in row["reason"]


# --- benchmarks/_events.py: a join's and a planned leave's pause (pure parts) ---------------

ev = _load("_events")


def _steps(gaps: list[float]) -> list[float]:
    times = [0.0]
    for g in gaps:
        times.append(times[-1] + g)
    return times


def test_event_pause_is_the_longest_gap_around_the_change_less_the_steady_median():
    # 12 steps: 0.1 s apart except a 2.1 s stall in the step where the world grows (index 4)
    # and a 0.9 s one two steps after the world shrinks (index 9, gap ending at step 11)
    gaps = [0.1, 0.1, 0.1, 2.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.9, 0.1]
    sizes = [2, 2, 2, 2, 3, 3, 3, 3, 3, 2, 2, 2]
    got = ev.event_pauses(_steps(gaps), sizes)
    assert got["steady_s"] == 0.1
    assert [(e["step_index"], e["from"], e["to"]) for e in got["events"]] == [(4, 2, 3), (9, 3, 2)]
    assert got["events"][0]["gap_s"] == 2.1 and got["events"][0]["pause_s"] == 2.0
    assert got["events"][1]["pause_s"] == 0.8  # a stall after the change (a transfer) is the event's too


def test_event_pause_against_the_new_worlds_steady_step():
    # steps at world 3 take 0.3 s, at world 2 0.1 s: the join's 2.1 s gap is a 1.8 s pause
    # against a world-3 step (2.0 s against the median of all), the leave's 0.9 s one 0.8 s
    gaps = [0.1] * 5 + [2.1] + [0.3] * 8 + [0.9] + [0.1] * 5
    sizes = [2] * 6 + [3] * 9 + [2] * 6
    got = ev.event_pauses(_steps(gaps), sizes)
    assert got["steady_by_world_s"] == {2: 0.1, 3: 0.3}
    join, leave = got["events"]
    assert (join["to"], leave["to"]) == (3, 2)
    assert join["pause_vs_new_world_s"] == 1.8 and leave["pause_vs_new_world_s"] == 0.8
    # against the slower size's step: the leave's gap is its last step at world 3 (0.3 s) and more
    assert join["pause_vs_step_s"] == 1.8 and leave["pause_vs_step_s"] == 0.6
    assert join["pause_s"] == round(2.1 - got["steady_s"], 4)


def test_event_pause_against_a_usual_rounds_end():
    # local steps: 0.1 s steps, a 1.0 s averaging every 4th, the join in a round's end of 1.3 s
    gaps = [0.1, 0.1, 0.1, 1.0] * 3 + [1.3] + [0.1, 0.1, 0.1, 1.0] * 3
    sizes = [2] * 13 + [3] * 13
    got = ev.event_pauses(_steps(gaps), sizes)
    assert got["steady_s"] == 0.1 and got["round_end_s"] == 1.0
    assert got["events"][0]["pause_vs_round_end_s"] == 0.3 and got["events"][0]["pause_s"] == 1.2
    assert ev.event_pauses(_steps([0.1] * 9), [2] * 10)["round_end_s"] is None  # synchronous: no round ends


def test_event_pause_steady_leaves_out_the_warm_up_and_the_event_windows():
    # a slow warm-up (1.0 s gaps) and slow steps inside the window must not move the median
    gaps = [1.0, 1.0, 0.2, 0.2, 0.2, 3.0, 3.0, 0.2, 0.2, 0.2]
    sizes = [3] * 6 + [2] * 5
    got = ev.event_pauses(_steps(gaps), sizes, before=1, after=2, skip=2)
    assert got["steady_s"] == 0.2 and got["steady_max_s"] == 0.2
    assert got["events"][0]["pause_s"] == 2.8
    no_change = ev.event_pauses(_steps([0.3, 0.5, 0.4]), [2, 2, 2, 2])
    assert no_change["events"] == [] and no_change["steady_s"] == 0.4
    with pytest.raises(ValueError, match="one of each per step"):
        ev.event_pauses([0.0, 1.0], [2])


def test_catchup_facts_read_the_joiners_log_lines():
    log = ("INFO worker h3/cpu/2: catching up at step 31: the state comes from rank 0 in the background\n"
           "INFO catch-up: h3/cpu/2 received the state of step 32 (54.2 MB)\n"
           "INFO worker h3/cpu/2: caught up at step 33; it trains from the next step\n")
    got = ev.catchup_facts(log)
    assert got["catching_up"] and got["caught_up"] and got["received_mb"] == 54.2
    none = ev.catchup_facts("INFO worker h3/cpu/2: admitted at step 31\n")
    assert not none["caught_up"] and none["received_mb"] is None


def test_event_medians_take_each_mode_over_its_turns():
    def row(mode, turn, exit_s, join):
        return {"mode": mode, "world": 3, "rate_mbit": 1000.0, "delay_ms": 0.0, "turn": turn,
                "leaver_exit_after_term_s": exit_s, "join_pause_vs_new_world_s": join}

    rows = [row("sync_fp32", 0, 3.4, 2.0), row("local", 0, 4.0, None), row("sync_fp32", 1, 2.2, 0.5),
            row("local", 1, 3.0, 0.9), row("sync_fp32", 2, 5.1, 0.6), row("local", 2, 3.5, None)]
    got = ev.medians(rows)
    assert [(m["mode"], m["turns"]) for m in got] == [("sync_fp32", 3), ("local", 3)]
    sync, local = got
    assert sync["leaver_exit_after_term_s"] == 3.4 and sync["leaver_exit_after_term_s_each"] == [3.4, 2.2, 5.1]
    assert sync["join_pause_vs_new_world_s"] == 0.6
    assert local["join_pause_vs_new_world_s"] == 0.9 and local["join_pause_vs_new_world_s_each"] == [None, 0.9, None]
    assert local["leave_pause_s"] is None  # no turn has it
    lines = ev.render_medians(got).splitlines()
    assert len(lines) == 4 and "3.40" in lines[2] and "3.50" in lines[3]


def test_change_phases_read_a_generations_pause_phases_from_the_debug_log():
    log = ('2026-12-07 10:39:00,890 DEBUG worker h1/cpu/0: generation 0 pause phases {"total": 2.879, "phases": '
           '[["join_request", 0.0], ["admitted", 0.0034], ["group", 0.0043], ["state", 1.958]]}\n'
           'INFO worker h1/cpu/0: rank 1 of 3 in generation 1 (join) at step 32\n'
           '2026-12-07 10:39:26,581 DEBUG worker h1/cpu/0: generation 1 pause phases {"total": 3.0005, "phases": '
           '[["boundary", 2.0077], ["plan", 0.0012], ["group", 0.0224], ["state", 0.0065], ["reshard", 0.0205], '
           '["first_forward_backward", 0.27], ["first_reduce", 0.2222]]}\n')
    got = ev.change_phases(log)
    assert sorted(got) == [0, 1]
    assert got[1]["change_s"] == round(0.0012 + 0.0224 + 0.0065 + 0.0205, 4)  # not the boundary, not the step
    assert got[1]["total_s"] == 3.0005 and got[1]["phases"]["boundary"] == 2.0077
    assert got[0]["change_s"] == round(0.0043 + 1.958, 4)
    assert ev._changes(log)["join_change_s"] == got[1]["change_s"] and ev._changes(log)["leave_change_s"] is None
    assert ev.change_phases("no debug lines") == {}


def test_a_summarized_event_row_times_the_leaver_from_its_sigterm():
    def steps(world_of):  # (step, perf_counter, world): 0.5 s steps, one 2 s gap at each change
        out, t = [], 0.0
        for i, w in enumerate(world_of):
            t += 2.0 if i and w != world_of[i - 1] else 0.5
            out.append([i + 1, t, w])
        return out

    sizes = [2] * 8 + [3] * 8 + [2] * 8
    h1 = {"host": "h1", "steps": steps(sizes), "state_bytes": 600e6}
    h2 = {"host": "h2", "steps": steps(sizes[:16]), "state_bytes": 600e6, "term_wall": 1000.0,
          "loop_end_wall": 1001.25, "released_wall": 1003.5}
    row = ev.summarize_events("local", 3, 1000.0, 0.0, [h1, h2], "", 0, 0, 4.0)
    assert row["leaver_exit_after_term_s"] == 4.0
    assert row["leaver_loop_end_after_term_s"] == 1.25 and row["leaver_released_after_term_s"] == 3.5
    assert row["join_pause_s"] == 1.5 and row["leave_pause_s"] == 1.5
    assert row["join_change_s"] is None  # no DEBUG log given
    h2.pop("term_wall")  # no SIGTERM sent (the job ended first): no leaver figures
    assert ev.summarize_events("local", 3, 1000.0, 0.0, [h1, h2], "", None, 0)["leaver_released_after_term_s"] is None


def test_a_rank_counts_its_sends_on_the_delay_lines_tap_where_its_host_has_one(tmp_path, monkeypatch):
    from tests.testbed import netns

    bed = net._bed
    assert bed.LINE_TAP == netns.LINE_TAP  # the worker cannot import the test bed: the name is kept twice
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert bed.tx_bytes_file(tmp_path) == tmp_path / "eth0" / "statistics" / "tx_bytes"
    (tmp_path / netns.LINE_TAP).mkdir()
    assert bed.tx_bytes_file(tmp_path) == tmp_path / netns.LINE_TAP / "statistics" / "tx_bytes"

"""What a membership change costs the members on a slow link: a join and a planned leave.

benchmarks/network.py's `--parts events`: for each training mode asked for (sync_fp32
and local by default) and each link, one real `ElasticJob` on the shaped bed that
starts with W-1 ranks (ELTCTL_MIN_WORKERS=W-1, ELTCTL_MAX_WORKERS=W) on h1..h(W-1);
after `--join-after` committed steps the driver starts the W-th rank on hW (its
interpreter's start-up and model build happen before it asks to join: not the
members' pause); once the job has stepped `--leave-after` steps at W, the driver sends
SIGTERM to h2's process (a planned leave: member/session.py's handler), and the job
ends at W-1.

Every rank records, per committed step, `time.perf_counter()` and the size of the
world that committed it (`job.last_commit.world_size`). The pause at an event is the
longest gap between consecutive committed steps around the step where the world size
changed, less the median steady gap (`event_pauses`: pure, tested); and less the median
steady gap of the steps at the world size it changed to (`pause_vs_new_world_s`: a step
at world 3 moves more bytes per rank than one at world 2, which is no pause); and less
the slower of the two sizes' steady steps (`pause_vs_step_s`: a leave's longest gap is
often its last step at the larger size, which is no pause either). For the local
mode's join, the joiner's log says whether it caught up in the background
(runtime/train/catchup.py's "catch" lines) and how many MB it received.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import _bed
import _textlm

EVENT_MODES = ("sync_fp32", "local")


# --- the pure arithmetic ----------------------------------------------------------------

def world_changes(sizes: list[int]) -> list[tuple[int, int, int]]:
    """(index of the first step at the new size, old size, new size) for each change."""
    return [(i, sizes[i - 1], sizes[i]) for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]]


def event_pauses(times: list[float], sizes: list[int], *, before: int = 1, after: int = 3,
                 skip: int = 0) -> dict:
    """The members' pause at each change of the world size in one rank's step record.

    `times[i]` is when step i was committed, `sizes[i]` the world that committed it.
    Gap g is times[g+1] - times[g] (it ends at step g+1). An event at step k (the first
    at the new size) owns the gaps ending at steps k-before .. k+after (the change itself
    sits in the gap ending at k; a joiner's background transfer, if it slows the
    members, in the ones after). Steady: the median of the gaps outside every event's
    window and after the first `skip` (the warm-up); `steady_max_s` the longest of them
    (with local steps: a usual round's averaging). Pause: the window's longest gap less
    the steady median. `round_end_s`: the median of the steady gaps longer than twice the
    steady median (with local steps: a usual round's end, its averaging), None where
    there are none; each event's `pause_vs_round_end_s` is its longest gap less that (a
    local-mode join waits for a round's end: what it costs beyond that end).
    """
    if len(times) != len(sizes):
        raise ValueError(f"{len(times)} step times but {len(sizes)} world sizes: one of each per step")
    gaps = [b - a for a, b in zip(times, times[1:])]
    changes = world_changes(sizes)
    windows = [range(max(0, k - 1 - before), min(len(gaps), k + after)) for k, _, _ in changes]
    owned = {g for w in windows for g in w}
    steady = [gap for g, gap in enumerate(gaps) if g >= skip and g not in owned]
    median = statistics.median(steady) if steady else None
    # A step at another world size takes another time on a shared link (a ring all-reduce
    # sends 2(W-1)/W of the gradients per rank): the steady median of each size's steps too,
    # and each event's pause against the steps of the size it changed to.
    by_world: dict[int, list[float]] = {}
    for g, gap in enumerate(gaps):
        if g >= skip and g not in owned:
            by_world.setdefault(sizes[g + 1], []).append(gap)
    world_median = {w: statistics.median(v) for w, v in by_world.items()}
    ends = [gap for gap in steady if median is not None and gap > 2 * median]
    round_end = statistics.median(ends) if ends else None
    events = []
    for (k, old, new), w in zip(changes, windows):
        longest = max((gaps[g] for g in w), default=None)
        at_new = world_median.get(new)
        slower = max((m for m in (world_median.get(old), at_new) if m is not None), default=None)
        events.append({"step_index": k, "from": old, "to": new, "gap_s": _r(longest),
                       "pause_s": _r(longest - median) if longest is not None and median is not None else None,
                       "pause_vs_new_world_s": _r(longest - at_new) if longest is not None and at_new is not None
                       else None,
                       "pause_vs_step_s": _r(longest - slower) if longest is not None and slower is not None
                       else None,
                       "pause_vs_round_end_s": _r(longest - round_end) if longest is not None and round_end is not None
                       else None})
    return {"steady_s": _r(median), "steady_max_s": _r(max(steady) if steady else None), "round_end_s": _r(round_end),
            "steady_by_world_s": {w: _r(m) for w, m in sorted(world_median.items())}, "events": events}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def catchup_facts(log_text: str) -> dict:
    """What a joiner's runtime log says of its catching up (runtime/train/catchup.py):
    whether it was admitted catching up, whether it caught up, the MB it received."""
    lines = [ln.strip() for ln in log_text.splitlines() if "catch" in ln or "caught up" in ln]
    got = [float(m.group(1)) for ln in lines if (m := re.search(r"received the state of step \d+ \(([\d.]+) MB\)", ln))]
    return {"catching_up": any("catching up at step" in ln for ln in lines),
            "caught_up": any("caught up at step" in ln for ln in lines),
            "received_mb": got[-1] if got else None, "catch_lines": lines[-6:]}


# A generation's pause phases (runtime/train/pause.py, DEBUG) that are the membership change
# itself: what the members do for the change beyond a step (the round's averaging, the
# step's compute and its reduction are the other phases).
CHANGE_PHASES = ("plan", "hand_over", "group", "state", "reshard")


def change_phases(log_text: str) -> dict[int, dict]:
    """Per generation, from a rank's DEBUG log: its pause's total, its phases and the
    sum of those of them that are the membership change (CHANGE_PHASES)."""
    out = {}
    for m in re.finditer(r"generation (\d+) pause phases (\{.*\})", log_text):
        doc = json.loads(m.group(2))
        phases = {name: s for name, s in doc["phases"]}
        out[int(m.group(1))] = {"total_s": doc["total"], "phases": phases,
                                "change_s": round(sum(phases.get(k, 0.0) for k in CHANGE_PHASES), 4)}
    return out


def summarize_events(mode: str, world: int, rate_mbit: float, delay_ms: float, records: list[dict],
                     joiner_log: str, leaver_exit: int | None, skip: int, leaver_exit_s: float | None = None,
                     first_log: str = "") -> dict:
    """One row: rank 0's join and leave pauses and steady step, the largest over every
    member that saw each event, the state's size and the joiner's catching up; with
    `first_log` (h1's DEBUG log), the membership change's own phases at the join and at
    the leave (`join_change_s`, `leave_change_s`: change_phases of the generations 1 and 2)."""
    per_rank = []
    for r in records:
        times = [s[1] for s in r["steps"]]
        p = event_pauses(times, [s[2] for s in r["steps"]], skip=skip)
        # every gap, for a look at the steps around an event (gaps_s[g] ends at step index g+1)
        per_rank.append({"host": r["host"], **p, "gaps_s": [_r(b - a) for a, b in zip(times, times[1:])]})

    def pause(p: dict, kind: str, key: str = "pause_s") -> float | None:
        ev = [e for e in p["events"] if (e["to"] > e["from"]) == (kind == "join")]
        return ev[0][key] if ev else None

    first = next(p for p in per_rank if p["host"] == "h1")
    joins = [x for p in per_rank if (x := pause(p, "join")) is not None]
    leaves = [x for p in per_rank if (x := pause(p, "leave")) is not None]
    facts = catchup_facts(joiner_log)
    leaver = next((r for r in records if r.get("host") == "h2" and "term_wall" in r), None)

    def after_term(key: str) -> float | None:
        return _r(leaver[key] - leaver["term_wall"]) if leaver and leaver.get(key) is not None else None

    return {"mode": mode, "world": world, "rate_mbit": rate_mbit, "delay_ms": delay_ms,
            "steps": len(records[0]["steps"]),
            "steady_s": first["steady_s"], "steady_max_s": first["steady_max_s"],
            "join_pause_s": pause(first, "join"), "join_pause_max_s": max(joins, default=None),
            "leave_pause_s": pause(first, "leave"), "leave_pause_max_s": max(leaves, default=None),
            "steady_by_world_s": first["steady_by_world_s"],
            "join_pause_vs_new_world_s": pause(first, "join", "pause_vs_new_world_s"),
            "leave_pause_vs_new_world_s": pause(first, "leave", "pause_vs_new_world_s"),
            "join_pause_vs_step_s": pause(first, "join", "pause_vs_step_s"),
            "leave_pause_vs_step_s": pause(first, "leave", "pause_vs_step_s"),
            "round_end_s": first["round_end_s"],
            "join_pause_vs_round_end_s": pause(first, "join", "pause_vs_round_end_s"),
            "state_mb": round(records[0]["state_bytes"] / 1e6, 1),
            "caught_up": facts["caught_up"] if mode == "local" else None,
            "joiner_received_mb": facts["received_mb"], "joiner_catch_lines": facts["catch_lines"],
            "leaver_exit": leaver_exit, "leaver_exit_after_term_s": leaver_exit_s,
            # the leaver's SIGTERM to: its loop's end (the job let it go), the job closed (its last
            # transfer done); the rest of leaver_exit_after_term_s is the process's own exit
            "leaver_loop_end_after_term_s": after_term("loop_end_wall"),
            "leaver_released_after_term_s": after_term("released_wall"),
            **_changes(first_log), "per_rank": per_rank}


def _changes(first_log: str) -> dict:
    """h1's pause phases at the join (generation 1) and the leave (generation 2)."""
    gens = change_phases(first_log)
    join, leave = gens.get(1), gens.get(2)
    return {"join_change_s": join and join["change_s"], "leave_change_s": leave and leave["change_s"],
            "join_phases": join and join["phases"], "leave_phases": leave and leave["phases"]}


# What `medians` summarizes over a mode's turns: each one's value in every turn, and their median.
REPEATED = ("join_pause_s", "join_pause_vs_new_world_s", "join_pause_vs_round_end_s", "leave_pause_s",
            "leave_pause_vs_new_world_s", "join_pause_vs_step_s", "leave_pause_vs_step_s", "leaver_exit_after_term_s", "leaver_loop_end_after_term_s",
            "leaver_released_after_term_s", "steady_s", "join_change_s", "leave_change_s")


def medians(rows: list[dict]) -> list[dict]:
    """Per (world, link, mode), in first-seen order: the turns' values of each REPEATED
    figure (None where a turn has none) and their median over the turns that have one."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["world"], r["rate_mbit"], r["delay_ms"], r["mode"]), []).append(r)
    out = []
    for (world, rate, delay, mode), rs in groups.items():
        row: dict = {"mode": mode, "world": world, "rate_mbit": rate, "delay_ms": delay, "turns": len(rs)}
        for key in REPEATED:
            values = [r.get(key) for r in rs]
            have = [v for v in values if v is not None]
            row[key] = _r(statistics.median(have)) if have else None
            row[key + "_each"] = values
        out.append(row)
    return out


def render_medians(rows: list[dict]) -> str:
    """The medians over the turns, a line per mode and link."""
    def num(v):
        return "n/a" if v is None else f"{v:.2f}"

    head = (f"{'world':>5}  {'link':<16} {'mode':<10} {'turns':>5} {'join beyond a step':>18} "
            f"{'(its change)':>12} {'leave beyond a step':>19} {'(its change)':>12} {'leaver exit s':>13}")
    lines = [head, "-" * len(head)]
    for m in rows:
        link = f"{m['rate_mbit']:g} Mbit/s, {m['delay_ms']:g} ms"
        lines.append(f"{m['world']:>5}  {link:<16} {m['mode']:<10} {m['turns']:>5} "
                     f"{num(m['join_pause_vs_step_s']):>18} {num(m['join_change_s']):>12} "
                     f"{num(m['leave_pause_vs_step_s']):>19} {num(m['leave_change_s']):>12} "
                     f"{num(m['leaver_exit_after_term_s']):>13}")
    return "\n".join(lines)


def render_events(rows: list[dict], skipped: list[dict]) -> str:
    head = (f"{'world':>5}  {'link':<16} {'mode':<10} {'steady s':>8} {'round s':>8} {'join pause':>10} "
            f"{'(max)':>6} {'leave pause':>11} {'(max)':>6} {'state MB':>8} {'caught up':>9} {'leaver rc':>9} "
            f"{'exit s':>6}")
    lines = [head, "-" * len(head)]

    def num(v, fmt=".2f"):
        return format(v, fmt) if v is not None else "n/a"

    for r in rows:
        link = f"{r['rate_mbit']:g} Mbit/s, {r['delay_ms']:g} ms"
        cu = "n/a" if r["caught_up"] is None else ("yes" if r["caught_up"] else "no")
        lines.append(f"{r['world']:>5}  {link:<16} {r['mode']:<10} {num(r['steady_s'], '.3f'):>8} "
                     f"{num(r['steady_max_s'], '.3f'):>8} {num(r['join_pause_s']):>10} {num(r['join_pause_max_s']):>6} "
                     f"{num(r['leave_pause_s']):>11} {num(r['leave_pause_max_s']):>6} {r['state_mb']:>8.1f} "
                     f"{cu:>9} {num(r['leaver_exit'], 'd'):>9} {num(r['leaver_exit_after_term_s']):>6}")
    lines += [f"skipped {s['mode']}, world {s.get('world')}: {s['reason']}" for s in skipped]
    return "\n".join(lines)


# --- the worker (host interpreter, inside a namespace) -----------------------------------

def events_worker(spec: dict) -> None:
    """One rank: train, print {"progress": step, "world": W} per committed step where
    spec["progress"], then one record with every committed step's (step, perf_counter,
    world size) and the state's bytes (parameters + the inner optimizer's state)."""
    import logging

    import torch

    import eltctl_runtime as elt

    # the runtime configures no logging: its INFO lines (the joiner's "catch" lines) go to the rank's log file
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    if spec.get("debug"):  # --keep-logs: the runtime's DEBUG lines too (a generation's pause phases)
        logging.getLogger("eltctl_runtime").setLevel(logging.DEBUG)
    T = _textlm
    corpus, _shape, windows, model = T.rank_setup(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    # the default collate: a catching-up joiner's empty batch is the runtime's (pipeline.fetch_batch)
    job = elt.ElasticJob(model, optimizer, T.make_dataset(corpus, windows), global_batch_size=spec["batch"],
                         seed=spec["seed"], max_steps=spec["steps"], config=elt.RuntimeConfig.from_env(),
                         balance=spec["balance"], **spec["kwargs"])
    steps: list[list] = []
    with job:
        for batch in job:
            if job.step(lambda: T.loss_fn(model, batch)) is None:
                continue  # a dropped step
            c = job.last_commit
            steps.append([c.step, time.perf_counter(), c.world_size])
            if spec["progress"]:
                print(json.dumps({"progress": c.step, "world": c.world_size}), flush=True)
        loop_end = time.time()  # a leaver: the job let go of its loop (its last averaging is still to land)
    released = time.time()  # the job closed: its group gone, its transfers done
    state = sum(t.numel() * t.element_size() for t in model.parameters())
    state += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v))
    print(json.dumps({"host": spec["host"], "steps": steps, "state_bytes": state, "left": job.left,
                      "loop_end_wall": loop_end, "released_wall": released}), flush=True)


# --- the driver ---------------------------------------------------------------------------

class EventJobFailed(Exception):
    """An events job did not end with every rank's record (the message names the logs)."""


def run_event_job(bed, world: int, job: str, master: str, port: int, base: dict, kwargs: dict, plan,
                  workdir: Path, script: str, join_after: int, leave_after: int,
                  debug: bool = False) -> tuple[list[dict], str, int | None, float | None]:
    """Start h1..h(W-1), the joiner on hW after `join_after` steps, SIGTERM h2 after
    `leave_after` steps at W; return the records, the joiner's log, h2's exit status and
    the seconds from its SIGTERM to its exit (how soon a yielding worker frees its device)."""
    from tests.testbed.hostpython import HOST_PYTHON

    procs: dict[str, _bed.Rank] = {}

    def start(r: int) -> None:
        host = f"h{r + 1}"
        spec = {**asdict(plan), "rank": r, "host": host, "kwargs": kwargs, "progress": r == 0, "debug": debug}
        env = {**base, "ELTCTL_STORE": f"tcp:{master}:{port}", "ELTCTL_JOB": job,
               "ELTCTL_WORKER_ID": f"{host}/cpu/{r}", "ELTCTL_DEVICE": "cpu",
               "ELTCTL_MIN_WORKERS": str(world - 1), "ELTCTL_MAX_WORKERS": str(world),
               "ELTCTL_BIND_ADDRESS": bed.address(host), "ELTCTL_HANG_TIMEOUT": "30"}
        procs[host] = _bed.start_rank(bed, host, [HOST_PYTHON, script, "--events-worker", json.dumps(spec)], env,
                                      workdir / f"{job}-{host}.log")

    for r in range(world - 1):
        start(r)
    lines: queue.Queue = queue.Queue()

    def pump(out) -> None:  # h1's lines, so that the driver can wait for one with a deadline
        for ln in out:
            lines.put(ln)
        lines.put(None)

    threading.Thread(target=pump, args=(procs["h1"][0].stdout,), daemon=True).start()
    deadline = time.monotonic() + plan.timeout_s
    joined_at = None
    sent_term = False
    term_wall = None
    leaver_exit_s: list[float] = []

    def watch_leaver(proc, t0: float) -> None:
        proc.wait()
        leaver_exit_s.append(time.monotonic() - t0)

    out_h1 = None
    try:
        while out_h1 is None:
            try:
                line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise EventJobFailed(f"job {job} ran past {plan.timeout_s:g} s; logs in {workdir}") from None
            if line is None:
                raise EventJobFailed(f"h1 of job {job} ended without a record; logs in {workdir}")
            rec = json.loads(line) if line.startswith("{") else {}
            if "steps" in rec:
                out_h1 = rec
            elif "progress" in rec:
                if f"h{world}" not in procs and rec["progress"] >= join_after:
                    start(world - 1)
                if joined_at is None and rec["world"] == world:
                    joined_at = rec["progress"]
                if joined_at is not None and not sent_term and rec["progress"] >= joined_at + leave_after:
                    term_wall = time.time()
                    os.kill(procs["h2"][0].pid, signal.SIGTERM)  # `ip netns exec` execs: this is the worker
                    threading.Thread(target=watch_leaver, args=(procs["h2"][0], time.monotonic()), daemon=True).start()
                    sent_term = True
        records = [out_h1]
        for host, (proc, log) in procs.items():
            if host == "h1":
                continue
            record = _bed.last_record(proc, deadline)
            if record is None:
                raise EventJobFailed(f"{host} of job {job} ended without a record (exit {proc.returncode}); "
                                     f"logs in {workdir}")
            if host == "h2" and term_wall is not None:
                record["term_wall"] = term_wall
            records.append(record)
        procs["h1"][0].wait(60)
    except subprocess.TimeoutExpired:
        raise EventJobFailed(f"job {job} ran past {plan.timeout_s:g} s; logs in {workdir}") from None
    finally:
        _bed.stop_ranks(procs.values())
    joiner = (workdir / f"{job}-h{world}.log").read_text(errors="replace")
    return (records, joiner, procs["h2"][0].returncode if sent_term else None,
            round(leaver_exit_s[0], 3) if leaver_exit_s else None)


def run_events(worlds: list[int], cases: list, modes: dict[str, dict], plan, workdir: Path, *, script: str,
               port: int, join_after: int, leave_after: int, debug: bool = False,
               repeats: int = 1) -> tuple[list[dict], list[dict]]:
    """A bed per world (3 or more: h2 leaves and h1 stays rank 0), a store on h1; per
    link, one job per mode, `repeats` times, the modes taking turns (so that what the
    machine does meanwhile falls on every mode alike); each row carries its `turn`."""
    from tests.testbed.netns import Link

    rows: list[dict] = []
    skipped: list[dict] = []
    base = _bed.bed_env(plan.threads)
    for world in worlds:
        if world < 3:
            skipped += [{"mode": m, "world": world, "reason": "events need world 3 or more (h1 stays, h2 leaves, "
                                                              "the W-th joins)"} for m in modes]
            continue
        runnable, unshaped = _bed.shapeable(cases, world, modes)
        skipped += unshaped
        if not runnable:
            continue
        with _bed.bed_for(world, runnable) as bed, _bed.job_store(bed, "h1", port, base) as master:
            for case in runnable:
                bed.reshape_all(Link(rate_mbit=case.rate_mbit, delay_ms=case.delay_ms))
                for turn, (mode, kwargs) in ((t, m) for t in range(repeats) for m in modes.items()):
                    job = f"ev-{mode}-w{world}-{case.rate_mbit:g}-{case.delay_ms:g}-{os.getpid()}-{turn}"
                    try:
                        records, joiner, rc, exit_s = run_event_job(bed, world, job, master, port, base, kwargs, plan,
                                                            workdir, script, join_after, leave_after, debug)
                    except EventJobFailed as e:
                        skipped.append({"mode": mode, "world": world, **asdict(case), "reason": str(e),
                                        "failed": True})
                        print(f"events {mode}, world {world}, {case.label}: {e}", file=sys.stderr, flush=True)
                        continue
                    first = workdir / f"{job}-h1.log"
                    rows.append({**summarize_events(mode, world, case.rate_mbit, case.delay_ms, records, joiner, rc,
                                                    plan.warmup, exit_s,
                                                    first.read_text(errors="replace") if debug else ""),
                                 "turn": turn})
                    print(render_events(rows[-1:], []).splitlines()[-1], file=sys.stderr, flush=True)
    return rows, skipped

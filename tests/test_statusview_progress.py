"""`eltctl status` drawn from status documents (issue 50): progress a person reads at a
glance (step N of M, one samples/s, the time left), no phantom worker or holding, one
count of GPUs and CPU slots, every wait with its reason, and `--watch`'s charts ending
at the document's own figures."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from eltctl.statusview import Snapshot, Source, ViewOptions, render_status, utc
from eltctl.statusview.usage import render_charts

NOW = 1790000000.0  # 2026-09-21 14:13:20 UTC


def view_text(doc, *, width: int = 160, now: float = NOW) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None, highlight=False,
                      force_terminal=False)
    console.print(render_status(Snapshot(doc, Source.CONTROLLER, now), ViewOptions(now=now, tz=utc())))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


def cpu_host(name, state, workers, slots, reason="", waiting=None):
    return {"name": name, "state": state, "reason": reason, "workers": workers, "device": "cpu",
            "heartbeat_age_s": 0.5,
            "gpus": [{"index": i, "state": s, "reason": "CPU slot"} for i, s in enumerate(slots)],
            "waiting": waiting}


def doc(**over):
    base = {"job": "mnist", "state": "training", "phase": "training", "message": "", "updated": NOW,
            "generation": 4, "world_size": 1, "min_workers": 1, "max_workers": None, "members": ["a/0/1"],
            "runtime_current": True, "step": 400, "epoch": 1, "samples_per_s": 320.0, "loss": 0.25,
            "total_steps": 1000, "steps_per_s": 2.0, "eta_s": 300.0, "checkpoint": None,
            "controller": {"pid": 7, "alive": True},
            "hosts": [cpu_host("a", "running", 1, ["ours"], "1 worker(s)")], "events": []}
    base.update(over)
    return base


FAIR_WAIT = {"kind": "fair share", "detail": "fair share holds the job at 1 CPU slot (its share 1 of 2) while "
                                             "job b (bob: holds 1, share 1) wants more", "until": None}
FAIR = {"share": 1, "pool": 2, "held": 1, "wanted": 0, "user": "alice", "usage_gpu_h": 0.0, "priority": 0,
        "reason": "", "jobs": [], "unit": "CPU slot"}


def test_progress_reads_step_n_of_m_one_samples_per_s_and_the_time_left():
    text = view_text(doc())
    assert "progress    step 400 of 1000 (40%)   epoch 1   320.0 samples/s   loss 0.25\n" in text
    # the time left at the recent rate, as of the document, and the clock time it ends
    assert "finishes    in 5 min 00 s (about 14:18:20) at 2 steps/s\n" in text
    assert text.count("samples/s") == 1


def test_the_time_left_counts_down_with_the_documents_age():
    assert "finishes    in 4 min 50 s (about 14:18:20)" in view_text(doc(), now=NOW + 10)


@pytest.mark.parametrize("case, over", [
    ("no bound on the steps", {"total_steps": None, "eta_s": None}),
    ("no rate yet", {"eta_s": None, "steps_per_s": None}),
])
def test_no_time_left_where_it_is_not_known(case, over):
    text = view_text(doc(**over))
    assert "finishes" not in text
    assert ("of 1000" in text) == (over.get("total_steps", 1000) is not None)


# (case, document, what must be in the view, what must not)
CASES = [
    ("paused with no worker: workers 0, no workers table, no speed",
     doc(state="paused", phase="paused", message="outside working hours, resumes at Sat 00:00 (a)", world_size=0,
         members=[], runtime_current=False, samples_per_s=None, steps_per_s=None, eta_s=None,
         hosts=[cpu_host("a", "off-hours", 0, ["free"], "outside its working hours; usable again at Sat 00:00",
                         {"kind": "off-hours", "detail": "outside its working hours; usable again at Sat 00:00",
                          "until": NOW + 60})]),
     ["workers     0 (min 1, max any)", "step 400 of 1000 (40%)", "(where it stopped; no worker runs now)"],
     ["samples/s", "finishes", "share", "not joining"]),
    ("finished: no fair share holding, no time left",
     doc(state="finished", phase="finished", world_size=0, members=[], runtime_current=False, step=1000,
         samples_per_s=None, steps_per_s=None, eta_s=None, fairshare=None,
         hosts=[cpu_host("a", "idle", 0, ["free"], "usable, not used")]),
     ["step 1000 of 1000 (100%)"], ["holding", "finishes", "samples/s"]),
    ("a CPU-only job: fair share in CPU slots, no GPU-h, no GPU anywhere",
     doc(fairshare=FAIR, hosts=[cpu_host("a", "running", 1, ["ours"], "1 worker(s)"),
                                cpu_host("b", "idle", 0, ["free", "free"], "usable, not used", FAIR_WAIT)]),
     ["fair share  1 of 2 CPU slots   holding 1, wants 0 more   user alice   priority 0",
      "not joining (fair share): fair share holds the job at 1 CPU slot (its share 1 of 2) while job b (bob: "
      "holds 1, share 1) wants more"],
     ["GPU"]),
    ("a cooldown's reason is the host's own: not said twice",
     doc(hosts=[cpu_host("a", "cooldown", 0, ["free"], "worker crashed (usable again in 40 s)",
                         {"kind": "cooldown", "detail": "cooling down after worker crashed; 40 s more",
                          "until": NOW + 40})]),
     ["worker crashed (usable again in 40 s)"], ["not joining"]),
    ("free, waiting for idle_for: says when",
     doc(hosts=[{**cpu_host("a", "idle", 0, ["free"], "usable, not used",
                            {"kind": "idle_for", "detail": "free, used once free for idle_for (600 s): in 120 s; "
                                                           "`eltctl scale --add a` uses it now", "until": NOW + 120}),
                 "device": "gpu", "gpus": [{"index": 0, "state": "free", "reason": ""}]}]),
     ["not joining (idle_for): free, used once free for idle_for (600 s): in 120 s"], []),
]


@pytest.mark.parametrize("case, document, present, absent", CASES, ids=[c[0] for c in CASES])
def test_the_view_of_each_case(case, document, present, absent):
    text = view_text(document, width=300)  # the wide layout, nothing wrapped
    for p in present:
        assert p in text, p
    for a in absent:
        assert a not in text, a


def test_the_compact_layout_says_what_holds_a_host_too():
    text = view_text(doc(hosts=[cpu_host("b", "idle", 0, ["free"], "usable, not used", FAIR_WAIT)]), width=80)
    lines = text.splitlines()
    at = next(line.index("note") for line in lines if line.startswith(" host "))
    notes = " ".join(line[at:].strip() for line in lines[lines.index(next(x for x in lines if x.startswith(" b "))):]
                     if line.strip() and not line.startswith("full reasons"))
    assert notes.startswith("fair share holds the job at 1 CPU slot")
    assert "usable, not used" not in notes  # idle, but what holds it is said instead


def test_the_watch_charts_end_at_the_documents_world_size_and_samples_per_s():
    """Issue 50: the world-size graph lagged the world size (the ledger samples every
    ~10 s, and not at all with no worker), and its samples/s was another figure."""
    samples = [(NOW - 600 + 10 * i, 1, 239.6) for i in range(55)]  # the ledger: up to 50 s ago
    text = render_charts(samples, NOW, width=60, current=(3, 320.0)).plain
    world, sps = text.splitlines()[1:3]
    assert world.endswith("█ 3 (max 3)") and sps.endswith("█ 320.0 (max 320.0)")
    old = render_charts(samples, NOW, width=60).plain.splitlines()[1]
    assert old.endswith(" 1 (max 1)")  # without the document: the ledger's last sample
    paused = render_charts(samples, NOW, width=60, current=(0, None)).plain.splitlines()
    assert paused[1].endswith("▁ 0 (max 1)") and paused[2].endswith(" -")

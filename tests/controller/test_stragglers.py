"""The straggler rule as a table: when a worker the job is faster without is dropped."""

from __future__ import annotations

from dataclasses import replace

import pytest

from eltctl.controller.policy import HostPhase, HostRecord, HostView, Reach, host_state, track_stragglers, worker_slot
from eltctl.inventory import parse_inventory

NOW = 10_000.0


def inventory(min_workers=1, policy=""):
    text = (f'[job]\nname = "j"\ncommand = "python t.py"\nmin_workers = {min_workers}\n'
            f'[policy]\ncooldown = 60\nstraggler_for = "30s"\n{policy}')
    for h in ("a", "b"):
        text += f'[[hosts]]\nname = "{h}"\naddress = "{h}.lab"\n'
    return parse_inventory(text, "hosts.toml")


def status(gain_b=1.4, members=("a/0/1", "a/1/1", "b/0/1")):
    figures = {"a/0/1": 0.6, "a/1/1": 0.6, "b/0/1": gain_b}
    return {"members": list(members), "workers": {
        w: {"share": 10, "samples_per_s": 5.0, "relative_speed": 0.1, "speedup_without": figures[w],
            "straggler": figures[w] > 1} for w in members}}


RUNNING = {"a": HostRecord(desired=(0, 1)), "b": HostRecord(desired=(0,))}

# (case, inventory kwargs, status, records before, expected b record)
CASES = [
    ("first seen holding the job back: its clock starts",
     {}, status(), RUNNING, HostRecord(desired=(0,), straggler_since=NOW)),
    ("held it back for straggler_for: dropped, and its host rests for cooldown",
     {}, status(), {**RUNNING, "b": HostRecord(desired=(0,), straggler_since=NOW - 30)},
     HostRecord(desired=(), straggler_until=NOW + 60,
                straggler_note="dropped worker b/0/1 as a straggler: the job was predicted 1.40x as fast "
                               "without it (5.0 samples/s)")),
    ("not yet straggler_for", {}, status(), {**RUNNING, "b": HostRecord(desired=(0,), straggler_since=NOW - 29)},
     HostRecord(desired=(0,), straggler_since=NOW - 29)),
    ("5 % faster without it is not measurably faster (straggler_gain_percent 10)",
     {}, status(gain_b=1.05), {**RUNNING, "b": HostRecord(desired=(0,), straggler_since=NOW - 99)},
     HostRecord(desired=(0,))),
    ("a lower straggler_gain_percent takes it",
     {"policy": "straggler_gain_percent = 5\n"}, status(gain_b=1.05),
     {**RUNNING, "b": HostRecord(desired=(0,), straggler_since=NOW - 99)},
     replace(HostRecord(desired=(), straggler_until=NOW + 60), straggler_note=(
         "dropped worker b/0/1 as a straggler: the job was predicted 1.05x as fast without it (5.0 samples/s)"))),
    ("drop_stragglers = false: reported, never dropped",
     {"policy": "drop_stragglers = false\n"}, status(),
     {**RUNNING, "b": HostRecord(desired=(0,), straggler_since=NOW - 99)}, HostRecord(desired=(0,))),
    ("never below min_workers",
     {"min_workers": 3}, status(), {**RUNNING, "b": HostRecord(desired=(0,), straggler_since=NOW - 99)},
     HostRecord(desired=(0,), straggler_since=NOW - 99)),
    ("no figures in the status (nothing measured yet): the clock stands",
     {}, {"members": ["b/0/1"]}, {**RUNNING, "b": HostRecord(desired=(0,), straggler_since=NOW - 10)},
     HostRecord(desired=(0,), straggler_since=NOW - 10)),
]


@pytest.mark.parametrize("case,inv,rs,before,after", CASES, ids=[c[0] for c in CASES])
def test_track_stragglers(case, inv, rs, before, after):
    out = track_stragglers(before, rs, inventory(**inv), NOW)
    assert out["b"] == after
    assert out["a"] == RUNNING["a"]


def test_a_dropped_stragglers_host_cools_down_and_says_why():
    rec = track_stragglers({**RUNNING, "b": HostRecord(desired=(0,), straggler_since=NOW - 30)}, status(),
                           inventory(), NOW)["b"]
    assert rec.cooling(NOW + 59) and not rec.cooling(NOW + 60)
    phase, reason = host_state(HostView("b", Reach.OK), rec, NOW + 1)
    assert phase is HostPhase.COOLDOWN and reason.startswith("dropped worker b/0/1 as a straggler")
    assert HostRecord.from_json(rec.to_json()) == rec


@pytest.mark.parametrize("worker,where", [("ws1/2/17", ("ws1", 2)), ("host0/cpu/123", None), ("x", None)])
def test_worker_slot(worker, where):
    assert worker_slot(worker) == where

"""Quotas as tables with a fake clock (eltctl/controller/quotas.py and the policy's
limits): GPU-hours per day per host reached mid-day, the job's total, and at most N
GPUs per host; without figures the hour quotas are not enforced."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from eltctl.controller.policy import HostPhase, HostRecord, decide, host_limits, host_state
from eltctl.controller.quotas import QuotaUse, host_cap, next_midnight, no_figures
from eltctl.inventory import parse_inventory
from tests.controller.test_policy import free_for, view

BERLIN = ZoneInfo("Europe/Berlin")
NOON = datetime(2026, 11, 25, 12, 0, tzinfo=BERLIN).timestamp()  # a Wednesday, mid-day
H = 3600.0

CAPS = [
    # case, limits (max_gpus, per_day_h, total_h), use, expected (slots, reached)
    ("no limits, no figures", (None, None, None), None, (None, False)),
    ("max_gpus_per_host needs no figures", (2, None, None), None, (2, False)),
    ("a daily quota without figures is not enforced", (None, 8.0, None), None, (None, False)),
    ("under the daily quota mid-day", (None, 8.0, None), QuotaUse({"a": 7.9 * H}, 7.9 * H), (None, False)),
    ("the daily quota reached mid-day", (None, 8.0, None), QuotaUse({"a": 8.0 * H}, 8.0 * H), (0, True)),
    ("another host's use does not count", (None, 8.0, None), QuotaUse({"b": 9 * H}, 9 * H), (None, False)),
    ("the job's total reached", (2, None, 100.0), QuotaUse({}, 100.0 * H), (0, True)),
    ("the job's total not reached", (2, None, 100.0), QuotaUse({}, 99.0 * H), (2, False)),
]


@pytest.mark.parametrize("case, limits, use, expected", CAPS, ids=[c[0] for c in CAPS])
def test_host_cap(case, limits, use, expected):
    m, d, t = limits
    cap = host_cap("a", max_gpus=m, per_day_h=d, total_h=t, use=use, tz=BERLIN, now=NOON)
    assert (cap.slots, cap.reached) == expected


def test_a_daily_quota_lifts_at_the_hosts_local_midnight():
    cap = host_cap("a", max_gpus=None, per_day_h=8.0, total_h=None, use=QuotaUse({"a": 8 * H}), tz=BERLIN, now=NOON)
    assert cap.until == datetime(2026, 11, 26, 0, 0, tzinfo=BERLIN).timestamp()
    assert "usable again at Thu 00:00" in cap.reason and "8.00 of its 8 GPU-hours" in cap.reason


def test_next_midnight_on_the_dst_day_is_23_hours_on():
    start = datetime(2026, 3, 29, 0, 0, tzinfo=BERLIN).timestamp()
    assert next_midnight(start, BERLIN) - start == 23 * H


def test_no_figures_provider():
    assert no_figures(NOON) is None


def inventory(policy: str = "", a: str = "", b: str = "", min_workers: int = 1):
    text = (f'[job]\nname = "j"\ncommand = "python t.py"\nmin_workers = {min_workers}\n'
            f'[policy]\nidle_for = 10\ncooldown = 60\ntimezone = "Europe/Berlin"\n{policy}\n'
            f'[[hosts]]\nname = "a"\naddress = "a.lab"\n{a}\n[[hosts]]\nname = "b"\naddress = "b.lab"\n{b}\n')
    return parse_inventory(text, "hosts.toml")


RUNNING = {"a": HostRecord(desired=(0, 1), seq=1, free_since=free_for(99, 0, 1)),
           "b": HostRecord(desired=(0, 1), seq=1, free_since=free_for(99, 0, 1))}
VIEWS = {"a": view("a", "ours", "ours", alive=True, workers=(0, 1)),
         "b": view("b", "ours", "ours", alive=True, workers=(0, 1))}

LIMITED = [
    # case, inventory, quota use, records, expected desired, host a's phase, paused
    ("max_gpus_per_host 1: a host's second worker leaves", inventory("max_gpus_per_host = 1"), None, RUNNING,
     {"a": (0,), "b": (0,)}, HostPhase.RUNNING, False),
    ("a host's own max_gpus_per_host", inventory(a="max_gpus_per_host = 1"), None, RUNNING,
     {"a": (0,), "b": (0, 1)}, HostPhase.RUNNING, False),
    ("a host's daily quota reached mid-day: its workers leave, the other host trains on",
     inventory(a="gpu_hours_per_day = 4"), QuotaUse({"a": 4 * H, "b": 4 * H}, 8 * H), RUNNING,
     {"a": (), "b": (0, 1)}, HostPhase.QUOTA, False),
    ("a daily quota without figures is not enforced", inventory(a="gpu_hours_per_day = 4"), None, RUNNING,
     {"a": (0, 1), "b": (0, 1)}, HostPhase.RUNNING, False),
    ("the job's total reached: it pauses on its checkpoint", inventory("gpu_hours_total = 10"),
     QuotaUse({}, 10 * H), RUNNING, {"a": (), "b": ()}, HostPhase.QUOTA, True),
    ("a disabled host is never used", inventory(a="enabled = false"), None,
     {"b": RUNNING["b"], "a": HostRecord(free_since=free_for(99, 0, 1))}, {"a": (), "b": (0, 1)},
     HostPhase.DISABLED, False),
    ("a disabled host's running workers leave", inventory(a="enabled = false"), None, RUNNING,
     {"a": (), "b": (0, 1)}, HostPhase.DISABLED, False),
    ("a cordoned host's workers leave, the other trains on", inventory(), None,
     {**RUNNING, "a": HostRecord(desired=(0, 1), seq=1, free_since=free_for(99, 0, 1), cordoned=True)},
     {"a": (), "b": (0, 1)}, HostPhase.CORDONED, False),
    ("every host cordoned: the job pauses", inventory(), None,
     {n: HostRecord(desired=(0, 1), seq=1, free_since=free_for(99, 0, 1), cordoned=True) for n in "ab"},
     {"a": (), "b": ()}, HostPhase.CORDONED, True),
    ("too few slots left for min_workers: the job pauses", inventory(a="enabled = false", min_workers=3), None,
     RUNNING, {"a": (), "b": ()}, HostPhase.DISABLED, True),
]


@pytest.mark.parametrize("case, inv, use, records, desired, phase, paused", LIMITED, ids=[c[0] for c in LIMITED])
def test_limits_cap_the_slots(case, inv, use, records, desired, phase, paused):
    limits = host_limits(inv, records, NOON, use)
    d = decide(VIEWS, records, inv, NOON, limits)
    assert dict(d.desired) == desired
    assert bool(d.paused) is paused
    assert host_state(VIEWS["a"], records["a"], NOON, limits["a"])[0] is phase


def test_a_quota_is_a_line_in_status():
    inv = inventory(a="gpu_hours_per_day = 4")
    limits = host_limits(inv, RUNNING, NOON, QuotaUse({"a": 5 * H}, 5 * H))
    phase, reason = host_state(VIEWS["a"], RUNNING["a"], NOON, limits["a"])
    assert phase is HostPhase.QUOTA
    assert reason == "used 5.00 of its 4 GPU-hours today; usable again at Thu 00:00; 2 worker(s) leaving"
    d = decide(VIEWS, RUNNING, inv, NOON, limits)
    assert not d.paused

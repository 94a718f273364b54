"""Working hours as tables with a fake clock: windows across midnight, whole days,
weekends, margins and both DST changes (eltctl/controller/hours.py)."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from eltctl.controller.hours import (ALWAYS, HoursError, in_window, next_change, parse_hours, show_time, usable,
                                     usable_again)

BERLIN = ZoneInfo("Europe/Berlin")  # 2026: spring forward Sun 29 Mar 02:00->03:00, back Sun 25 Oct 03:00->02:00
UTC = ZoneInfo("UTC")
LAB = ["Mon-Fri 19:00-08:00", "Sat-Sun"]


def at(y: int, mo: int, d: int, h: int = 0, mi: int = 0, tz=BERLIN, fold: int = 0) -> float:
    return datetime(y, mo, d, h, mi, tzinfo=tz, fold=fold).timestamp()


# 2026-11-23 is a Monday.
IN_WINDOW = [
    # spec, local time, expected
    (LAB, (2026, 11, 23, 12, 0), False),  # Monday noon: office hours
    (LAB, (2026, 11, 23, 19, 0), True),  # Monday 19:00: the window opens (start inclusive)
    (LAB, (2026, 11, 23, 18, 59), False),
    (LAB, (2026, 11, 24, 7, 59), True),  # Tuesday 07:59: Monday's window, past midnight
    (LAB, (2026, 11, 24, 8, 0), False),  # Tuesday 08:00: closed (end exclusive)
    (LAB, (2026, 11, 28, 7, 0), True),  # Saturday 07:00: Friday's overnight window and Saturday
    (LAB, (2026, 11, 28, 12, 0), True),  # Saturday noon: whole day
    (LAB, (2026, 11, 29, 23, 59), True),  # Sunday night
    (LAB, (2026, 11, 30, 3, 0), False),  # Monday 03:00: Sunday's window is the whole day, not overnight
    (["Fri 19:00-08:00"], (2026, 11, 28, 7, 0), True),  # belongs to Friday
    (["Fri 19:00-08:00"], (2026, 11, 27, 7, 0), False),  # Friday morning: Thursday has no window
    (["22:00-06:00"], (2026, 11, 25, 23, 0), True),  # every day
    (["22:00-06:00"], (2026, 11, 25, 6, 0), False),
    (["Mon 00:00-24:00"], (2026, 11, 23, 23, 59), True),
    (["Mon 00:00-24:00"], (2026, 11, 24, 0, 0), False),
    (["Fri-Mon"], (2026, 11, 30, 12, 0), True),  # a range over the weekend wraps
    (["Fri-Mon"], (2026, 11, 24, 12, 0), False),
    (["Mon,Wed"], (2026, 11, 25, 12, 0), True),
    ("always", (2026, 11, 25, 12, 0), True),
    (["12:00:30-12:01:00"], (2026, 11, 25, 12, 0), False),  # seconds, where they matter
]


@pytest.mark.parametrize("spec, local, expected", IN_WINDOW)
def test_in_window(spec, local, expected):
    assert in_window(parse_hours(spec), BERLIN, at(*local)) is expected


NEXT_CHANGE = [
    # spec, now (local), next flip (local)
    (LAB, (2026, 11, 23, 12, 0), (2026, 11, 23, 19, 0)),  # usable again at Mon 19:00
    (LAB, (2026, 11, 23, 20, 0), (2026, 11, 24, 8, 0)),  # closes Tue 08:00
    (LAB, (2026, 11, 27, 20, 0), (2026, 11, 30, 0, 0)),  # Friday night through the weekend to Monday 00:00
    (LAB, (2026, 11, 27, 12, 0), (2026, 11, 27, 19, 0)),
    (["Sat-Sun"], (2026, 11, 24, 12, 0), (2026, 11, 28, 0, 0)),  # "usable again at Sat 00:00"
    (["Mon-Sun 00:00-24:00", "Fri 19:00-08:00"], (2026, 11, 24, 12, 0), None),  # never closes
]


@pytest.mark.parametrize("spec, now, expected", NEXT_CHANGE)
def test_next_change(spec, now, expected):
    got = next_change(parse_hours(spec), BERLIN, at(*now))
    assert got == (at(*expected) if expected else None)


def test_a_window_to_the_second():
    spec = parse_hours(["Wed 12:00:30-12:01:00"])
    t = at(2026, 11, 25, 12, 0)
    assert next_change(spec, BERLIN, t) == t + 30
    assert show_time(t + 30, BERLIN, t) == "Wed 12:00:30"


def test_always_never_changes():
    assert next_change(ALWAYS, BERLIN, at(2026, 3, 29, 1, 30)) is None
    assert in_window(ALWAYS, BERLIN, at(2026, 3, 29, 2, 30))


def test_usable_again_reads_as_a_day_and_a_time():
    spec = parse_hours(["Sat-Sun"])
    now = at(2026, 11, 24, 12, 0)
    assert show_time(usable_again(spec, BERLIN, now), BERLIN, now) == "Sat 00:00"


# ---------------------------------------------------------------- daylight saving time

def test_spring_forward_a_window_in_the_skipped_hour_is_empty_that_day():
    spec = parse_hours(["Sun 02:00-03:00"])
    # 01:59 CET, then 03:00 CEST: no moment of that Sunday is in the window
    assert not in_window(spec, BERLIN, at(2026, 3, 29, 1, 59))
    assert not in_window(spec, BERLIN, at(2026, 3, 29, 3, 0))
    t = at(2026, 3, 29, 1, 0)
    flip = next_change(spec, BERLIN, t)
    assert flip == at(2026, 4, 5, 2, 0)  # next Sunday's window, a week on
    # on a normal Sunday the same window is an hour long
    assert in_window(spec, BERLIN, at(2026, 4, 5, 2, 30))


def test_spring_forward_a_window_ending_in_the_gap_ends_at_the_change():
    spec = parse_hours(["Sun 01:00-02:30"])
    start = at(2026, 3, 29, 1, 0)
    assert in_window(spec, BERLIN, start + 1800)
    end = next_change(spec, BERLIN, start)
    assert end == at(2026, 3, 29, 3, 0)  # the change itself: 01:00 UTC
    assert end - start == 3600.0  # an hour of wall clock, an hour of real time


def test_spring_forward_an_overnight_window_is_an_hour_shorter():
    spec = parse_hours(["Sat 22:00-06:00"])
    opens = at(2026, 3, 28, 22, 0)
    assert next_change(spec, BERLIN, opens) - opens == 7 * 3600.0


def test_autumn_the_repeated_hour_is_in_the_window_twice():
    spec = parse_hours(["Sun 02:00-03:00"])
    first = at(2026, 10, 25, 2, 30, fold=0)  # 02:30 CEST
    second = at(2026, 10, 25, 2, 30, fold=1)  # 02:30 CET, an hour later
    assert second - first == 3600.0
    assert in_window(spec, BERLIN, first) and in_window(spec, BERLIN, second)
    opens = at(2026, 10, 25, 2, 0, fold=0)
    assert next_change(spec, BERLIN, opens) - opens == 2 * 3600.0  # both runs of the hour
    assert not in_window(spec, BERLIN, at(2026, 10, 25, 3, 0))


def test_autumn_an_overnight_window_is_an_hour_longer():
    spec = parse_hours(["Sat 22:00-06:00"])
    opens = at(2026, 10, 24, 22, 0)
    assert next_change(spec, BERLIN, opens) - opens == 9 * 3600.0


def test_a_window_closing_at_the_repeated_hour_closes_at_its_first_run():
    spec = parse_hours(["Sat 20:00-02:30"])
    opens = at(2026, 10, 24, 20, 0)
    assert next_change(spec, BERLIN, opens) == at(2026, 10, 25, 2, 30, fold=0)


def test_the_zone_decides():
    spec = parse_hours(["Mon-Fri 09:00-17:00"])
    t = at(2026, 11, 23, 8, 30, tz=UTC)  # 09:30 in Berlin, 08:30 in UTC
    assert in_window(spec, BERLIN, t) and not in_window(spec, UTC, t)


# ---------------------------------------------------------------- the margin

MARGIN = [
    # now (local), margin s, usable
    ((2026, 11, 24, 7, 0), 0.0, True),
    ((2026, 11, 24, 7, 0), 30 * 60.0, True),
    ((2026, 11, 24, 7, 40), 30 * 60.0, False),  # 20 minutes left: leave now
    ((2026, 11, 24, 7, 30), 30 * 60.0, False),  # exactly the margin left
    ((2026, 11, 24, 9, 0), 0.0, False),
]


@pytest.mark.parametrize("now, margin, expected", MARGIN)
def test_margin_leaves_before_the_window_closes(now, margin, expected):
    assert usable(parse_hours(LAB), BERLIN, at(*now), margin) is expected


def test_usable_again_after_a_margin_is_the_next_opening():
    t = at(2026, 11, 24, 7, 40)
    assert usable_again(parse_hours(LAB), BERLIN, t, 30 * 60.0) == at(2026, 11, 24, 19, 0)


# ---------------------------------------------------------------- reading

BAD = [
    ("Moonday", "unknown day"),
    ("Mon 25:00-10:00", "not a time of day"),
    ("Mon 10:00-10:00", "same time"),
    ("Mon 24:00-02:00", "cannot start at 24:00"),
    ("nights", "unknown day"),
    ([], "never allows"),
]


@pytest.mark.parametrize("text, says", BAD)
def test_bad_windows_say_what_is_wrong(text, says):
    with pytest.raises(HoursError, match=says):
        parse_hours(text)

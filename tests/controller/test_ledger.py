"""The usage ledger with a fake clock: the daemons' state documents as the controller
reads them, folded into a real usage.db (eltctl/ledger), then read back as `eltctl usage`
reads it.

Plans: a worker's interval is its daemon's start to end, with how it ended; the same
observation read twice (or by a second controller) counts once; a controller that dies
with an interval open is continued or closed by the next one (from the daemon's
history, or at the last sighting when the host is gone for good); a host clock a
minute ahead; planned leaves take the controller's reason; --by groupings, the JSON
shape, the timeline and the sparklines.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from eltctl.controller.observe import Observer, seen_state
from eltctl.controller.policy import HostPhase, HostRecord, Limit
from eltctl.inventory import parse_inventory
from eltctl.ledger import figures, open_reader
from eltctl.ledger.recorder import GONE_AFTER_S, UsageRecorder, how_ended
from eltctl.probe import Gpu, GpuReport, GpuUse, HostReport, HostState
from eltctl.statusview.usage import render_charts, render_timeline, sparkline
from eltctl_runtime.protocol import history_entry

INV_TEXT = ('[job]\nname = "j"\ncommand = "python t.py"\n[policy]\nhang_timeout = 10\nwatch_interval = 0.5\n'
            '[[hosts]]\nname = "a"\naddress = "a.lab"\n'
            '[[hosts]]\nname = "b"\naddress = "b.lab"\n')
INV = parse_inventory(INV_TEXT, "hosts.toml")
T0 = 1_700_000_000.0


def gpu(index: int, use: str, reason: str = "") -> GpuReport:
    return GpuReport(Gpu(index, f"GPU-{index}", "T4", 0, 15000, 0), GpuUse(use), reason)


def running(wid: str, start: float) -> dict:
    return {"slot": int(wid.split("/")[1]), "worker_id": wid, "pid": 1, "state": "running", "since": start,
            "start": start, "adopted": False, "detail": ""}


def ended(wid: str, start: float, end: float, state: str = "left", why: str = "") -> dict:
    return history_entry(worker_id=wid, slot=int(wid.split("/")[1]), start=start, end=end, state=state, why=why)


class World:
    """What the controller reads of the hosts, on a fake clock; each host's daemon
    rewrites its state document every tick (its clock `skew` seconds off)."""

    def __init__(self, path: Path, skew: float = 0.0) -> None:
        self.path = path
        self.now = T0
        self.skew = skew
        self.obs = Observer()
        self.docs: dict[str, dict] = {}
        self.records: dict[str, HostRecord] = {}
        self.limits: dict[str, Limit] = {}  # the controller's host limits at its last pass
        self.silent: set[str] = set()
        self.status: dict | None = None
        for name in ("a", "b"):
            self.busy(name)

    def busy(self, host: str, *owner_gpus: int) -> None:
        """The probe's view of a host: its two GPUs, those named taken by their owner."""
        self.obs.reports[host] = HostReport(
            name=host, address=f"{host}.lab", state=HostState.OK, reason="",
            gpus=tuple(gpu(i, "busy" if i in owner_gpus else "free", "used by pid 7" if i in owner_gpus else "")
                       for i in (0, 1)))

    def daemon(self, host: str, *, workers=(), history=(), phase: str = "running") -> None:
        self.docs[host] = {"phase": phase, "workers": list(workers), "history": list(history),
                           "gpus": [{"index": 0, "state": "free"}, {"index": 1, "state": "free"}], "health": "ok"}

    def read(self) -> None:
        """One controller read: every daemon that is not silent has rewritten its document."""
        for host, doc in self.docs.items():
            if host in self.silent:
                continue
            doc = {**doc, "time": self.now + self.skew}
            self.obs.seen[host] = seen_state(self.obs.seen.get(host), json.dumps(doc).encode(), self.now)
        # rank 0 rewrote its status just now (`seen`: when the controller saw it change)
        self.obs.runtime_status = {**self.status, "seen": self.now} if self.status else None

    def run(self, rec: UsageRecorder, until: float, step: float = 1.0) -> None:
        while self.now < until:
            self.now = min(until, self.now + step)
            self.read()
            rec.record(self.now, INV, self.obs, self.records, self.limits)

    def recorder(self) -> UsageRecorder:
        return UsageRecorder(self.path, "j").open()


def rows(path: Path) -> list[tuple]:
    conn = open_reader(path)
    try:
        return conn.execute("SELECT worker_id, host, slot, start, end, how, exact FROM intervals "
                            "ORDER BY worker_id").fetchall()
    finally:
        conn.close()


def doc(path: Path, until: float, live: bool = False, by: str = "host", since: float = T0 - 3600) -> dict:
    conn = open_reader(path)
    try:
        return figures.usage(conn, since=since, until=until, live=live, by=by)
    finally:
        conn.close()


@pytest.fixture
def world(tmp_path):
    return World(tmp_path / "usage.db")


# ---------------------------------------------------------------- intervals


def test_an_interval_runs_from_the_daemons_start_to_its_end_with_how_it_ended(world):
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    world.run(rec, T0 + 60)
    world.daemon("a", history=[ended("a/0/1", T0, T0 + 61.5, why="yield")])
    world.run(rec, T0 + 70)
    rec.close(world.now)
    assert rows(world.path) == [("a/0/1", "a", 0, T0, T0 + 61.5, "yield", 1)]
    d = doc(world.path, T0 + 70)
    assert d["total"]["gpu_seconds"] == pytest.approx(61.5)
    assert d["total"]["gpu_hours"] == pytest.approx(61.5 / 3600, abs=1e-6)
    assert d["total"]["yields"] == 1 and d["total"]["ended"] == {"yield": 1}


def test_an_open_interval_counts_up_to_now_while_the_controller_runs(world):
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0), running("a/1/2", T0 + 10)])
    world.run(rec, T0 + 100)
    per, total = rec.gpu_seconds(T0 + 100)
    assert per == {"a": pytest.approx(190.0)} and total == pytest.approx(190.0)
    # Since a per-host time (the host's midnight): only what came after it.
    per, total = rec.gpu_seconds(T0 + 100, {"a": T0 + 50, "b": T0})
    assert per == {"a": pytest.approx(100.0)}
    world.daemon("b", workers=[running("b/0/3", T0 + 100)])
    world.run(rec, T0 + 130)
    today, job_total = rec.quota_figures(T0 + 130, {"a": T0 + 120, "b": T0 + 110})
    assert today == {"a": pytest.approx(20.0), "b": pytest.approx(20.0)}
    assert job_total == pytest.approx(250.0 + 30.0)
    rec.close(world.now)


def test_replaying_the_same_observation_counts_it_once(world):
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    world.run(rec, T0 + 30)
    world.daemon("a", history=[ended("a/0/1", T0, T0 + 30, state="crashed")])
    world.read()
    for _ in range(3):
        rec.record(world.now, INV, world.obs, world.records)
    rec.close(world.now)
    # A second controller reading the very same documents again changes nothing.
    again = world.recorder()
    again.record(world.now, INV, world.obs, world.records)
    again.close(world.now)
    assert rows(world.path) == [("a/0/1", "a", 0, T0, T0 + 30, "crash", 1)]
    assert doc(world.path, T0 + 40)["total"]["gpu_seconds"] == pytest.approx(30)


def test_a_restart_closes_an_interval_left_open_from_the_daemons_history(world):
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    world.daemon("b", workers=[running("b/1/1", T0)])
    world.run(rec, T0 + 35)
    del rec  # the controller dies: no close, its last pass committed
    assert [r[4] for r in rows(world.path)] == [None, None]
    # While no controller ran, a's worker ended (its daemon kept the history) and b went away.
    world.daemon("a", history=[ended("a/0/1", T0, T0 + 50, why="planned")])
    world.silent.add("b")
    world.now = T0 + 200
    rec = world.recorder()
    world.run(rec, T0 + 200 + GONE_AFTER_S + 5)
    rec.close(world.now)
    a, b = rows(world.path)
    assert a == ("a/0/1", "a", 0, T0, T0 + 50, "planned", 1)
    # b: closed at its last sighting (the last heartbeat written, 10 s at most before the death), inferred.
    assert b[0] == "b/1/1" and T0 + 25 <= b[4] <= T0 + 35 and b[5] == "lost" and b[6] == 0


def test_a_restart_continues_an_interval_whose_worker_still_runs(world):
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    world.run(rec, T0 + 20)
    del rec
    world.now = T0 + 60
    rec = world.recorder()
    world.run(rec, T0 + 100)
    world.daemon("a", history=[ended("a/0/1", T0, T0 + 101, state="finished")])
    world.run(rec, T0 + 105)
    rec.close(world.now)
    assert rows(world.path) == [("a/0/1", "a", 0, T0, T0 + 101, "finished", 1)]


def test_an_inferred_end_is_corrected_by_a_later_exact_one(world):
    rec = world.recorder()
    world.daemon("b", workers=[running("b/0/1", T0)])
    world.run(rec, T0 + 10)
    world.silent.add("b")
    world.run(rec, T0 + 10 + GONE_AFTER_S + 2)
    assert rows(world.path)[0][5:] == ("lost", 0)
    world.silent.clear()  # the host is back: its daemon's history says when the worker really ended
    world.daemon("b", history=[ended("b/0/1", T0, T0 + 90, why="yield")])
    world.run(rec, world.now + 2)
    rec.close(world.now)
    assert rows(world.path) == [("b/0/1", "b", 0, T0, T0 + 90, "yield", 1)]


def test_a_host_clock_a_minute_ahead_is_corrected_and_lengths_are_exact(tmp_path):
    world = World(tmp_path / "usage.db", skew=60.0)
    rec = world.recorder()
    world.daemon("a")  # the offset is learnt from documents seen changing
    world.run(rec, T0 + 5)
    world.daemon("a", workers=[running("a/0/1", T0 + 5 + 60)])
    world.run(rec, T0 + 40)
    world.daemon("a", history=[ended("a/0/1", T0 + 5 + 60, T0 + 35 + 60, why="down")])
    world.run(rec, T0 + 45)
    rec.close(world.now)
    (wid, _, _, start, end, how, exact), = rows(world.path)
    assert start == pytest.approx(T0 + 5, abs=1.0) and end - start == pytest.approx(30.0)
    assert how == "down"


@pytest.mark.parametrize("record, limit, how", [
    (HostRecord(removed=True), None, "scale"),
    (HostRecord(removed=True, removed_reason="its checks failed"), None, "removed"),
    (HostRecord(straggler_until=T0 + 1e6), None, "straggler"),
    (HostRecord(), None, "planned"),
    (HostRecord(), Limit(0, HostPhase.OFF_HOURS, "outside its working hours"), "window"),
    (HostRecord(), Limit(0, HostPhase.QUOTA, "used 8 of its 8 GPU-hours today"), "quota"),
    (HostRecord(cordoned=True), Limit(0, HostPhase.CORDONED, "cordoned by `eltctl cordon`"), "cordon"),
    (HostRecord(), Limit(0, HostPhase.DISABLED, "enabled = false"), "disabled"),
])
def test_a_planned_leave_takes_the_controllers_reason_for_its_host(world, record, limit, how):
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    world.run(rec, T0 + 5)
    world.records["a"] = record
    if limit is not None:
        world.limits["a"] = limit
    world.daemon("a", history=[ended("a/0/1", T0, T0 + 6, why="planned")])
    world.run(rec, T0 + 8)
    rec.close(world.now)
    assert rows(world.path)[0][5] == how


@pytest.mark.parametrize("state, why, planned, signal, how", [
    ("left", "yield", "", False, "yield"),
    ("left", "yield", "", True, "signal"),
    ("evicted", "yield", "", False, "yield"),
    ("left", "down", "", False, "down"),
    ("left", "planned", "window", False, "window"),
    ("left", "planned", "", False, "planned"),
    ("finished", "", "", False, "finished"),
    ("finished", "failed", "", False, "failed"),  # restart mode: the script hit max_restarts
    ("crashed", "", "", False, "crash"),
    ("killed", "planned", "quota", False, "quota"),
    ("lost", "", "", False, "lost"),
])
def test_how_a_worker_ended(state, why, planned, signal, how):
    assert how_ended(state, why, planned, signal) == how


# ---------------------------------------------------------------- reading


def _local_midnight_after(t: float) -> float:
    d = datetime.fromtimestamp(t).date() + timedelta(days=1)
    return datetime(d.year, d.month, d.day).timestamp()


def test_figures_by_host_gpu_and_day_and_the_json_shape(tmp_path):
    world = World(tmp_path / "usage.db")
    midnight = _local_midnight_after(T0)
    world.now = midnight - 3600
    rec = world.recorder()
    start = world.now
    world.daemon("a", workers=[running("a/0/1", start), running("a/1/2", start)])
    world.daemon("b", workers=[running("b/0/3", start)])
    world.run(rec, start + 1800, step=5.0)
    world.daemon("a", workers=[running("a/1/2", start)], history=[ended("a/0/1", start, start + 1800, why="yield")])
    world.run(rec, midnight + 1800, step=5.0)  # a/1/2 and b/0/3 run across midnight
    rec.close(world.now)
    until = midnight + 1800
    by_host = doc(world.path, until, live=True, since=start - 60)
    assert set(by_host) == {"job", "since", "until", "live", "by", "total", "rows"}
    assert set(by_host["total"]) == {"gpu_seconds", "gpu_hours", "cpu_slot_hours", "workers", "open", "yields",
                                     "pauses", "paused_s", "ended"}
    assert {r["key"]: r["gpu_hours"] for r in by_host["rows"]} == {"a": pytest.approx(2.0), "b": pytest.approx(1.5)}
    assert by_host["total"]["gpu_hours"] == pytest.approx(3.5) and by_host["total"]["open"] == 2
    assert by_host["total"]["yields"] == 1 and by_host["total"]["pauses"] == 0
    by_gpu = doc(world.path, until, live=True, by="gpu", since=start - 60)
    assert {r["key"]: r["gpu_hours"] for r in by_gpu["rows"]} == {
        "a:0": pytest.approx(0.5), "a:1": pytest.approx(1.5), "b:0": pytest.approx(1.5)}
    by_day = doc(world.path, until, live=True, by="day", since=start - 60)
    days = {r["key"]: r["gpu_hours"] for r in by_day["rows"]}
    assert list(days.values()) == [pytest.approx(2.5), pytest.approx(1.0)]
    assert sorted(days) == [datetime.fromtimestamp(start).date().isoformat(),
                            datetime.fromtimestamp(midnight).date().isoformat()]
    # Without a live controller, an open interval ends at its last sighting (the last heartbeat).
    dead = doc(world.path, until + 7200, live=False, since=start - 60)
    assert dead["total"]["gpu_hours"] == pytest.approx(3.5, abs=0.01)


def test_a_pause_is_a_time_the_job_held_no_gpu(world):
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    world.run(rec, T0 + 10)
    world.daemon("a", history=[ended("a/0/1", T0, T0 + 10, why="planned")])
    world.run(rec, T0 + 40)
    world.daemon("a", workers=[running("a/0/2", T0 + 40)], history=[ended("a/0/1", T0, T0 + 10, why="planned")])
    world.run(rec, T0 + 50)
    rec.close(world.now)
    total = doc(world.path, T0 + 50, live=True, since=T0)["total"]
    assert total["pauses"] == 1 and total["paused_s"] == pytest.approx(30.0)


def test_the_timeline_shows_who_held_each_gpu(world):
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    world.busy("b", 1)
    world.daemon("b")
    world.run(rec, T0 + 100, step=2.0)
    rec.close(world.now)
    conn = open_reader(world.path)
    try:
        tl = figures.timeline(conn, since=T0, until=T0 + 100, live=False, buckets=10)
    finally:
        conn.close()
    assert tl["a"][0] == ["job"] * 10
    assert tl["a"][1] == ["none"] * 10
    assert tl["b"][1] == ["owner"] * 10 and tl["b"][0] == ["none"] * 10
    from rich.console import Console

    console = Console(width=80, record=True, color_system=None)
    console.print(render_timeline(tl, T0, T0 + 100))
    text = console.export_text()
    assert "a GPU 0 │██████████│" in text and "b GPU 1 │▒▒▒▒▒▒▒▒▒▒│" in text and "a GPU 1 │··········│" in text
    assert "█ this job" in text and "▒ its owner" in text and "· nobody" in text


def test_samples_every_ten_seconds_and_the_status_charts(world):
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    for i in range(60):
        world.status = {"world_size": 2 if i < 30 else 4, "samples_per_s": 100.0 * (1 if i < 30 else 2),
                        "step": i, "members": ["a/0/1"]}
        world.run(rec, world.now + 1)
    rec.close(world.now)
    conn = open_reader(world.path)
    try:
        got = figures.samples(conn, T0)
    finally:
        conn.close()
    assert 5 <= len(got) <= 7 and all(b[0] - a[0] >= 10 for a, b in zip(got, got[1:]))
    # 2.5 s a character: 1/4 of the top, none, 2/4, 4/4
    assert sparkline([(0, 1.0), (5, 2.0), (9.5, 4.0)], 0, 10, 4) == "▃ ▅█"
    from rich.console import Console

    console = Console(width=100, record=True, color_system=None)
    console.print(render_charts(got, world.now, width=60))
    text = console.export_text()
    assert "world size" in text and "samples/s" in text and "(max 4)" in text


def test_the_ledger_is_read_while_its_writer_holds_it_open(world):
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    world.run(rec, T0 + 15)
    assert doc(world.path, T0 + 15, live=True)["total"]["workers"] == 1
    rec.close(world.now)


def test_eltctl_usage_prints_the_figures_and_the_timeline(tmp_path):
    (tmp_path / "hosts.toml").write_text(INV_TEXT)
    env_state = tmp_path / "state"
    world = World(env_state / "eltctl" / "j" / "usage.db")
    world.now = __import__("time").time() - 600
    rec = world.recorder()
    start = world.now
    world.daemon("a", workers=[running("a/0/1", start)])
    world.run(rec, start + 300, step=5.0)
    world.daemon("a", history=[ended("a/0/1", start, start + 300, why="yield")])
    world.run(rec, start + 310, step=5.0)
    rec.close(world.now)
    from tests.test_statusview import cli_env

    env = {**cli_env(tmp_path), "COLUMNS": "100"}
    r = subprocess.run([sys.executable, "-m", "eltctl", "usage", "--since", "1h", "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["total"]["gpu_seconds"] == pytest.approx(300) and d["total"]["yields"] == 1
    assert d["live"] is False and d["timeline"]["buckets"] == 120 and set(d["timeline"]["hosts"]) == {"a", "b"}
    r = subprocess.run([sys.executable, "-m", "eltctl", "usage", "--since", "1h", "--by", "gpu"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "0.08 GPU-hours" in r.stdout and "a:0" in r.stdout and "a GPU 0 │" in r.stdout, r.stdout
    assert all(len(line) <= 100 for line in r.stdout.splitlines()), r.stdout
    bad = subprocess.run([sys.executable, "-m", "eltctl", "usage", "--by", "week"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and "--by must be one of host, gpu, day" in bad.stderr


def test_eltctl_usage_without_a_ledger_says_why(tmp_path):
    (tmp_path / "hosts.toml").write_text(INV_TEXT)
    from tests.test_statusview import cli_env

    r = subprocess.run([sys.executable, "-m", "eltctl", "usage"], cwd=tmp_path, env=cli_env(tmp_path),
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "no usage ledger at" in r.stderr and "eltctl up" in r.stderr


def test_a_damaged_ledger_file_is_an_error_with_a_fix(tmp_path):
    path = tmp_path / "usage.db"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(Exception) as exc:
        open_reader(path)
    assert "cannot read the usage ledger" in str(exc.value) and "moved away" in str(exc.value)
    with pytest.raises(sqlite3.DatabaseError):
        UsageRecorder(path, "j").open()


def test_status_watch_draws_the_last_hours_world_size_and_speed(tmp_path):
    import signal
    import time

    from tests.test_statusview import COUNTED_READS, TRAINING, cli_env, state_dir, write_inventory

    write_inventory(tmp_path)
    d = state_dir(tmp_path)
    (d / "status.json").write_text(json.dumps({**TRAINING, "updated": time.time()}))
    world = World(d / "usage.db")
    world.now = time.time() - 600
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", world.now)])
    for i in range(50):
        world.status = {"world_size": 3 if i < 25 else 6, "samples_per_s": 250.0 + i, "step": i,
                        "members": ["a/0/1"]}
        world.run(rec, world.now + 10, step=10.0)
    rec.close(world.now)
    views = tmp_path / "views"  # a dot per read of the status document (COUNTED_READS)
    proc = subprocess.Popen([sys.executable, "-c", COUNTED_READS, "status", "--watch"], cwd=tmp_path,
                            env={**cli_env(tmp_path), "ELTSIM_VIEWS": str(views)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    def past_the_first_draw() -> bool:  # a second view began: the first (ledger charts and all) is drawn
        return views.exists() and len(views.read_text()) >= 2

    try:
        deadline = time.monotonic() + 120  # a loaded machine starts Python slowly
        while not past_the_first_draw() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "world size" in out and "samples/s" in out and "(max 6)" in out and "█" in out, out[-3000:]


def test_eltctl_usage_imports_neither_torch_nor_asyncssh(tmp_path):
    (tmp_path / "hosts.toml").write_text(INV_TEXT)
    from tests.test_statusview import cli_env

    world = World(tmp_path / "state" / "eltctl" / "j" / "usage.db")
    world.recorder().close(world.now)
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "eltctl", "usage"], cwd=tmp_path,
                       env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "sqlite3" in imported and not imported & {"torch", "asyncssh", "numpy"}


def test_a_cpu_hosts_slots_count_as_cpu_slot_hours_not_gpu_hours(tmp_path):
    inv = parse_inventory('[job]\nname = "j"\ncommand = "python t.py"\n'
                          '[[hosts]]\nname = "c"\naddress = "c.lab"\nslots = 2\n', "hosts.toml")
    obs = Observer()
    obs.reports["c"] = HostReport(name="c", address="c.lab", state=HostState.CPU_ONLY, reason="no nvidia-smi")
    rec = UsageRecorder(tmp_path / "usage.db", "j").open()
    now = T0
    while now < T0 + 60:
        now += 1.0
        state = {"time": now, "phase": "running", "gpus": [], "health": "ok",
                 "workers": [running("c/0/1", T0)] if now < T0 + 30 else [],
                 "history": [] if now < T0 + 30 else [ended("c/0/1", T0, T0 + 30, why="down")]}
        obs.seen["c"] = seen_state(obs.seen.get("c"), json.dumps(state).encode(), now)
        rec.record(now, inv, obs, {})
    assert rec.gpu_seconds(now) == ({}, 0.0)
    rec.close(now)
    total = doc(tmp_path / "usage.db", now, since=T0)["total"]
    assert total["gpu_hours"] == 0 and total["cpu_slot_hours"] == pytest.approx(30 / 3600, abs=1e-6)


def test_a_document_the_ledger_cannot_read_never_stops_the_controller(world, caplog):
    rec = world.recorder()
    world.daemon("a", workers=[{"worker_id": "a/x/1", "slot": "not a number", "state": "running"}])
    world.run(rec, T0 + 3)  # logged once, no exception
    world.daemon("a", workers=[running("a/0/2", T0 + 3)])
    world.run(rec, T0 + 10)
    rec.close(world.now)
    assert [r[0] for r in rows(world.path)] == ["a/0/2"]
    assert sum("could not be written" in r.message for r in caplog.records) == 1


def test_the_quotas_figures_count_each_host_from_its_own_local_midnight(world):
    """The controller's quota provider (controller/__main__.py `ledger_quotas`): a host
    in Tokyo starts its day nine hours before a host on UTC."""
    from eltctl.controller.__main__ import ledger_quotas

    inv = parse_inventory(INV_TEXT.replace('address = "a.lab"\n', 'address = "a.lab"\ntimezone = "Asia/Tokyo"\n')
                          .replace('address = "b.lab"\n', 'address = "b.lab"\ntimezone = "UTC"\n'), "hosts.toml")
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    world.daemon("b", workers=[running("b/0/2", T0)])
    tokyo_midnight = T0 + 60_400  # 2023-11-16 00:00 in Tokyo (T0: 2023-11-15 07:13:20 there)
    utc_midnight = T0 + 6_400  # 2023-11-15 00:00 UTC
    world.run(rec, T0 + 61_000, step=200.0)
    use = ledger_quotas(rec, inv)(T0 + 61_000)
    assert use.today == {"a": pytest.approx(T0 + 61_000 - tokyo_midnight),
                         "b": pytest.approx(T0 + 61_000 - utc_midnight)}
    assert use.total == pytest.approx(2 * 61_000)
    rec.close(world.now)


def test_the_timeline_calls_a_cpu_hosts_rows_slots(world):
    world.obs.reports["a"] = HostReport(name="a", address="a.lab", state=HostState.CPU_ONLY, reason="")
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", T0)])
    world.docs["a"]["gpus"] = []
    world.run(rec, T0 + 20, step=2.0)
    rec.close(world.now)
    conn = open_reader(world.path)
    try:
        tl = figures.timeline(conn, since=T0, until=T0 + 20, live=False, buckets=10)
        kinds = figures.slot_kinds(conn)
        first = figures.first_seen(conn)
    finally:
        conn.close()
    assert kinds == {"a": "cpu"} and first == pytest.approx(T0 + 2, abs=2)
    from rich.console import Console

    console = Console(width=80, record=True, color_system=None)
    console.print(render_timeline(tl, T0, T0 + 20, kinds=kinds))
    text = console.export_text()
    assert "a slot 0 │" in text and "a GPU" not in text and "b GPU 0  │" in text, text


def test_eltctl_usage_of_a_job_younger_than_its_window_spreads_the_timeline_over_its_life(tmp_path):
    (tmp_path / "hosts.toml").write_text(INV_TEXT)
    world = World(tmp_path / "state" / "eltctl" / "j" / "usage.db")
    world.now = __import__("time").time() - 120  # a job of two minutes, under the default 7 days
    rec = world.recorder()
    world.daemon("a", workers=[running("a/0/1", world.now)])
    world.run(rec, world.now + 100, step=5.0)
    rec.close(world.now)
    from tests.test_statusview import cli_env

    r = subprocess.run([sys.executable, "-m", "eltctl", "usage"], cwd=tmp_path, env={**cli_env(tmp_path),
                       "COLUMNS": "100"}, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("a GPU 0"))
    assert row.count("█") >= 40, r.stdout  # most of the row, not one character of seven days

"""The usage ledger end to end on real sshd hosts: its GPU-seconds are the workers' lives.

Plan: `up` on two simulated GPU hosts (1 GPU each, two CPU workers). The controller
is SIGKILLed, and while none runs another user's process appears on h2's GPU 0: that
worker leaves (an owner yield, its daemon's own doing). `up` starts a new controller,
which closes that interval from the daemon's history. The owner's process ends: a
new worker joins on that GPU. `down`.

Meanwhile the test measures every worker's life on its own, from the kernel: each
worker process's start time in /proc (ticks since boot, placed by CLOCK_BOOTTIME)
and the moment the test sees the process gone (polled every 50 ms); never from the
ledger's sources (the daemons' state documents). Then the ledger (usage.db, read
after the controller exited) has exactly one interval per worker, each as long as
the measured life within 2 %, exact (from the daemons' history), the yield and the
`down` named as how they ended, and `eltctl usage --json` sums them.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time

import pytest

from tests.testbed.jobenv import job_env_on, wait_for, worker_pids

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(600)]

TOLERANCE = 0.02


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


class Lifetimes:
    """Every worker process of the job: its start (the kernel's) and its end (when first
    seen gone or a zombie), polled in a thread."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.start: dict[str, float] = {}
        self.end: dict[str, float] = {}
        self._pids: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")
        # Boot time by this clock (/proc/stat's btime is whole seconds: up to 1 s off).
        self._boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)

    def __enter__(self) -> "Lifetimes":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        last_scan = 0.0
        while not self._stop.is_set():
            now = time.time()
            for wid, pid in list(self._pids.items()):
                if wid in self.end:
                    continue
                st = _stat(pid)
                if st is None or st[0] == "Z":
                    self.end[wid] = now
            if now - last_scan >= 0.5:
                last_scan = now
                for wid, pid in worker_pids(self.job).items():
                    if wid in self._pids:
                        continue
                    st = _stat(pid)
                    if st is not None:
                        self._pids[wid] = pid
                        self.start[wid] = self._boot + int(st[19]) / self._tick
            self._stop.wait(0.05)

    def lives(self) -> dict[str, float]:
        return {w: self.end[w] - s for w, s in self.start.items() if w in self.end}


@pytest.fixture
def job_env(testbed):
    yield from job_env_on(testbed, testbed.add_hosts(2, gpus=1))


def test_the_ledgers_gpu_seconds_are_the_workers_measured_lives(job_env):
    began = time.time()
    with Lifetimes(job_env.job) as measured:
        job_env.eltctl("up")
        st = job_env.training_at(2)
        # Lives of some length: the 2 % then holds more than the polls' own delays (0.1 s each side).
        time.sleep(12)
        victim = next(w for w in worker_pids(job_env.job) if w.startswith("h2/0/"))
        ctl = job_env.controller_pid()
        os.kill(ctl, signal.SIGKILL)
        wait_for(lambda: not os.path.exists(f"/proc/{ctl}") or _stat(ctl)[0] == "Z", 30, "the controller to die")
        h2 = job_env.bed.host("h2")
        owner = h2.start_foreign_process(0, memory_mib=8000, utilization=90)
        wait_for(lambda: victim in measured.end, 60, f"worker {victim} to leave GPU 0 of h2", interval=0.05)
        assert "(started)" in job_env.eltctl("up").stdout
        st = job_env.training_at(1, after_step=st["step"])
        time.sleep(2)  # the owner holds the GPU a while (the timeline shows it)
        h2.stop_foreign_process(owner)
        st = job_env.training_at(2, after_step=st["step"], timeout=120)
        joiner = next(w for w in worker_pids(job_env.job) if w.startswith("h2/0/"))
        assert joiner != victim
        time.sleep(12)
        job_env.eltctl("down")
        wait_for(lambda: set(measured.start) <= set(measured.end), 30, "every worker to be seen gone")
        wait_for(lambda: job_env.controller_pid() is None or not os.path.exists(f"/proc/{job_env.controller_pid()}"),
                 30, "the controller to exit")
    lives = measured.lives()
    assert len(lives) == 3, measured.start

    conn = sqlite3.connect(f"file:{job_env.state_dir / 'usage.db'}?mode=ro", uri=True)
    try:
        raw = conn.execute("SELECT worker_id, start, end, how, exact FROM intervals").fetchall()
        rows = {w: (end - start, how, exact) for w, start, end, how, exact in raw}
    finally:
        conn.close()
    assert set(rows) == set(lives), (rows, lives)
    for wid, life in lives.items():
        held, how, exact = rows[wid]
        print(f"{wid}: measured {life:.3f} s, ledger {held:.3f} s ({how})")
        assert abs(held - life) <= TOLERANCE * life, (wid, held, life)
        assert exact == 1, (wid, how)
    assert rows[victim][1] == "yield"
    assert {rows[w][1] for w in lives if w != victim} == {"down"}
    total = sum(lives.values())
    since = f"{int(time.time() - began) + 2}s"  # the timeline's 120 buckets across the test: ~1 s each
    shown = json.loads(job_env.eltctl("usage", "--since", since, "--json").stdout)
    assert abs(shown["total"]["gpu_seconds"] - total) <= TOLERANCE * total, (shown["total"], total)
    assert shown["total"]["yields"] == 1 and shown["total"]["workers"] == 3 and shown["total"]["open"] == 0
    assert shown["live"] is False
    timeline = shown["timeline"]["hosts"]
    assert "owner" in timeline["h2"]["0"] and "job" in timeline["h1"]["0"] and "job" in timeline["h2"]["0"]

"""Restart mode's watch on the script (runtime/scriptwatch.py): when its checkpoint
directory holds a complete new checkpoint, the restart limit, its output pump."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eltctl_runtime.scriptwatch import CheckpointWatch, OutputPump, RestartLimit, group_pids, listing, writers_under

S = 10**9  # ns


@pytest.mark.parametrize("looks, expect", [
    # (listing, writers, announced, now_ns) per look -> whether each look takes a snapshot
    ([({"a": (1, 1 * S)}, False, False, int(1.1 * S)), ({"a": (1, 1 * S)}, False, False, int(1.2 * S))],
     [False, True]),                                   # young at first, then unchanged since the previous look
    ([({"a": (1, 1 * S)}, False, False, 5 * S)], [True]),  # quiet for QUIET_S: the save is over
    ([({"a": (1, 1 * S)}, True, False, 5 * S), ({"a": (1, 1 * S)}, True, False, 6 * S)],
     [False, False]),                                  # the script holds a file open for writing
    ([({"a": (1, 1 * S)}, False, False, int(1.1 * S)), ({"a": (2, 2 * S)}, False, False, int(2.1 * S))],
     [False, False]),                                  # still changing
    ([({"a": (1, 1 * S)}, True, True, int(1.1 * S))], [True]),  # checkpoint_saved(): taken at once
    ([({}, False, False, 5 * S)], [False]),           # nothing saved yet
])
def test_checkpoint_watch_takes_a_directory_only_when_its_save_is_over(looks, expect):
    watch = CheckpointWatch()
    assert [watch.look(cur, writers, announced, now) for cur, writers, announced, now in looks] == expect


def test_checkpoint_watch_takes_the_same_listing_once():
    watch = CheckpointWatch()
    cur = {"ckpt.pt": (10, 1 * S)}
    assert watch.look(cur, False, now_ns=9 * S)
    watch.taken(cur)
    assert not watch.look(cur, False, now_ns=10 * S) and not watch.look(cur, False, announced=True)


def test_restart_limit_backs_off_and_gives_up_within_its_window():
    limit = RestartLimit(max_restarts=3, window_s=60, backoff_s=1, backoff_cap_s=3)
    assert [limit.backoff([0.0] * n, 1.0) for n in range(5)] == [0, 0, 1, 2, 3]
    assert not limit.gives_up([10, 20], 30) and limit.gives_up([10, 20, 30], 30)
    assert not limit.gives_up([10, 20, 30], 80)  # the first fell out of the window
    assert not RestartLimit(max_restarts=0).gives_up([1] * 100, 2)
    assert limit.message(3, "ValueError: x") == "the script exited 3 times in 1 min; last line: ValueError: x"


def test_writers_are_found_among_the_scripts_processes(tmp_path):
    code = (f"import os,sys,time; f=open({str(tmp_path / 'x.tmp')!r},'wb'); g=open({str(tmp_path / 'r')!r},'rb');"
            "print('ok',flush=True); time.sleep(30)")
    (tmp_path / "r").write_bytes(b"r")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout.readline() == b"ok\n"
        pids = group_pids(proc.pid)
        assert pids == [proc.pid]
        assert writers_under(pids, tmp_path) == [str(tmp_path / "x.tmp")]  # not the file open for reading
        assert set(listing(tmp_path)) == {"x.tmp", "r"}
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_output_pump_passes_lines_through_and_keeps_the_cause(tmp_path, capfd):
    seen = []
    pump = OutputPump(seen.append)
    code = "import sys; print('step 1', flush=True); sys.stderr.write('bar 1/3\\rbar 2/3\\r'); raise KeyError('x')"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pump.attach(proc.stdout, proc.stderr)
    proc.wait()
    pump.join()
    assert "step 1" in seen and "bar 1/3" in seen and "bar 2/3" in seen
    assert pump.cause() == "KeyError: 'x'"
    out, err = capfd.readouterr()
    assert "step 1" in out and "KeyError" in err

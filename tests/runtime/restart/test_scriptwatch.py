"""Restart mode's watch on the script (runtime/scriptwatch.py): when its checkpoint
directory holds a complete new checkpoint, the restart limit, its output pump."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import pytest

from eltctl_runtime.restart.watch import CheckpointWatch, LiveSnapshots, OutputPump, RestartLimit, Stamp, Take, group_pids, listing, writers_under
from eltctl_runtime.restart.snapshots import unpack_dir

S = 10**9  # ns


def st(size: int, mtime_ns: int, ino: int = 1) -> Stamp:
    return Stamp(size, mtime_ns, ino)


W = {"a"}  # the script holds "a" open for writing
N, A = Take.NOW, Take.ATOMIC


@pytest.mark.parametrize("looks, expect", [
    # (listing, writers, announced, now_ns) per look -> what each look decides
    ([({"a": st(1, 1 * S)}, (), False, int(1.1 * S)), ({"a": st(1, 1 * S)}, (), False, int(1.2 * S))],
     [None, N]),                                       # young at first, then unchanged since the previous look
    ([({"a": st(1, 1 * S)}, (), False, 5 * S)], [N]),  # quiet for QUIET_S: the save is over
    ([({"a": st(1, 1 * S)}, W, False, 5 * S), ({"a": st(1, 1 * S)}, W, False, 6 * S)],
     [None, None]),                                    # the script holds a file open for writing
    ([({"a": st(1, 1 * S)}, (), False, int(1.1 * S)), ({"a": st(2, 2 * S)}, (), False, int(2.1 * S))],
     [None, None]),                                    # still changing, in place
    ([({"a": st(1, 1 * S)}, W, True, int(1.1 * S))], [N]),  # checkpoint_saved(): taken at once
    ([({}, (), False, 5 * S)], [None]),               # nothing saved yet
    # an atomic saver: "a" replaced by rename between the looks (a new inode); however
    # young and busy its directory, a consistent moment is looked for at once
    ([({"a": st(1, 1 * S, 1)}, W, False, int(1.1 * S)), ({"a": st(1, 2 * S, 2)}, W, False, int(2.1 * S)),
      ({"a": st(1, 3 * S, 3)}, (), False, int(3.01 * S))], [None, A, A]),
    # the temporary file seen at a look and renamed to its final name by the next
    ([({"a": st(1, 1 * S, 1), "a.tmp": st(5, 2 * S, 2)}, (), False, int(2.1 * S)),
      ({"a": st(5, 2 * S, 2)}, (), False, int(3.1 * S))], [None, A]),
])
def test_checkpoint_watch_takes_a_directory_only_when_its_save_is_over(looks, expect):
    watch = CheckpointWatch()
    assert [watch.look(cur, writers, announced, now) for cur, writers, announced, now in looks] == expect


@pytest.mark.parametrize("looks, atomic", [
    ([{"a": st(1, 1, 1)}, {"a": st(1, 2, 2)}], True),                     # replaced by rename
    ([{"a": st(1, 1, 1)}, {"a": st(2, 2, 1)}], False),                    # rewritten in place
    ([{"a": st(1, 1, 1)}, {"a": st(1, 2, 2)}, {"a": st(1, 3, 2)}], False),  # renames, then in place now
    ([{"a": st(1, 1, 1)}, {"a": st(1, 2, 2)}, {"a": st(1, 3, 2)}, {"a": st(1, 4, 3)}], True),  # renames again
    ([{"a": st(1, 1, 1)}, {"b": st(1, 1, 1)}], True),                     # a.tmp -> b
    ([{"a": st(1, 1, 1)}, {"b": st(1, 5, 1)}], False),                    # an inode reused for a new file
    ([{"a": st(1, 1, 1)}, {"a": st(1, 1, 1), "b": st(1, 5, 1)}], False),  # a new file: nothing learnt
])
def test_checkpoint_watch_tells_atomic_savers_from_in_place_writers(looks, atomic):
    watch = CheckpointWatch()
    for cur in looks:
        watch.look(cur, ())
    assert watch.atomic is atomic


def test_a_file_still_being_written_at_the_last_look_is_not_an_in_place_rewrite():
    watch = CheckpointWatch()
    watch.look({"a": st(1, 1, 1), "a.tmp": st(1, 1, 2)}, {"a.tmp"})
    watch.look({"a": st(1, 3, 3), "a.tmp": st(9, 2, 2)}, ())  # a renamed over; a.tmp grew while open
    assert watch.atomic
    watch.unpacked({"a": st(1, 5, 7)})  # a snapshot unpacked: new inodes everywhere, nothing learnt
    assert watch.look({"a": st(1, 5, 7)}, ()) is None and watch.previous == {"a": st(1, 5, 7)}


def test_checkpoint_watch_takes_the_same_listing_once():
    watch = CheckpointWatch()
    cur = {"ckpt.pt": st(10, 1 * S)}
    assert watch.look(cur, (), now_ns=9 * S) is N
    watch.taken(cur)
    assert watch.look(cur, (), now_ns=10 * S) is None and watch.look(cur, (), announced=True) is None


# A script that saves its checkpoint every 0.1 s as DDP scripts do: torch.save to a
# temporary name, then os.replace. The checkpoint carries its own hash (whole or torn).
FREQUENT_SAVER = """
import hashlib, os, sys, time
d = sys.argv[1]
for step in range(1, 601):
    body = str(step).encode().ljust(16) * 16384
    with open(os.path.join(d, "ckpt.pt.tmp"), "wb") as f:
        f.write(hashlib.sha256(body).digest())
        for i in range(0, len(body), 65536):
            f.write(body[i:i + 65536])
    os.replace(os.path.join(d, "ckpt.pt.tmp"), os.path.join(d, "ckpt.pt"))
    print(step, flush=True)
    time.sleep(0.1)
"""


def test_a_script_saving_every_tenth_of_a_second_is_snapshotted_while_it_runs(tmp_path):
    """The directory of a frequent saver is never quiet for QUIET_S nor the same at two
    looks, yet the watch, looking every 0.3 s as the supervisor does, takes whole
    checkpoints of it while it runs, newer each time, and leaves no capture behind."""
    d = tmp_path / "ckpt"
    d.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", FREQUENT_SAVER, str(d)], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == b"1"

        def writers() -> list[str]:
            return [os.path.relpath(w, d.resolve()) for w in writers_under(group_pids(proc.pid), d)]

        watch, snaps = CheckpointWatch(), LiveSnapshots(d, lambda: bool(writers()))
        tars = []
        while len(tars) < 3 and proc.poll() is None:
            time.sleep(0.3)
            current = listing(d)
            how = watch.look(current, writers() if current else [])
            got = snaps.take(how, current, watch.last_taken) if how is not None else None
            if got is not None and proc.poll() is None:
                watch.taken(got[0])
                tars.append(got[1])
        assert proc.poll() is None, "the saver ended before three snapshots were taken while it ran"
        assert watch.atomic
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    steps = []
    for i, data in enumerate(tars):
        out = tmp_path / f"u{i}"
        unpack_dir(data, out)
        assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt"]  # never the temporary file
        raw = (out / "ckpt.pt").read_bytes()
        assert hashlib.sha256(raw[32:]).digest() == raw[:32], f"snapshot {i} holds a torn checkpoint"
        steps.append(int(raw[32:48]))
    assert steps == sorted(set(steps)), steps  # a newer save each time
    assert not list(tmp_path.glob(".ckpt.capture-*"))


def test_live_snapshots_pack_the_directory_itself_where_links_are_refused(tmp_path):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "x").write_bytes(b"x" * 100)
    os.symlink("sub/x", d / "latest")
    current = listing(d)
    assert set(current) == {"sub/x", "latest"}
    for links in (True, False):
        got = LiveSnapshots(d, lambda: False, links=links).take(Take.NOW, current, None)
        assert got is not None and got[0] == current
        unpack_dir(got[1], tmp_path / f"out-{links}")
        assert os.readlink(tmp_path / f"out-{links}" / "latest") == "sub/x"
        assert (tmp_path / f"out-{links}" / "sub" / "x").read_bytes() == b"x" * 100
    (d / "sub" / "x").write_bytes(b"y")  # changed since the look judged it: not taken
    assert LiveSnapshots(d, lambda: False).take(Take.NOW, current, None) is None


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
    pump.join(timeout=60)  # join's 2 s is the supervisor's bound; a loaded CI run's copy took longer once
    assert "step 1" in seen and "bar 1/3" in seen and "bar 2/3" in seen
    assert pump.cause() == "KeyError: 'x'"
    out, err = capfd.readouterr()
    assert "step 1" in out and "KeyError" in err

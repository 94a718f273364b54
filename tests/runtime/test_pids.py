"""One meaning of "this pid is alive" (runtime/pids.py): exists and is not a zombie."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from eltctl_runtime.pids import pid_alive, read_pid_file


def test_a_live_process_is_alive_and_a_reaped_one_is_not():
    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not pid_alive(p.pid)


def test_a_zombie_is_dead():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # exited, not yet reaped: a zombie
            with open(f"/proc/{p.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        else:
            pytest.fail("the child never became a zombie")
        assert not pid_alive(p.pid)
    finally:
        p.wait()


@pytest.mark.parametrize("pid", [None, 0, -1])
def test_no_pid_is_not_alive(pid):
    assert not pid_alive(pid)


def test_another_users_process_is_alive():
    assert pid_alive(1)  # init: signal 0 may be refused, it exists


@pytest.mark.parametrize("text, pid", [("123\n", 123), ("123 ws1/0/1\n", 123), ('{"pid": 7}', 7),
                                       ("", None), ("x", None), ('{"pid": "7"}', None), ('{"pid": true}', None),
                                       ("[1]", None)])
def test_read_pid_file(tmp_path, text, pid):
    (tmp_path / "p").write_text(text)
    assert read_pid_file(tmp_path / "p") == pid


def test_a_missing_pid_file_names_no_pid(tmp_path):
    assert read_pid_file(tmp_path / "none.pid") is None

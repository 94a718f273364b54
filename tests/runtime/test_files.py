"""Atomic writes and JSON state files (runtime/files.py)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from eltctl_runtime.files import fsync_dir, read_json, remove, write_atomic, write_json_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "daemon.memory.json"
    write_atomic(p, "old")
    write_atomic(p, "new\n")
    assert p.read_text() == "new\n"
    write_atomic(p, b"\x00bytes")
    assert p.read_bytes() == b"\x00bytes"
    assert os.listdir(tmp_path) == ["daemon.memory.json"]
    assert stat.S_IMODE(p.stat().st_mode) == 0o600  # a temporary file's mode unless told


def test_write_atomic_mode_and_durable_rename(tmp_path):
    p = tmp_path / "hosts.toml"
    write_atomic(p, "x = 1\n", mode=0o644, sync_dir=True)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644 and p.read_text() == "x = 1\n"
    fsync_dir(tmp_path)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "state.json"
    write_atomic(p, "old")

    def broken(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        write_atomic(p, "new")
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


def test_json_state_files(tmp_path):
    p = tmp_path / "deep" / "status.json"
    with pytest.raises(FileNotFoundError):
        write_json_atomic(p, {"a": 1})
    write_json_atomic(p, {"b": [1, 2], "a": None}, mkdir=True)
    # The controller's status.json format: indent 1, keys in insertion order, a final newline.
    assert p.read_text() == json.dumps({"b": [1, 2], "a": None}, indent=1) + "\n"
    assert read_json(p) == {"b": [1, 2], "a": None}
    write_json_atomic(p, [1], indent=None)
    assert p.read_text() == "[1]\n"


@pytest.mark.parametrize("content", [None, "", "{half", b"\xff\xfe"])
def test_a_missing_or_unreadable_json_file_reads_as_none(tmp_path, content):
    p = tmp_path / "x.json"
    if content is not None:
        p.write_bytes(content.encode() if isinstance(content, str) else content)
    assert read_json(p) is None
    assert read_json(tmp_path) is None  # a directory


def test_remove_tolerates_a_missing_file(tmp_path):
    p = tmp_path / "0.pid"
    p.write_text("1\n")
    remove(p)
    remove(p)
    assert not p.exists()


def test_try_flock_holds_the_lock_until_its_descriptor_closes(tmp_path):
    import os
    import subprocess
    import sys

    from eltctl_runtime.files import try_flock

    lock = tmp_path / "x.lock"
    fd = try_flock(lock, write_pid=True)
    assert fd is not None and lock.read_text() == f"{os.getpid()}\n"
    assert oct(lock.stat().st_mode & 0o777) == oct(0o600)
    other = [sys.executable, "-c", f"from eltctl_runtime.files import try_flock; print(try_flock({str(lock)!r}))"]
    assert subprocess.run(other, capture_output=True, text=True, check=True).stdout.strip() == "None"
    os.close(fd)
    assert subprocess.run(other, capture_output=True, text=True, check=True).stdout.strip() != "None"

"""The controller's state directory: where it is, atomic JSON, the one-controller lock."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from eltctl.controller.statedir import ControllerLock, StateDir, state_root
from eltctl_runtime.files import read_json, write_json_atomic


def test_state_dir_follows_xdg_state_home():
    assert state_root({"XDG_STATE_HOME": "/x/state", "HOME": "/h"}) == Path("/x/state/eltctl")
    assert state_root({"HOME": "/h"}) == Path("/h/.local/state/eltctl")
    assert state_root({"XDG_STATE_HOME": "relative", "HOME": "/h"}) == Path("/h/.local/state/eltctl")
    assert StateDir.for_job("j", {"HOME": "/h"}).socket == Path("/h/.local/state/eltctl/j/control.sock")


def test_atomic_json_and_the_controller_lock(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"x": 1})
    assert read_json(tmp_path / "a.json") == {"x": 1}
    assert read_json(tmp_path / "missing.json") is None
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]  # no temporary file left
    lock = ControllerLock(tmp_path / "controller.lock")
    assert lock.acquire()
    other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from eltctl.controller.statedir import ControllerLock
        print(ControllerLock(Path({str(tmp_path / 'controller.lock')!r})).acquire())""")],
        capture_output=True, text=True, timeout=60)
    assert other.stdout.strip() == "False"  # a second controller of the job does not run
    lock.release()
    assert ControllerLock(tmp_path / "controller.lock").acquire()

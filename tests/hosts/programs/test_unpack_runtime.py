"""The host program `unpack_runtime` (eltctl/hosts/programs/unpack_runtime.py), run as
the controller runs it: `python -c <source> TARGET` with a base64 tar.gz on stdin."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from eltctl.hosts import ops as hostops
from eltctl.hosts import programs


def start(target: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", programs.source("unpack_runtime"), str(target)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_it_unpacks_into_target_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "runtime" / "abc"
    p = start(target)
    _, err = p.communicate(hostops._tar_b64({"__init__.py": b"X = 1\n"}).encode(), timeout=60)
    assert p.returncode == 0, err
    assert (target / "eltctl_runtime" / "__init__.py").read_text() == "X = 1\n"
    assert [q.name for q in target.parent.iterdir()] == ["abc"]


def test_an_existing_target_is_kept_and_the_input_still_read_to_its_end(tmp_path):
    """Another controller (a second job on the lab) shipped the same runtime between our
    probe and this command: it keeps TARGET, but only exits once its input is read. Over
    SSH, a command that ends before the sender writes fails the sender ("Channel not open
    for sending") and the host's daemon start counted as a failure."""
    target = tmp_path / "runtime" / "abc"
    (target / "eltctl_runtime").mkdir(parents=True)
    (target / "eltctl_runtime" / "__init__.py").write_text("kept\n")
    p = start(target)
    try:
        time.sleep(1.0)
        assert p.poll() is None, "it ended before its input was sent"
        _, err = p.communicate(hostops._tar_b64({"__init__.py": b"new\n"}).encode(), timeout=60)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 0, err
    assert (target / "eltctl_runtime" / "__init__.py").read_text() == "kept\n"
    assert [q.name for q in target.parent.iterdir()] == ["abc"]

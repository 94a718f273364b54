"""`eltctl cordon` / `uncordon` without a controller (no SSH). With one: tests/controller/test_hours_sshd.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("verb", ["cordon", "uncordon"])
def test_cordon_without_a_controller_says_how_to_start_one(tmp_path, verb):
    (tmp_path / "hosts.toml").write_text(
        '[job]\nname = "nojob"\ncommand = "python t.py"\n[[hosts]]\nname = "here"\naddress = "local"\n')
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "eltctl", "-i", str(tmp_path / "hosts.toml"),
                        verb, "here"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "no controller runs job nojob" in r.stderr and f"then {verb}" in r.stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "asyncssh", "numpy"}


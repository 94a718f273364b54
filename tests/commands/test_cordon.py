"""`eltctl cordon` / `uncordon` without a controller (no SSH): remembered in hosts.json for the next
controller. With one: tests/controller/test_hours_sshd.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from eltctl.controller.policy import HostRecord


def test_cordon_without_a_controller_is_remembered_for_the_next_up(tmp_path):
    # Issue 25: cordons persist, but `cordon` refused ("no controller runs job") without one.
    (tmp_path / "hosts.toml").write_text(
        '[job]\nname = "nojob"\ncommand = "python t.py"\n[[hosts]]\nname = "here"\naddress = "local"\n')
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}

    def eltctl(*args):
        return subprocess.run([sys.executable, "-X", "importtime", "-m", "eltctl", "-i", str(tmp_path / "hosts.toml"),
                               *args], env=env, capture_output=True, text=True, timeout=60)

    r = eltctl("cordon", "here")
    assert r.returncode == 0, r.stderr
    assert "here: ok cordoned (no controller runs: the next `eltctl up` keeps it out until `eltctl uncordon`)" \
        in r.stdout
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "asyncssh", "numpy"}
    memory = json.loads((tmp_path / "state" / "eltctl" / "nojob" / "hosts.json").read_text())
    assert HostRecord.from_json(memory["hosts"]["here"]).cordoned  # what the next controller reads
    assert "already cordoned" in eltctl("cordon", "here").stdout
    r = eltctl("uncordon", "here", "nosuch")  # an unknown name: the one error format, nothing done
    assert r.returncode == 2 and "error: no host 'nosuch'" in r.stderr, r.stderr
    memory = json.loads((tmp_path / "state" / "eltctl" / "nojob" / "hosts.json").read_text())
    assert HostRecord.from_json(memory["hosts"]["here"]).cordoned
    r = eltctl("uncordon", "here")
    assert r.returncode == 0 and "here: ok uncordoned" in r.stdout, r.stdout + r.stderr
    memory = json.loads((tmp_path / "state" / "eltctl" / "nojob" / "hosts.json").read_text())
    assert not HostRecord.from_json(memory["hosts"]["here"]).cordoned

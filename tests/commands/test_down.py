"""`eltctl down` of a job that never ran (local host, no SSH)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid


def test_down_of_a_job_that_never_ran_checks_the_hosts_and_imports_no_torch(tmp_path):
    job = f"j{uuid.uuid4().hex[:8]}"
    (tmp_path / "hosts.toml").write_text(
        f'[job]\nname = "{job}"\ncommand = "python t.py"\n[[hosts]]\nname = "here"\naddress = "local"\n'
        f'python = "{sys.executable}"\n')
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "eltctl", "-i", str(tmp_path / "hosts.toml"),
                        "down"], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert f"no process of job {job} left on here" in r.stdout
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "rich" in imported and "torch" not in imported and "numpy" not in imported

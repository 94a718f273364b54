"""`eltctl scale`: without a controller (no SSH); a host written into the inventory while
the job trains, on hosts of this machine (issue 50). The same on real sshd hosts:
test_scale_sshd.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from eltctl.controller.policy import HostRecord
from tests.commands.test_up import local_job  # noqa: F401 - the fixture: a job on hosts of this machine
from tests.testbed.hostpython import HOST_PYTHON
from tests.testbed.jobenv import job_pids, wait_for


def test_scale_without_a_controller_says_how_to_start_one(tmp_path):
    (tmp_path / "hosts.toml").write_text(
        '[job]\nname = "nojob"\ncommand = "python t.py"\n[[hosts]]\nname = "here"\naddress = "local"\n')
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "eltctl", "-i", str(tmp_path / "hosts.toml"),
                        "scale", "--add", "here"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "no controller runs job nojob" in r.stderr and "eltctl up" in r.stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "asyncssh", "numpy"}


# --------------------------------------------------------------------------- issue 50: a host added to the file

DID_NOT_REPORT = "its daemon did not report (see its daemon.log)"


def _world_and_forged(lj) -> tuple[int, int, dict]:
    """(world size, forged values counted, the document) from `eltctl status --json`."""
    out, _ = lj.eltctl("status", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    return int(doc.get("world_size") or 0), int((doc.get("forged") or {}).get("total") or 0), doc


def test_a_local_host_written_into_the_file_joins_with_scale_add_alone_and_down_is_clean(local_job):
    # Issue 50, findings 1 and 2: a second local host added to hosts.toml while the job
    # trains got no run id (the keeper wrote it only at its start), its daemon and the
    # job took each other's values for forgeries, and `down` then failed; and
    # `scale --add` refused it ("no host 'here2' in the inventory") until `up` ran.
    local_job.write({"here": HOST_PYTHON})
    # Finding 8: here2's cooldown from an earlier run ("its daemon did not report"),
    # remembered in hosts.json; the person's `up` clears it ("after a fix `eltctl up`
    # retries at once"), so it cannot come back after a cordon and uncordon.
    local_job.state_dir.mkdir(parents=True, mode=0o700)
    stale = HostRecord(cooldown_until=time.time() + 600, failures=1, last_problem=DID_NOT_REPORT)
    (local_job.state_dir / "hosts.json").write_text(json.dumps({"hosts": {"here2": stale.to_json()}}))
    out, _ = local_job.eltctl("up", "--timeout", "240")
    assert out.returncode == 0 and "training: world size 1" in out.stdout, out.stdout + out.stderr

    local_job.write({"here": HOST_PYTHON, "here2": HOST_PYTHON})
    t0 = time.monotonic()
    out, _ = local_job.eltctl("scale", "--add", "here2")  # no `up` in between
    assert out.returncode == 0 and "here2: ok" in out.stdout, out.stdout + out.stderr
    world, forged, doc = wait_for(lambda: (w := _world_and_forged(local_job))[0] == 2 and w, 120,
                                  "here2 to join (world size 2)")
    print(f"scale --add here2 (a host new to the file) -> world size 2 in {time.monotonic() - t0:.1f} s")
    assert forged == 0, doc["forged"]
    run_id = (local_job.state_dir / "run").read_text()
    assert (local_job.root / "home" / "here2" / ".eltctl" / "jobs" / local_job.job / "here2" / "run").read_text() \
        == run_id  # delivered by the keeper before here2's daemon started
    time.sleep(3)  # a few steps together: still nothing forged
    world, forged, doc = _world_and_forged(local_job)
    assert world == 2 and forged == 0, doc["forged"]

    # cordon and uncordon a working host: it comes back, not into an old cooldown
    out, _ = local_job.eltctl("cordon", "here2")
    assert out.returncode == 0, out.stdout + out.stderr
    wait_for(lambda: _world_and_forged(local_job)[0] == 1, 120, "here2 to leave (world size 1)")
    out, _ = local_job.eltctl("uncordon", "here2")
    assert out.returncode == 0, out.stdout + out.stderr
    world, forged, doc = wait_for(lambda: (w := _world_and_forged(local_job))[0] == 2 and w, 120,
                                  "here2 to come back (world size 2)")
    here2 = next(h for h in doc["hosts"] if h["name"] == "here2")
    assert DID_NOT_REPORT not in str(here2.get("last_problem") or ""), here2
    assert forged == 0, doc["forged"]

    # a host in neither the file nor the controller's inventory: a usage error (exit 2)
    out, _ = local_job.eltctl("scale", "--add", "here3")
    assert out.returncode == 2 and "no host 'here3'" in out.stderr, out.stdout + out.stderr

    out, took = local_job.eltctl("down", timeout=180)
    print(f"down took {took:.1f} s")
    assert out.returncode == 0, out.stdout + out.stderr
    assert wait_for(lambda: job_pids(local_job.job) == [], 30, "every process of the job to end")

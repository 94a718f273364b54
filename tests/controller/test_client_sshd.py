"""`eltctl up` on real sshd hosts when the job's workers fail at start: it exits 1 with
the cause (the worker's traceback line) instead of waiting, and a fix of the inventory
or of the code takes effect at the next `up`, with no wait for the failure cooldown.

The cooldown is set long (600 s) so that every bound below is well under it: a message
that came after a cooldown, or a start that waited for one, fails the test.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.testbed.jobenv import wait_for, worker_pids

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(900)]

COOLDOWN_S = 600
BOUND_S = 240  # one probe, a runtime shipped, a daemon and a worker started, on a busy 2-core machine


def _set_command(job_env, old: str, new: str) -> None:
    text = job_env.inventory.read_text()
    assert old in text, text
    job_env.inventory.write_text(text.replace(old, new))


def _up(job_env):
    t0 = time.monotonic()
    r = job_env.eltctl("up", check=False, timeout=BOUND_S + 60)
    return r, time.monotonic() - t0


def test_failures_at_start_are_named_by_up_and_a_fix_takes_effect_at_once(job_env):
    text = job_env.inventory.read_text().replace('cooldown = "2s"', f'cooldown = "{COOLDOWN_S}s"')
    job_env.inventory.write_text(text.replace('"train.py"', '"train.py", "--no-such-flag"'))

    # 1. A script that exits at start with an error (a missing script is caught before
    #    anything starts, by up's own checks: tests/commands/test_up_sshd.py): `up` exits 1
    #    with the script's own last line.
    r, took = _up(job_env)
    out = r.stdout + r.stderr
    print(f"\nup with a script failing at start: exit {r.returncode} after {took:.1f} s")
    assert r.returncode == 1, out + job_env.controller_log()
    assert "failed at start" in out and "unrecognized arguments: --no-such-flag" in out, out
    assert "eltctl logs" in out and "eltctl up" in out, out  # the fix hint
    assert took < BOUND_S, out
    # status.json is rewritten about once a second: wait for the pass that says both
    st = wait_for(lambda: (s := job_env.status()).get("start_failed") and "cooling down" in s.get("message", "")
                  and s, 30, "status.json to say it")
    assert st["start_failed"] and all("--no-such-flag" in c for c in st["start_failed"].values()), st
    hosts = {h["name"]: h for h in st["hosts"]}
    assert all("--no-such-flag" in (h["last_problem"] or "") for h in hosts.values()), hosts
    assert "cooling down after a failure" in st["message"] and "min_workers is 1" in st["message"], st["message"]
    assert "0 slot" not in st["message"], st["message"]
    crash = [e for e in st["events"] if e["kind"] == "crash"]
    assert crash and crash[-1]["at_start"] is True and "--no-such-flag" in crash[-1]["cause"], crash
    # every worker fails at start: one still importing torch on a loaded machine when the first
    # crash put the job in its cooldown fails too; none keeps running
    wait_for(lambda: worker_pids(job_env.job) == {}, 60, "every worker to have failed at start")

    # 2. The inventory is changed to a script that raises at import: tried at once
    #    (the cooldown of step 1 is forgotten), and the exception's line is named.
    #    The import is made at run time (importlib): a plain `import` statement of a missing
    #    module is refused before any worker starts by up's script check (doctor's), and this
    #    step is about a failure at the workers' start.
    (job_env.workdir / "bad.py").write_text("import importlib\nimportlib.import_module('no_such_module_xyz')\n")
    _set_command(job_env, '"train.py", "--no-such-flag"', '"bad.py"')
    r, took = _up(job_env)
    out = r.stdout + r.stderr
    print(f"up with a script raising at import: exit {r.returncode} after {took:.1f} s")
    assert r.returncode == 1, out + job_env.controller_log()
    assert "ModuleNotFoundError: No module named 'no_such_module_xyz'" in out, out
    assert "install the module" in out, out + job_env.controller_log()
    assert took < BOUND_S, out

    # 3. The code is fixed (the inventory unchanged): `up` starts the job at once.
    (job_env.workdir / "bad.py").write_text("import runpy\nrunpy.run_path('train.py', run_name='__main__')\n")
    r, took = _up(job_env)
    out = r.stdout + r.stderr
    print(f"up after the fix: exit {r.returncode} after {took:.1f} s")
    assert r.returncode == 0, out + job_env.controller_log() + job_env.host_logs()
    assert "training: world size" in out, out
    assert took < BOUND_S, out
    st = wait_for(lambda: (s := job_env.status()).get("state") == "training" and s, 60, "training")
    assert st["start_failed"] is None
    assert all(not h["start_failure"] for h in st["hosts"]), json.dumps(st["hosts"])

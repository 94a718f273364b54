"""The mirror as every account that touches it will use it, on real sshd hosts that log
in as accounts of their own (`add_host(login=True)`: eltsim-h1, eltsim-h2), while this
machine (the controller) runs as root: a lab with different uids, or NFS root_squash.

- a directory mirror the controller's account can write but the hosts' cannot:
  `eltctl doctor` and `eltctl up` name each host's account, the path and the fix; `up`
  starts nothing (exit 3);
- forced on anyway (`up --ignore-mirror-check`): training runs, `status` shows the
  permanent error with its fix after the first checkpoint, the copy is not retried;
  both hosts lost, `down --force` reports the mirror at once instead of waiting out a
  flush that cannot succeed (its duration is printed);
- the same mirror made group-shared (chgrp to a group of every account, 2770) passes,
  and a host's copy lands there group-writable;
- an ssh:// mirror whose host key is unknown: the check names its login and the fix.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import time
from pathlib import Path

import pytest
import torch

from eltctl.hosts.fleet import Fleet
from eltctl.inventory import load_inventory
from eltctl.mirror import Mirror, host_place
from eltctl.mirror.check import check_mirror
from eltctl_runtime.checkpoint.store import CheckpointStore
from tests.testbed.jobenv import job_env_on, wait_for
from tests.testbed.procs import LOGIN_GROUP

pytestmark = [pytest.mark.sshd,
              pytest.mark.skipif(os.geteuid() != 0, reason="hosts logging in as accounts of their own need root")]

JOB = "mj"


def unwritable_mirror(testbed) -> Path:
    """A directory root can write and the hosts' accounts can enter but not write."""
    path = testbed.dir / "shared-mirror"
    path.mkdir()
    path.chmod(0o755)
    return path


def run_check(inv, hosts):
    async def main():
        async with Fleet(inv) as fleet:
            return await check_mirror(inv, fleet.transport, [inv.host(h.name) for h in hosts])
    return asyncio.run(main())


def test_doctor_and_up_name_the_hosts_accounts_the_path_and_the_fix(testbed):
    h1, h2 = testbed.add_hosts(2, login=True)
    mirror = unwritable_mirror(testbed)
    gen = job_env_on(testbed, [h1, h2], extra=f'\n[storage]\nmirror = "{mirror}"\n')
    env = next(gen)
    try:
        job_dir = mirror / env.job
        doctor = env.eltctl("doctor", check=False)
        assert doctor.returncode == 3, doctor.stdout + doctor.stderr
        out = " ".join(doctor.stdout.split())  # rich wraps long lines
        for h in ("h1", "h2"):
            assert f"FAIL {h} (eltsim-{h}): account eltsim-{h}" in out, out
        assert f"cannot write {job_dir}" in out and "Permission denied" in out
        assert "same uid as this machine's root" in out and "ssh:// mirror" in out and "chmod 2770" in out
        assert "ok this machine: account root" in out

        up = env.eltctl("up", "--timeout", "60", check=False)
        assert up.returncode == 3, up.stdout + up.stderr
        err = " ".join(up.stderr.split())
        assert f"the checkpoint mirror {mirror} cannot be used as the job would; `eltctl up` started nothing" in err
        assert "h1 (eltsim-h1): account eltsim-h1" in err and "fix: every account that touches the mirror" in err
        assert "--ignore-mirror-check" in err
        assert env.controller_pid() is None and not (env.state_dir / "status.json").exists()
    finally:
        gen.close()


@pytest.mark.slow
def test_forced_on_anyway_status_warns_and_down_does_not_wait_for_the_mirror(testbed):
    h1, h2 = testbed.add_hosts(2, login=True)
    mirror = unwritable_mirror(testbed)
    gen = job_env_on(testbed, [h1, h2], extra=f'\n[storage]\nmirror = "{mirror}"\n')
    env = next(gen)
    try:
        up = env.eltctl("up", "--ignore-mirror-check", "--timeout", "180")
        assert "warning: mirror: h1 (eltsim-h1)" in " ".join(up.stdout.split()), up.stdout
        env.training_at(4)

        def problem():
            m = env.status().get("mirror") or {}
            return m if m.get("problem") else None
        m = wait_for(problem, 120, "the mirror's permanent error in status.json")
        assert m["problem"]["kind"] == "permission" and "same uid" in m["problem"]["fix"]
        assert m["step"] is None and m["failures"] >= 1
        view = " ".join(env.eltctl("status").stdout.split())
        assert "the mirror cannot work (permission)" in view and "fix: every account" in view
        time.sleep(3)  # the next checkpoints (every 25 steps): at most one try each, no back-off retries
        later = env.status()["mirror"]
        committed = later["pending"] or 0
        assert later["failures"] <= 1 + committed // 25, later

        for h in (h1, h2):
            h.crash()
        t0 = time.monotonic()
        down = env.eltctl("down", "--force", timeout=300, check=False)
        took = time.monotonic() - t0
        print(f"\ndown --force, both hosts lost, unwritable directory mirror: {took:.1f} s (exit {down.returncode})")
        text = " ".join(down.stdout.split())
        assert "the mirror cannot work" in text and "fix:" in text, down.stdout + down.stderr
    finally:
        gen.close()


def test_a_group_shared_mirror_passes_and_a_hosts_copy_stays_group_writable(testbed):
    h1, h2 = testbed.add_hosts(2, login=True)
    mirror = testbed.dir / "shared-mirror"
    mirror.mkdir()
    os.chown(mirror, 0, grp.getgrnam(LOGIN_GROUP).gr_gid)  # every account's group, as docs/checkpoints.md says
    mirror.chmod(0o2770)
    inv = load_inventory(testbed.write_inventory(job={"name": JOB}, extra=f'[storage]\nmirror = "{mirror}"\n'))
    found = run_check(inv, [h1, h2])
    assert found is not None and found.ok, found
    assert [f.name for f in found.checks] == ["this machine", "h1 (eltsim-h1)", "h2 (eltsim-h2)"]
    job_dir = mirror / JOB
    assert job_dir.stat().st_mode & 0o7777 == 0o2770 and job_dir.stat().st_gid == mirror.stat().st_gid
    assert [p.name for p in job_dir.iterdir()] == []  # the check leaves nothing

    ckpts = h1.home / ".eltctl" / "jobs" / JOB / "h1" / "checkpoints"
    CheckpointStore(ckpts, keep=3).save(10, {"w": torch.ones(10), "step": 10})
    os.system(f"chown -R eltsim-h1 {h1.home / '.eltctl'}")  # rank 0 on h1 wrote it as its account

    async def copy():
        m = Mirror.from_inventory(inv)
        async with Fleet(inv) as fleet:
            try:
                return await m.mirror_checkpoint(await host_place(await fleet.transport(inv.host("h1")), JOB), 10)
            finally:
                await m.close()

    assert asyncio.run(copy()).verified
    step_dir = job_dir / "step-00000010"
    assert step_dir.stat().st_uid == h1_uid(h1) and step_dir.stat().st_mode & 0o2070 == 0o2070
    assert all(p.stat().st_mode & 0o060 == 0o060 for p in step_dir.iterdir())


def h1_uid(host) -> int:
    import pwd
    return pwd.getpwnam(host.user).pw_uid


def test_an_ssh_mirror_with_an_unknown_host_key_names_its_login_and_the_fix(testbed):
    h1 = testbed.add_host("h1", login=True)
    store = testbed.add_host("store", known=False)
    spec = f"ssh://{testbed.user}@{store.address}:{store.port}{store.dir / 'home' / 'mirror'}"
    inv = load_inventory(testbed.write_inventory(job={"name": JOB}, extra=f'[storage]\nmirror = "{spec}"\n'))
    found = run_check(inv, [h1])
    assert found is not None and not found.ok
    (login,) = found.checks
    assert login.name == "login" and "known_hosts" in (login.fix or ""), login
    with open(testbed.known_hosts, "a") as f:
        f.write(store.known_hosts_line() + "\n")
    found = run_check(inv, [h1])
    assert found is not None and found.ok, found
    assert [f.name for f in found.checks] == [f"mirror host ({testbed.user})"]  # the hosts do not touch it
    assert json.dumps([f.detail for f in found.checks])

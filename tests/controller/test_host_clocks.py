"""Hosts whose clocks are a minute off (every Python process of a simulated host, daemons
and workers included, reads a shifted wall clock: tests/testbed/clockshift) change
nothing: the controller judges freshness by its own clock, never by a host's timestamps."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.testbed import clock_offset_env
from tests.testbed.jobenv import job_env_on, wait_for

pytestmark = [pytest.mark.sshd, pytest.mark.slow]


def test_host_clocks_a_minute_off_change_nothing(testbed, tmp_path):
    behind, ahead = clock_offset_env(-60), clock_offset_env(+60)
    hosts = testbed.add_hosts(3, gpus=1, envs=[behind, ahead, None])
    for host, offset in zip(hosts, (-60, 60, 0)):
        said = subprocess.run(host.ssh_argv(f"{host.python} -c 'import time; print(time.time())'"),
                              capture_output=True, text=True, timeout=60)
        assert abs(float(said.stdout) - time.time() - offset) < 10, (host.name, said.stdout, said.stderr)
    mirror = tmp_path / "mirror"
    gen = job_env_on(testbed, hosts, extra=f'\n[storage]\nmirror = "{mirror}"\nkeep = 2\n')
    je = next(gen)
    try:
        je.eltctl("up")
        st = je.training_at(3)
        # Checkpoints every 25 steps keep being mirrored, whichever host holds rank 0 ...
        first = wait_for(lambda: (je.status().get("mirror") or {}).get("step"), 120, "a first mirrored step")
        wait_for(lambda: ((je.status().get("mirror") or {}).get("step") or 0) > first, 120,
                 "the mirror to follow the job")
        # ... and no host was taken for dead, benched or restarted.
        st = je.status()
        assert [h["state"] for h in st["hosts"]] == ["running"] * 3, st["hosts"]
        kinds = [e.get("kind") for e in st.get("events", [])]
        assert not {"bench", "crash", "hang", "leave", "restore"} & set(kinds), kinds
        assert st["world_size"] == 3 and 0 <= st["checkpoint"]["age_s"] < 60, st["checkpoint"]
        down = je.eltctl("down")
        assert "mirrored and verified" in down.stdout, down.stdout
    finally:
        next(gen, None)

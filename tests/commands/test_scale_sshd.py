"""A host written into the inventory while the job trains, on real sshd hosts (issue 50).

The walk: the job trains on h1; h2 is written into hosts.toml and `eltctl scale --add h2`
(no `up`) brings it in: the controller re-reads the file, and has the store keeper
re-read it at once, so h2 gets the run id and its store forward before its daemon
starts. It joins with no value counted as forged, and `down` then stops everything and
exits 0. The same on hosts of this machine: test_scale.py.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.testbed.jobenv import job_env_on, job_pids, wait_for

pytestmark = pytest.mark.sshd


def without_host(text: str, name: str) -> str:
    """An inventory's text less the `[[hosts]]` table of `name` (the test bed writes one
    table per host, each ended by a blank line or the file's next table)."""
    out, skipping = [], False
    for line in text.splitlines():
        if line == "[[hosts]]" or line.startswith("["):
            skipping = False
        if line == f"name = {json.dumps(name)}" and out and out[-1] == "[[hosts]]":
            out.pop()
            skipping = True
        if not skipping:
            out.append(line)
    return "\n".join(out) + "\n"


@pytest.fixture
def two_hosts(testbed):
    yield from job_env_on(testbed, testbed.add_hosts(2, gpus=1))


def _status(je) -> dict:
    out = je.eltctl("status", "--json")
    return json.loads(out.stdout)


def test_a_host_written_into_the_file_joins_at_scale_add_with_nothing_forged_and_down_is_clean(two_hosts):
    je = two_hosts
    h2 = je.hosts[1]
    full = je.inventory.read_text()
    je.inventory.write_text(without_host(full, h2.name))
    assert f'"{h2.name}"' not in je.inventory.read_text()
    je.eltctl("up", "--timeout", "240")
    je.training_at(1)

    je.inventory.write_text(full)  # h2 is written into the file while the job trains
    t0 = time.monotonic()
    assert f"{h2.name}: ok" in je.eltctl("scale", "--add", h2.name).stdout  # no `up` in between
    doc = wait_for(lambda: (d := _status(je)).get("world_size") == 2 and d, 120, f"{h2.name} to join")
    print(f"{h2.name} written into hosts.toml + scale --add -> world size 2 in {time.monotonic() - t0:.1f} s")
    assert doc["forged"]["total"] == 0, doc["forged"]
    run_file = h2.home / ".eltctl" / "jobs" / je.job / h2.name / "run"
    assert run_file.read_text() == (je.state_dir / "run").read_text()
    time.sleep(3)  # steps together: still nothing forged
    doc = _status(je)
    assert doc["world_size"] == 2 and doc["forged"]["total"] == 0, doc["forged"]

    t0 = time.monotonic()
    out = je.eltctl("down", timeout=180, check=False)
    print(f"down took {time.monotonic() - t0:.1f} s")
    assert out.returncode == 0, out.stdout + out.stderr
    wait_for(lambda: job_pids(je.job) == [], 30, "every process of the job to end")

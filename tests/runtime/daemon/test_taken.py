"""Two jobs' daemons on one host (issue 13): a GPU claimed by one job is "taken" for the
other, which starts nothing there and never takes the other job's worker for an owner
(no yield, no crash); once the first job's worker leaves, the GPU is free again and the
second job takes it. Real daemons, real workers, the GPU simulator, real claim files."""

from __future__ import annotations

import json
import os
import time

import pytest

from eltctl_runtime import claims
from tests.runtime.daemon.daemon_fixtures import SimHost, alive

pytestmark = pytest.mark.slow


@pytest.fixture
def two(tmp_path):
    a = SimHost(tmp_path)
    b = SimHost(tmp_path)  # the same simulated host "h1" (same GPUs, same claims), another job and store
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def gpu_states(host: SimHost) -> dict[int, str]:
    return {g["index"]: g["state"] for g in (host.state() or {}).get("gpus", ())}


def test_a_gpu_claimed_by_one_job_is_taken_for_the_other_until_it_leaves(two, tmp_path):
    a, b = two
    a.start_daemon()
    b.start_daemon()
    a.desire([0])
    a.wait_world(1)
    a_worker = a.live_workers()[0]
    b.desire([0, 1])  # GPU 0 is A's: B gets GPU 1 only
    b.wait_world(1)
    st = b.wait_for(lambda: (s := b.state()) and s.get("taken") == {"0": a.job} and s, "GPU 0 taken for B")
    assert sorted(b.live_workers()) == [1]
    assert {g["index"]: (g["state"], g["reason"]) for g in st["gpus"]}[0][0] == "taken"
    assert f"taken by job {a.job}" in next(g["reason"] for g in st["gpus"] if g["index"] == 0)
    a.wait_for(lambda: gpu_states(a) == {0: "ours", 1: "taken"}, "A to see GPU 1 taken by B")
    assert f"job {b.job}" in next(g["reason"] for g in a.state()["gpus"] if g["index"] == 1)
    # The claim files name the holders: the workers themselves.
    d = tmp_path / "claims"
    held = claims.holders(d, ["gpu0", "gpu1"])
    assert (held["gpu0"].job, held["gpu0"].pid) == (a.job, a_worker["pid"])
    assert (held["gpu1"].job, held["gpu1"].pid) == (b.job, b.live_workers()[1]["pid"])

    # A demand entry another job's probe writes beside the claims is passed on in each
    # daemon's state (fair share learns of it without its own probe: claims.DemandReader).
    me = claims.my_account()  # an entry is believed from the account it names (issue 49)
    entry = {"job": "c", "user": me, "time": time.time(), "priority": 1, "wanted": 2, "every": 1.0}
    (d / f".demand.{me}.c.1").write_text(json.dumps(entry))
    os.replace(d / f".demand.{me}.c.1", d / f"demand.{me}.c")
    a.wait_for(lambda: [e.get("job") for e in (a.state() or {}).get("demands", ())] == ["c"],
               "A's daemon to pass on job c's demand")

    # A's worker leaves: its claim goes with it, and B takes GPU 0 when asked again.
    a.desire([])
    a.wait_for(lambda: not alive(a_worker["pid"]), "A's worker to exit")
    # The kernel frees the lock with the worker's last open file, a moment after its exit.
    a.wait_for(lambda: claims.holder(d, "gpu0") is None, "A's claim to end with its worker")
    b.wait_for(lambda: (b.state() or {}).get("taken") == {}, "B to see GPU 0 free")
    b.desire([0, 1])
    b.wait_world(2)
    assert claims.holder(d, "gpu0").job == b.job
    for h in (a, b):  # neither took the other for an owner, nothing crashed
        assert h.events("yield") == [] and h.events("crash") == [], h.log()[-3000:]
        assert h.state()["yielded"] == []


def test_two_cpu_hosts_of_one_job_on_one_machine_each_claim_their_own_slot(tmp_path):
    # Issue 25, finding 2: two `address = "local"` hosts of one CPU slot each used the same
    # claim file (cpu0), so the second host's worker started without a claim and its daemon
    # warned that "a process of this job" (the other host's healthy worker) held it.
    sleeper = {"gpus": None, "slots": 1, "command": ["python", "-c", "import time; time.sleep(600)"]}
    a = SimHost(tmp_path, name="local-a", nvidia_smi=False, overrides=sleeper)
    b = SimHost(tmp_path, name="local-b", nvidia_smi=False, overrides=sleeper, job=a.job)
    try:
        for h in (a, b):
            h.start_daemon()
            h.desire([0])
        pids = {h.name: h.wait_for(lambda h=h: h.live_workers().get(0), f"{h.name}'s worker", timeout=60)["pid"]
                for h in (a, b)}
        d = tmp_path / "claims"
        held = a.wait_for(lambda: len(claims.holders(d, ["cpu0.local-a", "cpu0.local-b"])) == 2
                          and claims.holders(d, ["cpu0.local-a", "cpu0.local-b"]), "both claims held")
        assert {name: (c.host, c.pid) for name, c in held.items()} == {
            "cpu0.local-a": ("local-a", pids["local-a"]), "cpu0.local-b": ("local-b", pids["local-b"])}
        for h in (a, b):
            assert "still held by a process of this job" not in h.log(), h.log()[-3000:]
            assert "starts without" not in h.log()
    finally:
        a.close()
        b.close()

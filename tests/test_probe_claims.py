"""The probe and other eltctl jobs (issue 13): a GPU another job holds, by its claim
(runtime/claims.py) or by its processes, is `taken` (never `busy`: that job is not an
owner), and the probe says which job holds which GPU. Tables, then the script itself on
this machine with the simulated nvidia-smi and real claim files."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from eltctl.inventory import Host, Policy
from eltctl.probe import (
    MARK,
    Gpu,
    GpuProcess,
    GpuUse,
    assess_host,
    classify_gpu,
    parse_probe_output,
    report_to_json,
)
from eltctl_runtime import claims
from eltctl_runtime.claims import Claim
from tests.test_probe import _probe, sim_host  # noqa: F401  (a fixture)

POLICY = Policy(memory_threshold_mib=500, utilization_threshold=10, nvidia_smi_timeout=2.0)
U0 = "GPU-aaaa"
G0 = Gpu(index=0, uuid=U0, name="A100", memory_used_mib=1000, memory_total_mib=40960, utilization=50)
B_CLAIM = Claim(job="b", user="bob", host="h1", slot=0, pid=42, since=1.0)


def proc(pid, *, job=None, user="bob", ours=False):
    return GpuProcess(pid=pid, gpu_uuid=U0, used_memory_mib=600, name="python", user=user, ours=ours, job=job)


@pytest.mark.parametrize("case, procs, claim, state, words", [
    ("another job's worker, its environment readable", [proc(7, job="b")], None, GpuUse.TAKEN,
     ["taken by job b", "pid 7"]),
    ("its claim alone (the worker not on the GPU yet)", [], B_CLAIM, GpuUse.TAKEN,
     ["taken by job b (user bob, pid 42)"]),
    ("another user's worker, unreadable: the claim's user", [proc(7, user="bob")], B_CLAIM, GpuUse.TAKEN,
     ["taken by job b"]),
    ("an owner's process next to the claim: an owner is back", [proc(7, user="bob"), proc(8, user="carol")],
     B_CLAIM, GpuUse.BUSY, ["used by pid 8", "carol"]),
    ("an unreadable process of another user, no claim: an owner", [proc(7, user="bob")], None, GpuUse.BUSY,
     ["used by pid 7"]),
    ("ours next to another job's (never happens with claims): ours", [proc(7, job="b"), proc(9, ours=True)],
     None, GpuUse.OURS, ["this job's"]),
])
def test_classify_gpu_taken(case, procs, claim, state, words):
    got, reason = classify_gpu(G0, procs, POLICY, claim=claim)
    assert got is state, (case, reason)
    for w in words:
        assert w in reason, (case, reason)


def _output(claims_lines: list[str], owners: str) -> str:
    return "\n".join([
        f"{MARK}probe 1", f"{MARK}smi", "/usr/bin/nvidia-smi",
        f"{MARK}gpus 0", f"0, {U0}, A100, 600, 40960, 0", "1, GPU-bbbb, A100, 0, 40960, 0",
        f"{MARK}apps 0", f"{U0}, 7, 600, python",
        f"{MARK}owners", owners,
        f"{MARK}claims", *claims_lines,
        f"{MARK}end", ""])


def test_parse_reads_the_other_job_and_the_held_claims():
    # each claim line: name, owner uid and account, lock held, pid a live process of the owner, content
    a_claim = '{"job": "a", "user": "alice"}'
    text = _output(["!dir 0 0 root 43ff", f"gpu0@bob 1001 bob 1 1 {B_CLAIM.to_json()}",
                    f"gpu1@alice 1002 alice 1 1 {a_claim}", "junk line"], "7 0 bob b")
    p = parse_probe_output(text)
    assert p.processes[0].job == "b" and not p.processes[0].ours
    assert p.claims == (("gpu0@bob", B_CLAIM), ("gpu1@alice", Claim(job="a", user="alice")))
    assert p.refused == ()
    r = assess_host(Host(name="h1", address="x"), p, POLICY, job="a")
    assert [(g.gpu.index, g.state, g.job) for g in r.gpus] == [(0, GpuUse.TAKEN, "b"), (1, GpuUse.FREE, None)]
    assert r.slots == 1  # a taken GPU is not free
    doc = report_to_json(r)
    assert [g["job"] for g in doc["gpus"]] == ["b", None]
    assert doc["gpus"][0]["processes"][0]["job"] == "b" and doc["gpus"][0]["state"] == "taken"
    # An older probe's owners line (no job field) still reads.
    assert parse_probe_output(_output([], "7 0 bob")).processes[0].job is None


def test_the_script_reads_the_hosts_claims_and_names_the_holding_job(sim_host, tmp_path):
    host, state = sim_host
    d = tmp_path / "claims"  # the sim host's ELTCTL_CLAIMS_DIR
    env = {**os.environ, **dict(host.env), "CUDA_VISIBLE_DEVICES": "1", "ELTCTL_JOB": "job1"}
    held = claims.take(d, "gpu0", Claim(job="other", user="bob", host="h1", slot=0, pid=os.getpid()))
    worker = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    try:
        claims.take(d, "gpu1", Claim(job="job1", user="me", slot=1, pid=worker.pid)).close()  # released
        deadline = time.monotonic() + 10
        while True:
            [r] = _probe([host])
            if r.gpus[1].state is GpuUse.OURS or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [(g.state, g.job) for g in r.gpus] == [(GpuUse.TAKEN, "other"), (GpuUse.OURS, "job1")], \
            [g.reason for g in r.gpus]
        assert f"taken by job other (user {claims.my_account()}" in r.gpus[0].reason
        held.close()
        [r] = _probe([host])
        assert r.gpus[0].state is GpuUse.FREE  # released: the file stays, nobody holds it
        doc = json.loads(json.dumps(report_to_json(r)))
        assert doc["gpus"][1]["job"] == "job1"
    finally:
        held.close()
        worker.kill()
        worker.wait()


def test_a_host_may_move_its_claims_directory_but_a_job_may_not():
    from eltctl.errors import ConfigError
    from eltctl.inventory import parse_inventory

    head = '[job]\nname = "j"\ncommand = "python t.py"\n'
    inv = parse_inventory(head + '[[hosts]]\nname = "a"\naddress = "a.lab"\n'
                                 'env = { ELTCTL_CLAIMS_DIR = "/dev/shm/gpus" }\n', "hosts.toml")
    assert dict(inv.hosts[0].env) == {"ELTCTL_CLAIMS_DIR": "/dev/shm/gpus"}
    with pytest.raises(ConfigError, match="job.env.ELTCTL_CLAIMS_DIR.*cannot be overridden"):
        parse_inventory(head + 'env = { ELTCTL_CLAIMS_DIR = "/x" }\n[[hosts]]\nname = "a"\naddress = "a.lab"\n',
                        "hosts.toml")

"""Two eltctl jobs on one lab (issue 13): two inventories, two state directories, two
controllers, started at the same moment on the same three 2-GPU hosts. They end with
disjoint GPUs (each GPU claimed by at most one job: the daemons' states and the claim
files on the hosts agree) and neither takes the other for an owner: no yield, no crash,
no cooldown in either job, and both keep training."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from eltctl_runtime import claims
from tests.testbed.jobenv import ELTCTL, job_env_on, wait_for

pytestmark = [pytest.mark.sshd, pytest.mark.slow]

LIVE = {"running", "stopping", "leaving", "killed", "evicted"}


def running_slots(je) -> dict[str, set[int]]:
    """host -> the slots where the job's daemon runs a live worker (its state, via status.json)."""
    out = {}
    for h in je.status().get("hosts", []):
        workers = ((h.get("daemon") or {}).get("workers")) or []
        out[h["name"]] = {w["slot"] for w in workers if w.get("state") in LIVE}
    return out


def held_gpus(hosts) -> dict[tuple[str, int], str]:
    """(host, GPU) -> the job holding its claim, from the claim files on the hosts."""
    out = {}
    for host in hosts:
        for name, c in claims.holders(host.claims_dir, [f"gpu{i}" for i in range(2)]).items():
            out[(host.name, int(name[3:]))] = c.job
    return out


def test_two_jobs_started_together_end_with_disjoint_gpus_and_no_yields(testbed):
    hosts = testbed.add_hosts(3, gpus=2)
    gen_a, gen_b = job_env_on(testbed, hosts), job_env_on(testbed, hosts)
    a = next(gen_a)
    try:
        b = next(gen_b)
        try:
            t0 = time.monotonic()
            ups = [subprocess.Popen([*ELTCTL, "-i", str(je.inventory), "up", "--detach"], env=je.env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for je in (a, b)]
            for p in ups:
                out, _ = p.communicate(timeout=180)
                assert p.returncode == 0, out

            def settled():
                ra, rb = running_slots(a), running_slots(b)
                used = sum(len(s) for s in ra.values()) + sum(len(s) for s in rb.values())
                held = held_gpus(hosts)
                return (ra, rb, held) if used == 6 and len(held) == 6 else None

            try:
                ra, rb, held = wait_for(settled, 90, "all six GPUs running a worker of one job or the other")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n--- A\n{a.controller_log()}\n{a.host_logs()}\n"
                                     f"--- B\n{b.controller_log()}\n{b.host_logs()}") from None
            for je, slots in ((a, ra), (b, rb)):  # whoever got GPUs trains on exactly those
                n = sum(len(s) for s in slots.values())
                if n:
                    je.training_at(n, after_step=(je.status().get("step") or 0) + 2)
            ra2, rb2, held2 = running_slots(a), running_slots(b), held_gpus(hosts)
            assert (ra2, rb2, held2) == (ra, rb, held), "the split changed: the jobs fought over GPUs"
            for host in hosts:
                assert not ra[host.name] & rb[host.name], (host.name, ra, rb)
                for gpu in range(2):
                    owner = a.job if gpu in ra[host.name] else b.job
                    assert held[(host.name, gpu)] == owner, (host.name, gpu, held)
            for je in (a, b):
                st = je.status()
                kinds = [e.get("kind") for e in st.get("events", [])]
                assert "yield" not in kinds and "crash" not in kinds, kinds
                assert all(h["state"] != "cooldown" and not h["failures"] for h in st["hosts"]), st["hosts"]
            met = sum(p.read_text(errors="replace").count(" is taken by ")
                      for p in Path(testbed.dir).glob("h*/home/.eltctl/jobs/*/*/daemon.log"))
            print(f"\ntwo jobs after {time.monotonic() - t0:.1f} s: "
                  f"A {sorted((h, s) for h, ss in ra.items() for s in ss)}, "
                  f"B {sorted((h, s) for h, ss in rb.items() for s in ss)}; "
                  f"{met} claim(s) found taken by the other job")
        finally:
            next(gen_b, None)
    finally:
        next(gen_a, None)

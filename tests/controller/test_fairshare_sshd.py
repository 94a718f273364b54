"""Fair share end to end (docs/fairshare.md): on two 2-GPU hosts, job A (the test bed's
account) starts alone and takes all four GPUs; job B, of other accounts (the hosts'
own, `add_hosts(login=True)`), starts on the same hosts. A learns of B's demand from
the hosts (the entries beside the GPU claims), releases two GPUs in the planned way
(0 lost steps: its audit), does not take them back, and B claims them: 2 and 2. And a
job of higher priority gets its min_workers at once (no fairshare_hold) from a job
holding every GPU. (The timings, and the three-user case on three hosts with owners
coming and going, are benchmarks/fairshare.py's.)"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.controller.test_two_jobs_sshd import held_gpus, running_slots
from tests.testbed.jobenv import ELTCTL, hand_home_to_hosts_accounts, job_env_on, wait_for

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(600)]

FAIR = 'fairshare_hold = "2s"\n'


def test_a_second_job_gets_its_fair_half_with_no_lost_step_in_the_first(testbed):
    hosts = testbed.add_hosts(2, gpus=2, login=True)
    gen_a, gen_b = job_env_on(testbed, hosts, extra=FAIR), job_env_on(testbed, hosts, extra=FAIR)
    a = next(gen_a)
    text = a.inventory.read_text()
    for h in hosts:  # A logs in as the test bed's account ([ssh] user), B as each host's own
        text = text.replace(f'user = "{h.login}"\n', "")
    a.inventory.write_text(text)
    try:
        b = next(gen_b)
        try:
            a.eltctl("up")
            st = a.training_at(4)
            hand_home_to_hosts_accounts(hosts)  # B's account writes there too
            t0 = time.monotonic()
            up_b = subprocess.run([*ELTCTL, "-i", str(b.inventory), "up", "--detach"], env=b.env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)
            assert up_b.returncode == 0, up_b.stdout + up_b.stderr

            def halves():
                ra, rb = running_slots(a), running_slots(b)
                na, nb = sum(map(len, ra.values())), sum(map(len, rb.values()))
                return (ra, rb) if (na, nb) == (2, 2) else None

            try:
                wait_for(halves, 120, "A and B to hold two GPUs each")
                st_b = b.training_at(2)
                st = a.training_at(2, after_step=st["step"])
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n--- A\n{a.controller_log()}\n{a.host_logs()}\n"
                                     f"--- B\n{b.controller_log()}\n{b.host_logs()}") from None
            took = time.monotonic() - t0
            held = held_gpus(hosts)
            assert sorted(held.values()) == sorted([a.job] * 2 + [b.job] * 2), held

            events = st["events"]
            fair = [e for e in events if e.get("kind") == "fairshare"]
            assert fair and all(f"to job {b.job} (fair share 2 of 4)" in e["detail"] for e in fair), \
                [e["detail"] for e in fair]
            moved = sum(int(e["detail"].split()[1]) for e in fair)
            assert moved == 2, [e["detail"] for e in fair]  # no more than the moves needed
            leaves = [e for e in events if e.get("kind") == "leave"]
            assert leaves and all(e["lost"] == [] and e["step"] == e["from_step"] + 1 for e in leaves), leaves
            kinds = {e.get("kind") for e in events}
            assert not {"crash", "hang", "restore", "yield"} & kinds, kinds
            assert st["fairshare"]["share"] == 2 and st["fairshare"]["pool"] == 4, st["fairshare"]

            # It stays: A does not grab the released GPUs back.
            st = a.training_at(2, after_step=st["step"] + 3)
            assert sum(map(len, running_slots(b).values())) == 2

            lab = json.loads(a.eltctl("lab", "--json").stdout)
            shares = {j["job"]: (j["held"], j["share"]) for j in lab["jobs"]}
            assert shares == {a.job: (2, 2), b.job: (2, 2)}, lab
            users = {j["job"]: j["user"] for j in lab["jobs"]}
            assert users[a.job] == testbed.user and users[b.job] in {h.login for h in hosts}, users
            print(f"\nfair share: B started, 2 and 2 after {took:.1f} s; A's events: "
                  f"{[e['detail'] for e in fair]}; B at step {st_b['step']}")
        finally:
            next(gen_b, None)
    finally:
        next(gen_a, None)


def test_a_higher_priority_job_gets_its_min_workers_at_once_despite_the_hold(testbed):
    """Job A holds all four GPUs of two hosts, taken moments ago (the default
    `fairshare_hold` of 10 minutes would keep them from an equal job). Job H, `priority =
    1`, `min_workers = max_workers = 2`, starts: A releases two at once in the planned way
    (0 lost steps), H trains on its min_workers, A goes on with two."""
    hosts = testbed.add_hosts(2, gpus=2)
    gen_a, gen_h = job_env_on(testbed, hosts), job_env_on(testbed, hosts)
    a = next(gen_a)
    try:
        h = next(gen_h)
        text = h.inventory.read_text()
        assert "min_workers = 1\n" in text
        h.inventory.write_text(text.replace("min_workers = 1\n", "min_workers = 2\nmax_workers = 2\npriority = 1\n", 1))
        try:
            a.eltctl("up")
            st = a.training_at(4)
            t0 = time.time()
            up_h = subprocess.run([*ELTCTL, "-i", str(h.inventory), "up", "--detach"], env=h.env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)
            assert up_h.returncode == 0, up_h.stdout + up_h.stderr
            try:
                st_h = h.training_at(2, timeout=240)
                st = a.training_at(2, after_step=st["step"])
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n--- A\n{a.controller_log()}\n--- H\n{h.controller_log()}") from None
            took = time.time() - t0
            assert sorted(held_gpus(hosts).values()) == sorted([a.job] * 2 + [h.job] * 2)
            events = st["events"]
            fair = [e for e in events if e.get("kind") == "fairshare"]
            assert fair and all(f"to job {h.job} (fair share 2 of 4)" in e["detail"] for e in fair), \
                [e["detail"] for e in fair]
            assert sum(int(e["detail"].split()[1]) for e in fair) == 2, \
                f"{[e['detail'] for e in fair]}\n--- A\n{a.controller_log()}\n--- H\n{h.controller_log()}"
            leaves = [e for e in events if e.get("kind") == "leave"]
            assert leaves and all(e["lost"] == [] and e["step"] == e["from_step"] + 1 for e in leaves), leaves
            assert st_h["fairshare"]["priority"] == 1 and st_h["fairshare"]["share"] == 2, st_h["fairshare"]
            released_after = min(e["time"] for e in fair) - t0  # the controllers' clocks: this machine's
            print(f"\npriority: H trains on its min_workers {took:.1f} s after its up; A released "
                  f"{released_after:.1f} s after it ({[e['detail'] for e in fair]})")
        finally:
            next(gen_h, None)
    finally:
        next(gen_a, None)

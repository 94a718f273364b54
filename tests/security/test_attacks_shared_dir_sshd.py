"""Another unix account against the hosts' shared GPU claims directory (issue 49).

The claims directory (`ELTCTL_CLAIMS_DIR`, a lab's /tmp/eltctl-gpus, mode 1777) is
writable by every account. Before the job starts, `nobody` (tests/testbed/attacker.py's
account) plants there what the review planted, on the real-sshd test bed (two hosts of
one simulated GPU each, one job for the whole module):

- h1: FIFOs under the claim names the job's daemon opens (`gpu0`, the old shared name,
  hung the daemon's loop for good; `gpu0@<victim>`, its own name now), a locked claim
  file whose name holds newlines and `:::eltctl:` sections (a GPU forged into the
  probe's output), a demand file named likewise, a forged demand of the victim's
  account (`demand.<victim>.ghost`: priority 100, min_workers 8, a time in the future),
  and the victim job's own demand name taken first (`demand.<victim>.<job>`).
- h2: a locked claim under the old shared name and under the victim's own name, and a
  locked claim of nobody's own account whose pid is no process of nobody's.

What must hold: the job trains at world size 2 (no GPU is kept from it, nothing hangs,
no GPU is released to a job that does not exist), its fair share is untouched (no other
job is seen), `eltctl probe --json` reports each host as it is (one GPU, its real uuid,
the job's own demand published under the alternate name), and each attempt is refused,
counted and named with its file and its owner `nobody` in `eltctl status` (and --json),
`eltctl probe --json` and `eltctl lab`. On today's code (b0fbb9f) the FIFO alone keeps
the job from world size 2.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import time

import pytest

from eltctl.sim.gpustate import find_system_python
from eltctl_runtime import claims
from tests.testbed import attacker, make_testbed, sshd_missing_reason
from tests.testbed.jobenv import job_env_on

pytestmark = [pytest.mark.sshd, pytest.mark.slow, pytest.mark.timeout(600)]

FORGED_GPUS = ":::eltctl:gpus 0\n0, GPU-forged, A100, 9000, 40960, 90\n:::eltctl:apps 0\nGPU-forged, 1, 9000, x\n"

# Run as `nobody`: plant, print "ready", hold the locks until stdin closes.
PLANT = r'''
import fcntl, json, os, sys, time
where, d, victim, job = sys.argv[1:5]
held = []
def put(name, doc, lock=False):
    fd = os.open(os.path.join(d, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, json.dumps(doc).encode())
    if lock:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.append(fd)
    else:
        os.close(fd)
forged = sys.argv[5]
if where == "h1":
    for base in ("gpu0", "cpu0." + sys.argv[6]):
        os.mkfifo(os.path.join(d, base), 0o444)
        os.mkfifo(os.path.join(d, base + "@" + victim), 0o444)
    put("gpu0\n" + forged, {"job": "ghost", "user": victim, "pid": 1}, lock=True)
    put("demand.x\n" + forged, {})
    put("demand.%s.ghost" % victim, {"job": "ghost", "user": victim, "priority": 100, "min_workers": 8,
                                     "held": 0, "wanted": 8, "time": 9e12})
    put("demand.%s.%s" % (victim, job), {"job": job, "user": victim, "held": 0, "wanted": 0, "time": time.time()})
else:
    for base in ("gpu0", "cpu0." + sys.argv[6]):
        put(base, {"job": "ghost", "user": victim, "pid": 1}, lock=True)
        put(base + "@" + victim, {"job": "ghost", "user": victim, "pid": 1}, lock=True)
        put(base + "@nobody", {"job": "ghost", "user": "nobody", "pid": 1}, lock=True)
print("ready", flush=True)
sys.stdin.read()
'''


def as_attacker(*args: str) -> subprocess.Popen:
    account = pwd.getpwnam(attacker.ATTACKER)
    argv = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups",
            find_system_python(), "-I", "-S", "-c", PLANT, *args]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if line != "ready":
        p.kill()
        raise AssertionError(f"planting as {attacker.ATTACKER} failed: {p.communicate()[1]}")
    return p


class Planted:
    def __init__(self, je, victim: str) -> None:
        self.je = je
        self.victim = victim

    def refused(self) -> dict[str, list[tuple[str, str, str]]]:
        """host -> [(file, owner, reason)] from status.json."""
        doc = self.je.status()
        return {h["name"]: [(e["file"], e["owner"], e["reason"]) for e in (h.get("refused") or {}).get("entries", [])]
                for h in doc.get("hosts", [])}


@pytest.fixture(scope="module")
def planted():
    reason = sshd_missing_reason() or attacker.can_attack_as_another_account()
    if reason:
        pytest.skip(reason)
    procs: list[subprocess.Popen] = []
    with make_testbed() as bed:
        hosts = bed.add_hosts(2, gpus=1)
        gen = job_env_on(bed, hosts)
        je = next(gen)
        try:
            for d in [bed.dir, *(h.dir for h in hosts)]:
                d.chmod(0o711)  # as /tmp is on a lab machine: nobody reaches the claims directory
            victim = pwd.getpwuid(os.geteuid()).pw_name  # the job's account
            for h in hosts:
                claims.ensure_dir(h.claims_dir)  # made by the first eltctl user: 1777
                procs.append(as_attacker("h1" if h is hosts[0] else "h2", str(h.claims_dir), victim, je.job,
                                         FORGED_GPUS, h.name))
            je.eltctl("up")
            je.training_at(2)
            yield Planted(je, victim)
        finally:
            for p in procs:
                p.stdin.close()
                p.wait(timeout=30)
            next(gen, None)


def test_the_job_trains_at_its_world_size_and_its_fair_share_is_untouched(planted):
    je = planted.je
    st = je.training_at(2)
    samples = []
    deadline = time.time() + 8  # several probes (1 s) and daemon looks (0.5 s) with every plant in place
    while time.time() < deadline:
        s = je.status()
        samples.append((s.get("world_size"), (s.get("fairshare") or {}).get("share"), s.get("step") or 0))
        time.sleep(0.5)
    assert all(ws == 2 for ws, _, _ in samples), samples
    assert all(share is None for _, share, _ in samples), samples  # no other job seen: nothing to share
    events = [e for e in je.status().get("events", []) if e.get("kind") in ("fairshare", "yield", "crash")]
    assert events == [], events
    je.training_at(2, after_step=st["step"] + 5)


def test_status_counts_and_names_every_attempt_with_its_owner(planted):
    je, victim = planted.je, planted.victim
    h1, h2 = (h.name for h in je.hosts)

    def complete():
        r = planted.refused()
        files = {(f, o) for f, o, _ in r.get(h1, [])} | {(f, o) for f, o, _ in r.get(h2, [])}
        return r if {(f"gpu0@{victim}", "nobody"), (f"demand.{victim}.ghost", "nobody"),
                     ("gpu0@nobody", "nobody")} <= files else None

    from tests.testbed.jobenv import wait_for

    refused = wait_for(complete, 30, "the daemons to report what nobody planted")
    why = {(host, f): (o, r) for host, entries in refused.items() for f, o, r in entries}
    assert why[(h1, f"gpu0@{victim}")] == ("nobody", "not a regular file")
    assert why[(h1, f"demand.{victim}.ghost")][1] == f"named for {victim} but owned by nobody"
    assert why[(h1, f"demand.{victim}.{je.job}")][1] == f"named for {victim} but owned by nobody"
    assert why[(h2, f"gpu0@{victim}")][1] == f"named for {victim} but owned by nobody"
    assert why[(h2, "gpu0@nobody")][1] == "locked, but its pid 1 is no live process of nobody"
    assert any(f.startswith("'gpu0\\n") and o == "nobody" for f, (o, _) in
               ((f, v) for (h, f), v in why.items() if h == h1)), why  # the newline name, escaped

    text = je.eltctl("status").stdout
    assert "not believed" in text and f"demand.{victim}.ghost" in text and "owner nobody" in text, text
    doc = json.loads(je.eltctl("status", "--json").stdout)
    counts = {h["name"]: (h.get("refused") or {}).get("count", 0) for h in doc["hosts"]}
    assert counts[h1] >= 4 and counts[h2] >= 2, counts


def test_probe_reports_each_host_as_it_is(planted):
    je, victim = planted.je, planted.victim
    reports = json.loads(je.eltctl("probe", "--json").stdout)
    truth = {h.name: [g["uuid"] for g in json.loads(h.state_path.read_text())["gpus"]] for h in je.hosts}
    for r in reports:
        assert r["state"] == "ok", r
        assert [g["uuid"] for g in r["gpus"]] == truth[r["name"]], r["gpus"]
        assert all(g["state"] != "taken" for g in r["gpus"]), r["gpus"]  # nobody's locks keep no GPU
        assert [d["job"] for d in r["demands"]] == [je.job], r["demands"]  # no ghost
        assert r["demands"][0]["user"] == victim
        owners = {e["owner"] for e in r["refused"]["entries"]}
        assert owners == {"nobody"}, r["refused"]
    h1 = next(r for r in reports if r["name"] == je.hosts[0].name)
    shown = {(e["file"], e["reason"].split(":")[0]) for e in h1["refused"]["entries"]}
    assert (f"demand.{victim}.{je.job}", "squatted") in shown or \
        (f"demand.{victim}.{je.job}", f"named for {victim} but owned by nobody") in shown, shown
    assert {f for f, _ in shown if f.startswith(("'gpu0\\n", "'demand.x\\n"))} == {
        claims.shown_name("gpu0\n" + FORGED_GPUS), claims.shown_name("demand.x\n" + FORGED_GPUS)}, shown
    text = je.eltctl("probe").stdout
    assert "not believed" in text and "(owner nobody)" in text, text
    # the job's own entry went to the alternate name, written by its account
    alt = je.hosts[0].claims_dir / f"demand.{victim}.{je.job}~1"
    assert alt.stat().st_uid == os.geteuid()


def test_lab_shows_only_the_real_job_and_names_the_refusals(planted):
    je = planted.je
    lab = json.loads(je.eltctl("lab", "--json").stdout)
    assert [j["job"] for j in lab["jobs"]] == [je.job], lab["jobs"]
    assert lab["jobs"][0]["published"] is True
    assert lab["refused"] and {e["owner"] for e in lab["refused"]} == {"nobody"}, lab["refused"]
    text = je.eltctl("lab").stdout
    assert "not believed" in text and "nobody" in text, text

"""The checkpoint mirror end to end: every host lost, the job resumes on new hosts
from the mirrored checkpoint.

Plan: a job on h1 and h2 (2 simulated GPUs each, CPU workers) with `[storage] mirror`
set and a checkpoint every 10 steps. Once a checkpoint is mirrored, h1 and h2 die at
once (sshd and every process). The inventory is edited to name h3 and h4 instead and
`eltctl up` applies it. What must hold: the controller restores from the mirror (a
`restore` event naming the mirror and a step at least the one mirrored before the
loss), the new generation's first step is that step + 1, the new run's checkpoints
are mirrored again, `down` says the final checkpoint is mirrored and verified, and
every sample of every epoch was seen exactly once (the runtime's audit log).

Two mirror kinds: a shared directory (all simulated hosts share this machine's
filesystem) and `ssh://` to a fifth simulated host that runs nothing of the job.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from eltctl.controller.policy import HostView, Reach, survivor_holds_state
from tests.testbed.jobenv import POLICY, job_pids, wait_for, worker_pids
from tests.runtime.runtime_cluster import assert_exactly_once, committed_lineage

SAMPLES, BATCH = 960, 24


def _mirror_steps(directory: Path) -> list[int]:
    """The step directories renamed into place on the mirror (not the `.tmp-*` ones)."""
    try:
        return sorted(int(p.name[len("step-"):]) for p in directory.iterdir() if p.name.startswith("step-"))
    except OSError:
        return []


def _generations(audit: Path) -> dict[int, int]:
    """generation -> its first step in the audit log."""
    first: dict[int, int] = {}
    for line in audit.read_text().splitlines():
        r = json.loads(line)
        first[r["generation"]] = min(first.get(r["generation"], r["step"]), r["step"])
    return first


# ------------------------------------------------------------ when a start must restore first

NOW = 1790000000.0
FRESH_FOR = 10.0
UP = HostView("h3", reach=Reach.OK)
GONE = HostView("h1", reach=Reach.UNREACHABLE)
RUNNING = HostView("h3", reach=Reach.OK, daemon_alive=True, workers=(0, 1))


@pytest.mark.parametrize("views, status, survivor", [
    # First `up`: no daemon, no status.
    ({"h3": UP}, None, False),
    # A daemon reports live workers: they hold the state, whatever the status says.
    ({"h3": RUNNING}, None, True),
    ({"h3": RUNNING}, {"seen": NOW - 600, "members": []}, True),
    # Workers outlive their daemon: a fresh status (seen changing by the controller's
    # clock, whatever rank 0's own clock says) naming a reachable inventory host.
    ({"h3": UP}, {"seen": NOW - 1, "time": NOW - 3600, "members": ["h3/0/1"]}, True),
    # Fresh, but its members are on hosts removed from the inventory, or unreachable.
    ({"h3": UP}, {"seen": NOW - 1, "members": ["h1/0/1", "h2/1/1"]}, False),
    ({"h1": GONE, "h3": UP}, {"seen": NOW - 1, "members": ["h1/0/1"]}, False),
    # A status that stopped changing is the last word of a dead run.
    ({"h3": UP}, {"seen": NOW - FRESH_FOR, "time": NOW, "members": ["h3/0/1"]}, False),
    ({"h3": UP}, {"seen": "garbage", "members": ["h3/0/1"]}, False),
    # Its last members paused the job (every one left): a worker started since holds
    # nothing (its newest checkpoint is on the host they left), however fresh the status;
    # a member still running, or a daemon that does not name its workers, still counts.
    ({"h1": HostView("h1", reach=Reach.OK, daemon_alive=True, workers=(0,), worker_ids=("h1/0/9",)), "h3": UP},
     {"seen": NOW - 1, "paused": True, "members": ["h3/1/1"]}, False),
    ({"h3": HostView("h3", reach=Reach.OK, daemon_alive=True, workers=(1,), worker_ids=("h3/1/1",))},
     {"seen": NOW - 1, "paused": True, "members": ["h3/1/1"]}, True),
    ({"h1": RUNNING}, {"seen": NOW - 1, "paused": True, "members": ["h3/1/1"]}, True),
])
def test_a_start_restores_only_when_no_survivor_holds_the_state(views, status, survivor):
    assert survivor_holds_state(views, status, NOW, FRESH_FOR) is survivor


# ------------------------------------------------------------ end to end

@pytest.mark.sshd
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["dir", "ssh"])
def test_every_host_lost_the_job_resumes_on_new_hosts_from_the_mirror(job_env, kind):
    bed = job_env.bed
    h1, h2, h3 = job_env.hosts
    extra = bed.add_hosts(2 if kind == "ssh" else 1, gpus=2)
    h4 = extra[0]
    root = job_env.inventory.parent
    audit = root / "audit.jsonl"
    if kind == "dir":
        mirror_dir = root / "mirror"
        target = str(mirror_dir)
    else:  # the fifth host keeps the copies; it is reached over SSH from the controller only
        h5 = extra[1]
        mirror_dir = Path(bed.dir) / "h5mirror"
        target = f"ssh://{bed.user}@{h5.address}:{h5.port}{mirror_dir}"
    job_mirror = mirror_dir / job_env.job
    job = {
        "name": job_env.job, "workdir": str(job_env.workdir), "device": "cpu", "min_workers": 1,
        # ELTCTL_* cannot be set in [job] env (eltctl owns them): `env` sets the audit path.
        "command": ["env", f"ELTCTL_AUDIT={audit}", h1.python, "train.py", "--steps", "1000000", "--hidden", "16", "--layers", "1",
                    "--samples", str(SAMPLES), "--batch", str(BATCH), "--step-sleep", "0.05",
                    "--checkpoint-every", "10"],
        "env": {"OMP_NUM_THREADS": "1"},
    }
    storage = f'\n[storage]\nmirror = "{target}"\n'

    def use_hosts(hosts) -> None:
        bed.write_inventory(job_env.inventory, hosts=hosts, job=job, extra=POLICY + storage)

    def mirror_status() -> dict:
        return job_env.status().get("mirror") or {}

    restores: list[dict] = []

    def collect_restores() -> list[dict]:
        for ev in job_env.status().get("events") or []:
            if ev.get("kind") == "restore" and "where" in ev and ev not in restores:
                restores.append(ev)
        return restores

    # 1. Up on h1 and h2; wait until a checkpoint is on the mirror, verified.
    use_hosts([h1, h2])
    job_env.eltctl("up")
    st = job_env.training_at(4)
    assert mirror_status().get("target") == target
    wait_for(lambda: (mirror_status().get("step") or 0) >= 20, 120, "a checkpoint of step >= 20 mirrored")
    mirrored_before = mirror_status()["step"]
    assert mirrored_before in _mirror_steps(job_mirror)
    shown = [ln for ln in job_env.eltctl("status").stdout.splitlines() if ln.startswith("mirror")]
    assert shown and " step " in shown[0], shown
    first_restore = collect_restores()  # the first `up` had nothing to restore
    assert all(ev.get("step") is None for ev in first_restore), first_restore

    # 2. Every host of the job dies at once.
    for h in (h1, h2):
        h.crash()
    assert not worker_pids(job_env.job)
    lost_at = time.monotonic()
    old_gens = _generations(audit)
    old_last = max(committed_lineage(audit))

    # 3. Two other hosts in the inventory; `up` re-reads it.
    use_hosts([h3, h4])
    job_env.eltctl("up")
    try:
        wait_for(collect_restores, 120, "a restore event")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{job_env.controller_log(120)}\n{job_env.host_logs()}") from None
    restore = restores[-1]
    # Training again: rank 0's status names only workers of h3 and h4 (the old run's
    # status, naming h1 and h2, may still read "training" for a few seconds).
    def resumed() -> dict | None:
        doc = job_env.status()
        members = doc.get("members") or []
        if (doc.get("state") == "training" and doc.get("world_size") == 4 and members
                and all(str(m).split("/")[0] in ("h3", "h4") for m in members)
                and (doc.get("step") or 0) > restore["step"] + 5):
            return doc
        return None

    try:
        st = wait_for(resumed, 180, "training on h3 and h4 past the restored step")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{job_env.controller_log()}\n{job_env.host_logs()}") from None
    print(f"\n[{kind}] every host lost -> training again on h3, h4 in {time.monotonic() - lost_at:.1f} s; "
          f"restored step {restore['step']} from {restore['where']} (mirrored before the loss: "
          f"{mirrored_before}, last step of the old run: {old_last})")
    assert restore["where"] == "mirror", restore
    assert mirrored_before <= restore["step"] <= old_last, restore
    assert sorted(restore["ready"]) == ["h3", "h4"], restore
    assert {h["name"] for h in st["hosts"] if h["state"] == "running"} == {"h3", "h4"}
    new_gens = {g: s for g, s in _generations(audit).items() if g not in old_gens}
    assert new_gens, "no new generation in the audit log"
    assert new_gens[min(new_gens)] == restore["step"] + 1, (new_gens, restore)

    # 4. The new run's checkpoints (on h3 or h4) are mirrored too.
    wait_for(lambda: (mirror_status().get("step") or 0) > restore["step"]
             and mirror_status().get("last_error") is None, 120, "a checkpoint of the new run mirrored")

    # 5. `down`: the final checkpoint is mirrored and verified before the answer.
    out = job_env.eltctl("down").stdout
    final = json.loads((job_env.state_dir / "status.json").read_text()).get("mirror") or {}
    assert f"final checkpoint step {final.get('step')} mirrored and verified to {target}" in out, (out, final)
    assert f"final checkpoint: step {final['step']}" in out, out
    assert final["step"] in _mirror_steps(job_mirror)
    assert job_pids(job_env.job) == []

    # 6. Exactly once, across the loss and the restore.
    last = max(committed_lineage(audit))
    assert last >= final["step"]
    epochs = assert_exactly_once(audit, SAMPLES, BATCH, last)
    print(f"[{kind}] {last} steps, {len(epochs)} epoch(s), every sample once per epoch")

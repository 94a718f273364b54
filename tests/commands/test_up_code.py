"""Issue 50, end to end on this machine (`address = "local"`, the test bed of test_up.py).

Finding 4: `eltctl init` writes `workdir = "."`, so the inventory (a token in `[notify]
headers`), an exported model, logs went to every host with the code. Now only what the
ignore rules choose goes, and `up` says what it sends and what it left out.

Finding 5: the newest checkpoint (step 30 here) was on a host then taken out of the
inventory; `up` resumed from an older one on the other host without a word. Now `up`
says where it resumed from and warns of the newer one, naming the host and the step.
"""

from __future__ import annotations

import json
import shutil

import pytest

from eltctl_runtime.files import read_json
from tests.commands.test_finished import command, finished
from tests.commands.test_up import local_job  # noqa: F401 - the fixture
from tests.testbed.hostpython import HOST_PYTHON
from tests.testbed.jobenv import wait_for


def host_dir(lj, host: str):
    return lj.root / "home" / host / ".eltctl" / "jobs" / lj.job / host


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_hosts_get_only_the_code_and_up_says_where_it_resumed_from_and_of_a_newer_checkpoint_out_of_reach(
        local_job):  # noqa: F811
    lj = local_job
    lj.inventory = lj.workdir / "hosts.toml"  # as `eltctl init` writes it: workdir = "."
    (lj.workdir / "model.pt").write_bytes(b"exported" * 1000)  # `eltctl checkpoints export model.pt`
    (lj.workdir / "notify.log").write_text("sent\n")
    (lj.workdir / "secret.txt").write_text("token\n")
    (lj.workdir / "scratch").mkdir()
    (lj.workdir / "scratch" / "notes.py").write_text("")
    (lj.workdir / ".eltctlignore").write_text("# mine\nscratch/\n")

    def write(hosts: dict[str, str], steps: int) -> None:
        lj.write(hosts, command=command(steps))
        text = lj.inventory.read_text().replace('device = "cpu"', 'device = "cpu"\nexclude = ["secret.txt"]', 1)
        lj.inventory.write_text(text)

    write({"a": HOST_PYTHON}, 30)
    out, _ = lj.eltctl("up", "--timeout", "240")
    assert out.returncode == 0, out.stdout + out.stderr
    said = next(line for line in out.stdout.splitlines() if "code for each host" in line)
    for left in ("hosts.toml (the inventory)", "model.pt (a model file)", "notify.log (a log)",
                 "secret.txt ([job] exclude)", "scratch/ (.eltctlignore:2)"):
        assert left in said, said
    code = host_dir(lj, "a") / "code"
    assert sorted(p.name for p in code.iterdir() if p.name != "__pycache__") == [".eltctlignore", "toy.py",
                                                                               "train.py"]
    assert "resumed from" not in out.stdout  # nothing to resume from

    # a's run finishes at step 30 (a checkpoint every 10 steps); b is given a's older ones
    wait_for(lambda: finished(lj, 30), 180, "the job finished at step 30")
    assert read_json(lj.state_dir / "hosts.json")["checkpoint"]["step"] == 30
    held = sorted(p.name for p in (host_dir(lj, "a") / "checkpoints").glob("step-*"))
    assert held[-1] == "step-00000030" and len(held) >= 2, held
    older = held[-2]
    for name in held[:-1]:
        shutil.copytree(host_dir(lj, "a") / "checkpoints" / name, host_dir(lj, "b") / "checkpoints" / name)

    # a is taken out of the inventory: b resumes from its own older checkpoint, and says so
    write({"b": HOST_PYTHON}, 100000)
    out, _ = lj.eltctl("up", "--timeout", "240")
    assert out.returncode == 0, out.stdout + out.stderr
    step = int(older.split("-")[1])
    assert f"resumed from step {step} (host b)" in out.stdout, out.stdout + json.dumps(lj.status().get("events"))
    warning = next(line for line in out.stdout.splitlines() if "a newer checkpoint" in line)
    assert "warning:" in warning and "step 30" in warning and "host a" in warning, warning
    assert "no longer in the inventory" in warning and f"resumes from step {step}" in warning, warning
    restore = [e for e in lj.status().get("events", []) if e.get("kind") == "restore" and "where" in e][-1]
    assert restore["newer"] == {"host": "a", "step": 30, "why": "is no longer in the inventory"}, json.dumps(restore)

"""`up`'s checks (eltctl/preflight.py): the judgements as tables, the job's facts on
real directories, the host-side script run by a real sh.

End to end (the CLI, the local transport and real sshd hosts): tests/commands/test_up.py
and tests/commands/test_up_sshd.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from eltctl.doctor import Check, HostDiagnosis, Status
from eltctl.errors import ConfigError, HostError
from eltctl.inventory import Host, Inventory, JobSpec, Policy, SSHSettings, Storage
from eltctl.preflight import (
    LEFT_OUT,
    JobFacts,
    Target,
    command_target,
    error_of,
    host_job_script,
    hosts_to_check,
    job_facts,
    job_problems,
    parse_host_job,
    verdict,
    warnings,
)


@pytest.mark.parametrize("command, target", [
    (["python", "train.py"], Target("script", "train.py")),
    (["python3", "-u", "train.py", "--lr", "1"], Target("script", "train.py")),
    (["python", "-W", "ignore", "-X", "dev", "sub/train.py"], Target("script", "sub/train.py")),
    (["python", "-Wignore", "-B", "train.py"], Target("script", "train.py")),
    (["/usr/bin/python3.11", "-m", "pkg.train", "--x"], Target("module", "pkg.train")),
    (["python", "-um", "trainer"], Target("module", "trainer")),
    (["python", "-mtrainer"], Target("module", "trainer")),
    (["python", "--", "train.py"], Target("script", "train.py")),
    (["python", "-c", "print(1)"], None),
    (["python", "-"], None),
    (["python"], None),
    (["bash", "run.sh", "--fast"], Target("script", "run.sh")),
    (["./train.py"], Target("script", "./train.py")),
    (["train.sh"], Target("script", "train.sh")),
    (["torchrun", "--nproc-per-node", "2", "train.py"], None),
    ([], None),
])
def test_command_target(command, target):
    assert command_target(command) == target


def _inventory(tmp_path: Path, command, *, workdir: Path | None = None, env=(), shared=False) -> Inventory:
    job = JobSpec(name="j", command=tuple(command), workdir=workdir or tmp_path, env=tuple(env),
                  shared_filesystem=shared)
    return Inventory(path=tmp_path / "hosts.toml", job=job, ssh=SSHSettings(), policy=Policy(), storage=Storage(),
                     hosts=(Host("h1", "local"),))


def test_job_problems_name_the_key_and_the_fix(tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__main__.py").write_text("")
    assert job_problems(_inventory(tmp_path, ["python", "train.py"])) == []
    assert job_problems(_inventory(tmp_path, ["python", "-m", "pkg"])) == []
    assert job_problems(_inventory(tmp_path, ["python", "-c", "pass"])) == []
    assert job_problems(_inventory(tmp_path, ["python", "/abs/train.py"])) == []

    [p] = job_problems(_inventory(tmp_path, ["python", "trian.py"]))
    assert isinstance(p, ConfigError) and p.key == "job.command" and p.exit_code == 2
    assert "trian.py" in p.message and "did you mean train.py" in p.message and "train.py" in p.hint

    [p] = job_problems(_inventory(tmp_path, ["python", "train.py"], workdir=tmp_path / "nope"))
    assert p.key == "job.workdir" and "does not exist" in p.message and "workdir" in p.hint

    [p] = job_problems(_inventory(tmp_path, ["python", "train.py"], env=[("A", "x\0y")]))
    assert p.key == "job.env.A" and "NUL" in p.message


def test_job_facts_find_a_module_in_the_workdir(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b.py").write_text("")
    assert job_facts(_inventory(tmp_path, ["python", "-m", "a.b"])) == JobFacts(Target("module", "a.b"), True)
    assert job_facts(_inventory(tmp_path, ["python", "-m", "a.c"])) == JobFacts(Target("module", "a.c"), False)


def _run_sh(script: str) -> str:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60).stdout


@pytest.mark.parametrize("command, shared, make, words", [
    (["python", "train.py"], False, False, None),  # nothing to check on the host
    (["python", "train.py"], True, True, []),
    (["python", "trian.py"], True, True, ["script"]),
    (["python", "train.py"], True, False, ["workdir"]),
    (["python", "-m", "json"], False, True, []),  # importable by the host's python
    (["python", "-m", "no_such_module_xyz"], False, True, ["module"]),
])
def test_host_job_checks_run_by_sh(tmp_path, command, shared, make, words):
    import sys

    wd = tmp_path / "code"
    if make:
        wd.mkdir()
        (wd / "train.py").write_text("")
    inv = _inventory(tmp_path, command, workdir=wd, shared=shared)
    facts = job_facts(inv)
    script = host_job_script(inv.job, facts, sys.executable)
    if words is None:
        assert script is None
        return
    checks = parse_host_job(_run_sh(script), inv.job, facts, sys.executable)
    assert [c.name for c in checks] == words
    assert all(c.status is Status.FAIL and c.fix for c in checks)


OK = Check("torch", Status.OK, "2.13.0")
NO_TORCH = Check("torch", Status.FAIL, "`import torch` failed: No module named 'torch'",
                 "install it for that interpreter")
UNREACH = Check("reachable", Status.FAIL, "connection refused", "check that sshd runs")
WARN = Check("python", Status.WARN, "3.10 (local 3.11)", "use 3.11")


def diag(name, *checks):
    return HostDiagnosis(name, name, tuple(checks))


SMI = Check("nvidia-smi", Status.FAIL, "did not answer in 10 s", "check the NVIDIA driver")


@pytest.mark.parametrize("diagnoses, running, passed, left_out, watched, error", [
    ([diag("a", OK), diag("b", WARN, OK)], [], ("a", "b"), [], (), False),
    ([diag("a", OK), diag("b", NO_TORCH)], [], ("a",), ["b"], (), False),
    ([diag("a", NO_TORCH), diag("b", NO_TORCH)], [], (), ["a", "b"], (), True),
    ([diag("a", NO_TORCH), diag("b", NO_TORCH)], ["c"], (), ["a", "b"], (), False),  # c trains
    ([diag("a", OK), diag("b", UNREACH)], [], ("a",), [], ("b",), False),
    ([diag("a", UNREACH)], [], (), [], ("a",), True),
    ([diag("a", OK), diag("b", SMI)], [], ("a",), [], ("b",), False),
    ([diag("a", OK), diag("b", SMI, NO_TORCH)], [], ("a",), ["b"], (), False),
    ([], [], (), [], (), False),
])
def test_verdict(diagnoses, running, passed, left_out, watched, error):
    v = verdict(diagnoses)
    assert v.passed == passed and sorted(v.left_out) == left_out and v.watched == watched
    for host in left_out:
        assert v.left_out[host].startswith(LEFT_OUT) and "fix: install it" in v.left_out[host]
    err = error_of(v, running=running)
    assert (err is not None) == error
    if err is not None:
        assert isinstance(err, HostError) and err.exit_code == 3
        for d in diagnoses:
            assert f"{d.host}: " in err.message
        assert "fix:" in err.message and "started nothing" in err.message
    lines = warnings(v)
    assert len(lines) == len(v.failed)
    assert all(line.startswith("warning: ") for line in lines)


def test_hosts_to_check_skip_running_and_scale_removed(tmp_path):
    inv = _inventory(tmp_path, ["python", "train.py"])
    inv = Inventory(path=inv.path, job=inv.job, ssh=inv.ssh, policy=inv.policy, storage=inv.storage,
                    hosts=tuple(Host(n, "local") for n in ("a", "b", "c", "d", "e")))
    status = {"hosts": [
        {"name": "a", "state": "running", "reason": "2 worker(s)"},
        {"name": "b", "state": "removed", "reason": "removed by `eltctl scale --remove`; ..."},
        {"name": "c", "state": "removed", "reason": f"{LEFT_OUT}: torch: ..."},
        {"name": "d", "state": "cooldown", "reason": "worker crashed"}]}
    check, running = hosts_to_check(inv, status)
    assert [h.name for h in check] == ["c", "d", "e"] and running == ["a"]
    check, running = hosts_to_check(inv, None)
    assert [h.name for h in check] == ["a", "b", "c", "d", "e"] and running == []


def test_hosts_to_check_skip_disabled_and_cordoned(tmp_path):
    from eltctl.inventory.hours import HostSchedule

    inv = _inventory(tmp_path, ["python", "train.py"])
    hosts = (Host("a", "local", schedule=HostSchedule(enabled=False)), Host("b", "local"), Host("c", "local"))
    inv = Inventory(path=inv.path, job=inv.job, ssh=inv.ssh, policy=inv.policy, storage=inv.storage, hosts=hosts)
    status = {"hosts": [{"name": "b", "state": "cordoned", "reason": "cordoned by `eltctl cordon`; ..."}]}
    check, running = hosts_to_check(inv, status)
    assert [h.name for h in check] == ["c"] and running == []

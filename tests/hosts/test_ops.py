"""Host operations on a real host through the local transport (no SSH needed).
The state directory's tests are in tests/controller/test_statedir.py, `down` and `scale`
without a controller in tests/commands/."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from eltctl.hosts import ops as hostops
from eltctl.hosts.layout import HostPaths
from eltctl.hosts.local import LocalTransport
from eltctl.inventory import Host


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture
def host_t(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    host = Host(name="here", address="local", python=sys.executable, env=(("HOME", str(home)),))
    return host, LocalTransport(host, default_timeout=60), home


# ------------------------------------------------------------------- sync plan (pure)

@pytest.mark.parametrize("local, remote, sent, deleted", [
    ({}, {}, (), ()),
    ({"a.py": "1"}, {}, ("a.py",), ()),
    ({"a.py": "1"}, {"a.py": "1"}, (), ()),
    ({"a.py": "2"}, {"a.py": "1"}, ("a.py",), ()),
    ({"a.py": "1"}, {"a.py": "1", "old.py": "9"}, (), ("old.py",)),
    ({"d/b.py": "1", "a.py": "1"}, {"a.py": "0"}, ("a.py", "d/b.py"), ()),
])
def test_plan_sync_sends_only_changes_and_deletes_what_is_gone(local, remote, sent, deleted):
    plan = hostops.plan_sync(local, remote)
    assert (plan.sent, plan.deleted) == (sent, deleted)


def test_runtime_digest_follows_contents():
    files = {"a.py": b"x", "b.py": b"y"}
    assert hostops.runtime_digest(files) == hostops.runtime_digest(dict(files))
    assert hostops.runtime_digest(files) != hostops.runtime_digest({"a.py": b"x", "b.py": b"z"})
    assert hostops.runtime_digest(files) != hostops.runtime_digest({"a.py": b"x"})


# ------------------------------------------------------------------- on a real host

def test_runtime_is_shipped_once_and_importable(host_t):
    host, t, home = host_t
    paths = run(hostops.host_paths(t, "j"))
    assert paths.home == str(home)
    target, sent = run(hostops.ensure_runtime(t, paths))
    assert sent and target.startswith(f"{home}/.eltctl/runtime/")
    package = Path(target) / "eltctl_runtime"
    shipped = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py"))
    assert shipped == sorted(hostops.runtime_files())
    assert run(hostops.ensure_runtime(t, paths)) == (target, False)  # present: not sent again
    r = subprocess.run([sys.executable, "-c", "import eltctl_runtime.member.plan as m; print(m.__file__)"],
                       env={**os.environ, "PYTHONPATH": target}, capture_output=True, text=True, cwd=home)
    assert r.stdout.strip().startswith(target)


def test_runtime_files_take_subpackages_and_skip_caches(tmp_path):
    src = tmp_path / "runtime"
    (src / "daemon" / "__pycache__").mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "daemon" / "__init__.py").write_text("")
    (src / "daemon" / "logic.py").write_text("X = 1\n")
    (src / "daemon" / "__pycache__" / "logic.cpython-312.py").write_text("junk\n")
    (src / "notes.txt").write_text("not shipped\n")
    assert sorted(hostops.runtime_files(src)) == ["__init__.py", "daemon/__init__.py", "daemon/logic.py"]


def test_a_nested_runtime_module_is_shipped_and_importable(host_t, tmp_path):
    host, t, home = host_t
    src = tmp_path / "runtime"
    (src / "daemon").mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "daemon" / "__init__.py").write_text("")
    (src / "daemon" / "logic.py").write_text("ANSWER = 42\n")
    files = hostops.runtime_files(src)
    paths = run(hostops.host_paths(t, "j"))
    target, sent = run(hostops.ensure_runtime(t, paths, files))
    assert sent and (Path(target) / "eltctl_runtime" / "daemon" / "logic.py").read_text() == "ANSWER = 42\n"
    r = subprocess.run([sys.executable, "-c", "import eltctl_runtime.daemon.logic as m; print(m.ANSWER, m.__file__)"],
                       env={**os.environ, "PYTHONPATH": target}, capture_output=True, text=True, cwd=home)
    assert r.returncode == 0, r.stderr
    answer, where = r.stdout.split()
    assert answer == "42" and where.startswith(target)


def test_code_sync_sends_changes_and_deletes_removed_files(host_t, tmp_path):
    host, t, home = host_t
    work = tmp_path / "work"
    (work / "pkg").mkdir(parents=True)
    (work / "train.py").write_text("print(1)\n")
    (work / "pkg" / "m.py").write_text("X = 1\n")
    (work / "__pycache__").mkdir()
    (work / "__pycache__" / "junk.pyc").write_bytes(b"\0")
    (work / "run.sh").write_text("#!/bin/sh\n")
    (work / "run.sh").chmod(0o755)
    dest = f"{home}/code"
    first = run(hostops.sync_code(t, work, dest))
    assert first.sent == ("pkg/m.py", "run.sh", "train.py") and first.deleted == ()
    assert (Path(dest) / "pkg" / "m.py").read_text() == "X = 1\n"
    assert os.access(Path(dest) / "run.sh", os.X_OK)
    assert not (Path(dest) / "__pycache__").exists()
    assert run(hostops.sync_code(t, work, dest)) == hostops.SyncResult((), ())
    (work / "train.py").write_text("print(2)\n")
    (work / "pkg" / "m.py").unlink()
    third = run(hostops.sync_code(t, work, dest))
    assert third == hostops.SyncResult(("train.py",), ("pkg/m.py",))
    assert (Path(dest) / "train.py").read_text() == "print(2)\n" and not (Path(dest) / "pkg" / "m.py").exists()


def test_job_processes_finds_the_job_by_its_environment_and_host(host_t):
    host, t, home = host_t
    job = f"j{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "ELTCTL_JOB": job}
    mine = subprocess.Popen(["sleep", "60"], env={**env, "ELTCTL_HOST": "here"})
    other_host = subprocess.Popen(["sleep", "60"], env={**env, "ELTCTL_HOST": "elsewhere"})
    no_host = subprocess.Popen(["sleep", "60"], env=env)
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        found = {p.pid for p in run(hostops.job_processes(t, job))}
        assert found == {mine.pid, no_host.pid}
        run(hostops.kill_pids(t, [mine.pid, no_host.pid], "KILL"))
        mine.wait(10), no_host.wait(10)
        assert run(hostops.job_processes(t, job)) == []
    finally:
        for p in (mine, other_host, no_host, stranger):
            p.kill()
            p.wait()


def test_daemon_config_names_the_gpus_or_cpu_slots(tmp_path):
    from eltctl.inventory import parse_inventory

    inv = parse_inventory('[job]\nname = "j"\ncommand = "python t.py"\n[policy]\nhang_timeout = "5s"\n'
                          '[[hosts]]\nname = "a"\naddress = "a"\nslots = 3\n', tmp_path / "hosts.toml")
    paths = HostPaths(home="/h", job="j", host="a")
    gpu = hostops.daemon_config(inv, inv.hosts[0], paths, "10.0.0.5:1234", (0, 1))
    cpu = hostops.daemon_config(inv, inv.hosts[0], paths, "10.0.0.5:1234", None)
    assert (gpu["device"], gpu["gpus"], cpu["device"], cpu["gpus"], cpu["slots"]) == ("cuda", [0, 1], "cpu", None, 3)
    assert gpu["job_dir"] == "/h/.eltctl/jobs/j/a" and gpu["code_dir"] == "/h/.eltctl/jobs/j/a/code"
    assert gpu["hang_timeout"] == 5.0 and gpu["store"] == "10.0.0.5:1234"
    assert (gpu["mode"], gpu["stop_grace"]) == ("elastic", 30.0)



@pytest.mark.parametrize("device", ["auto", "cpu", "cuda"])
@pytest.mark.parametrize("gpus", [(0, 1), (3,), None, ()])
def test_the_slots_the_controller_expects_are_those_the_daemon_reports(tmp_path, device, gpus):
    """daemon_slot_kind (what the controller compares a running daemon's state with) says
    what the daemon started with daemon_config's document reports as slot_kind and
    valid_slots (runtime/daemon/config.py), for every job device."""
    from eltctl.inventory import parse_inventory
    from eltctl_runtime.daemon.config import DaemonConfig

    inv = parse_inventory(f'[job]\nname = "j"\ncommand = "python t.py"\ndevice = "{device}"\n'
                          '[[hosts]]\nname = "a"\naddress = "a"\nslots = 2\n', tmp_path / "hosts.toml")
    config = hostops.daemon_config(inv, inv.hosts[0], HostPaths(home="/h", job="j", host="a"), "10.0.0.5:1", gpus)
    cfg = DaemonConfig.from_json(json.dumps(config))
    assert cfg.follow_gpus == bool(gpus)  # the probe's GPUs: followed
    assert hostops.daemon_slot_kind(inv, inv.hosts[0], gpus) == ("gpu" if cfg.gpu_host else "cpu", cfg.valid_slots)


def test_only_a_daemon_whose_gpus_came_from_the_probe_follows_them(tmp_path):
    """The inventory's `gpus` pin a host's GPU slots; the probe's list is followed (the
    daemon reads nvidia-smi's list itself); a CPU host has no GPUs to follow."""
    from eltctl.inventory import parse_inventory
    from eltctl_runtime.daemon.config import DaemonConfig

    inv = parse_inventory('[job]\nname = "j"\ncommand = "python t.py"\n'
                          '[[hosts]]\nname = "a"\naddress = "a"\n'
                          '[[hosts]]\nname = "b"\naddress = "b"\ngpus = [0, 1]\n', tmp_path / "hosts.toml")
    probed, pinned = inv.hosts
    docs = {(h.name, g): hostops.daemon_config(inv, h, HostPaths(home="/h", job="j", host=h.name), "10.0.0.5:1", g)
            for h, g in ((probed, (0, 1)), (probed, None), (pinned, (0, 1)))}
    assert {k: d["follow_gpus"] for k, d in docs.items()} == {("a", (0, 1)): True, ("a", None): False,
                                                               ("b", (0, 1)): False}
    assert DaemonConfig.from_json(json.dumps(docs[("a", (0, 1))])).follow_gpus

# ------------------------------------------------------------------- the layout and the programs

def test_layout_names_the_files_the_runtime_writes():
    from eltctl.hosts import layout

    runtime = "\n".join(data.decode() for data in hostops.runtime_files().values())
    for name in (layout.DAEMON_PID, layout.DAEMON_LOG, layout.DAEMON_MEMORY, layout.WORKERS_DIR):
        assert f'"{name}"' in runtime, name
    paths = HostPaths(home="/h", job="j", host="a")
    assert (paths.job_dir, paths.daemon_json, paths.checkpoint_dir, paths.runtime_dir("ab")) == (
        "/h/.eltctl/jobs/j/a", "/h/.eltctl/jobs/j/a/daemon.json", "/h/.eltctl/jobs/j/a/checkpoints",
        "/h/.eltctl/runtime/ab")
    assert layout.checkpoint_host(f"{paths.checkpoint_dir}/step-00000001", "j") == "a"
    assert layout.job_dir_in(Path("/h"), "j", "a") == Path(paths.job_dir)


def test_host_programs_run_from_their_source_with_python_c(tmp_path):
    from eltctl.hosts import programs

    (tmp_path / "a.py").write_text("x\n")
    cmd = programs.command(sys.executable, "manifest", str(tmp_path), "[]", "[]")
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    assert r.returncode == 0 and list(json.loads(r.stdout)) == ["a.py"]
    with pytest.raises(ValueError):
        programs.source("nonexistent")

"""The doctor's judgements (tables of cases) and a local host diagnosed for real.

Hosts behind real sshd (unknown/changed keys, --accept-new) are in tests/test_doctor_sshd.py.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from eltctl.doctor import (
    MARK,
    Check,
    RemoteFacts,
    Status,
    Versions,
    check_nvidia_smi,
    check_python,
    check_torch,
    check_workdir,
    connection_checks,
    diagnose_fleet,
    local_versions,
    parse_remote_facts,
)
from eltctl.errors import HostError
from eltctl.inventory import Host, Policy
from eltctl.probe import parse_probe_output
from eltctl.hosts.fleet import Fleet
from eltctl.hosts.transport import ErrorKind

LOCAL = Versions(python="3.11.7", torch="2.13.0+cpu")


def facts(py="3.11.4", torch="2.13.0", path="/usr/bin/python3", workdir=True, py_error="", torch_error=""):
    return RemoteFacts(python_path=path, python_version=py, python_error=py_error, torch_version=torch,
                       torch_error=torch_error, workdir_ok=workdir, workdir_error="" if workdir else "denied")


def _doctor_output(*, path="/usr/bin/python3", py="3.11.4", py_rc=0, torch="torch=2.13.0", workdir="ok"):
    return "\n".join([f"{MARK}python-path", path, f"{MARK}python", py, f"{MARK}python-rc {py_rc}",
                      f"{MARK}torch", torch, f"{MARK}workdir", workdir, f"{MARK}end"]) + "\n"


@pytest.mark.parametrize("text, expected", [
    (_doctor_output(), facts()),
    (_doctor_output(path="", py="sh: 1: python3: not found", py_rc=127, torch="sh: 1: python3: not found"),
     RemoteFacts(None, None, "sh: 1: python3: not found", None, "sh: 1: python3: not found", True, "")),
    (_doctor_output(torch="Traceback (most recent call last):\nModuleNotFoundError: No module named 'torch'"),
     facts(torch=None, torch_error="ModuleNotFoundError: No module named 'torch'")),
    (_doctor_output(workdir="failed: mkdir: cannot create directory: Permission denied"),
     RemoteFacts("/usr/bin/python3", "3.11.4", "", "2.13.0", "", False,
                 "failed: mkdir: cannot create directory: Permission denied")),
])
def test_parse_remote_facts(text, expected):
    assert parse_remote_facts(text) == expected


@pytest.mark.parametrize("f, status, words", [
    (facts(), Status.OK, ["3.11.4"]),
    (facts(py="3.10.12"), Status.WARN, ["major.minor differ", "3.11.7"]),
    (facts(py=None, path=None), Status.FAIL, ["not found"]),
    (facts(py=None, py_error="Illegal instruction"), Status.FAIL, ["does not run", "Illegal instruction"]),
])
def test_check_python(f, status, words):
    c = check_python(f, LOCAL, "python3")
    assert c.status is status, c
    assert all(w in c.detail for w in words), c
    assert (c.fix is not None) == (status is not Status.OK)


@pytest.mark.parametrize("f, local, status, words", [
    (facts(torch="2.13.0+cu121"), LOCAL, Status.OK, ["2.13.0"]),
    (facts(torch="2.13.1"), LOCAL, Status.WARN, ["local 2.13.0+cpu"]),
    (facts(torch="2.12.0"), LOCAL, Status.FAIL, ["local is 2.13.0+cpu"]),
    (facts(torch=None, torch_error="No module named 'torch'"), LOCAL, Status.FAIL, ["No module named"]),
    (facts(torch="2.6.0"), Versions("3.11.7", None), Status.OK, ["no local torch"]),
    (facts(torch="2.5.1+cu121"), Versions("3.11.7", None), Status.FAIL, ["older than 2.6", "weights_only"]),
    (facts(torch="2.2.0"), LOCAL, Status.FAIL, ["older than 2.6"]),
    (facts(py=None), LOCAL, Status.SKIP, []),
])
def test_check_torch(f, local, status, words):
    c = check_torch(f, local, "python3")
    assert c.status is status, c
    assert all(w in c.detail for w in words), c
    if status in (Status.FAIL, Status.WARN):
        assert "pip install torch==2.13.0" in c.fix or "pip install torch" in c.fix


def _probe(smi="/usr/bin/nvidia-smi", rc=0, gpus="0, GPU-1, NVIDIA A100, 0, 40960, 0"):
    lines = [f"{MARK}probe 1", f"{MARK}smi", smi or ""]
    if smi:
        lines += [f"{MARK}gpus {rc}", gpus]
        if rc == 0:
            lines += [f"{MARK}apps 0", f"{MARK}owners"]
    lines.append(f"{MARK}end")
    return parse_probe_output("\n".join(lines))


@pytest.mark.parametrize("probe, status, words", [
    (_probe(), Status.OK, ["1 GPU(s)", "NVIDIA A100"]),
    (_probe(smi=None), Status.OK, ["CPU-only", "2 slot"]),
    (_probe(rc=9, gpus="NVIDIA-SMI has failed"), Status.FAIL, ["exit 9", "NVIDIA-SMI has failed"]),
    (_probe(rc=124, gpus=""), Status.FAIL, ["did not answer in 10 s"]),
    (_probe(gpus="No devices were found"), Status.WARN, ["no GPUs"]),
])
def test_check_nvidia_smi(probe, status, words):
    c = check_nvidia_smi(probe, Policy(), Host("h", "x", slots=2))
    assert c.status is status, c
    assert all(w in c.detail for w in words), c


def test_check_workdir():
    assert check_workdir(facts()).status is Status.OK
    bad = check_workdir(facts(workdir=False))
    assert bad.status is Status.FAIL and "mkdir -p ~/.eltctl" in bad.fix


@pytest.mark.parametrize("kind, names, failing", [
    (None, ["reachable", "host key", "auth"], None),
    (ErrorKind.UNREACHABLE, ["reachable"], "reachable"),
    (ErrorKind.TIMEOUT, ["reachable"], "reachable"),
    (ErrorKind.HOST_KEY_UNKNOWN, ["reachable", "host key"], "host key"),
    (ErrorKind.HOST_KEY_CHANGED, ["reachable", "host key"], "host key"),
    (ErrorKind.AUTH, ["reachable", "host key", "auth"], "auth"),
])
def test_connection_checks_name_the_first_problem(kind, names, failing):
    err = None if kind is None else HostError("h", "boom", kind=kind, hint="do this")
    checks = connection_checks(err)
    assert [c.name for c in checks] == names
    assert [c.name for c in checks if c.status is Status.FAIL] == ([failing] if failing else [])
    for c in checks:
        if c.status is Status.FAIL:
            assert c.fix == "do this" and c.detail == "boom"


def test_local_versions_do_not_import_torch():
    v = local_versions()
    assert v.python.startswith(f"{sys.version_info[0]}.{sys.version_info[1]}.")
    assert "torch" not in sys.modules or True  # other tests may import it; the call itself must not
    import subprocess

    code = ("import sys; from eltctl.doctor import local_versions; v = local_versions(); "
            "print(v.torch, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    torch_version, imported = out.split()
    assert imported == "False" and torch_version != ""


def test_a_local_host_is_diagnosed_for_real(tmp_path):
    good = Host("good", "local", python=sys.executable, env=(("HOME", str(tmp_path / "home")),))
    nopy = Host("nopy", "local", python="/nonexistent/python3", env=(("HOME", str(tmp_path / "home2")),))
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / ".eltctl").write_text("a file where the directory should be")
    badwd = Host("badwd", "local", python=sys.executable, env=(("HOME", str(tmp_path / "ro")),))

    async def main():
        async with Fleet([good, nopy, badwd]) as fleet:
            return await diagnose_fleet(fleet, policy=Policy(nvidia_smi_timeout=5))

    by = {d.host: d for d in asyncio.run(main())}
    g = by["good"]
    assert g.ok, g.checks
    assert g.check("python").status is Status.OK
    assert g.check("torch").status is Status.OK  # the same interpreter as ours
    assert g.check("work directory").status is Status.OK and (tmp_path / "home" / ".eltctl").is_dir()
    assert g.check("nvidia-smi").status is Status.OK
    n = by["nopy"]
    assert not n.ok and n.check("python").status is Status.FAIL and "not found" in n.check("python").detail
    assert n.check("torch").status is Status.SKIP
    b = by["badwd"]
    assert not b.ok and b.check("work directory").status is Status.FAIL
    assert isinstance(b.checks[0], Check)


def test_doctor_runs_the_job_checks_up_runs_on_the_inventory_init_writes(tmp_path):
    """Issue 25, finding 10: `doctor` said "2 of 2 host(s) ready" for a job whose workdir
    did not exist (only `up` caught it), and the first `doctor` after `init` failed on
    made-up hosts. Now `init`'s file, with its command set, passes `doctor`; a missing
    script or workdir fails it (exit 2, as `up` refuses it), with the fix."""
    import os
    import subprocess

    proj = tmp_path / "proj"
    proj.mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}
    env.pop("ELTCTL_INVENTORY", None)

    def eltctl(*args):
        return subprocess.run([sys.executable, "-m", "eltctl", *args], cwd=proj, env=env, capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)

    assert eltctl("init").returncode == 0
    inv = proj / "hosts.toml"
    starter = inv.read_text()
    inv.write_text(starter.replace('workdir = "."', 'workdir = "nowhere"'))
    r = eltctl("doctor")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "FAIL" in r.stdout and "job.workdir: the job's code directory" in r.stdout, r.stdout
    assert "does not exist on this machine" in r.stdout and "fix: set [job] workdir" in r.stdout, r.stdout
    assert "the job has 1 problem(s); 1 of 1 host(s) ready" in r.stdout

    # init's file as written, once its command's script exists: doctor passes.
    inv.write_text(starter)
    (proj / "train.py").write_text("print('a training script')\n")
    r = eltctl("doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "job proj (this machine): ok" in r.stdout and "job ok; 1 of 1 host(s) ready" in r.stdout


# ---------------------------------------------------------------- the script's imports (issue 50, finding 10)

def run_script_imports(source: str, neighbours=(), paths=()) -> dict:
    """The host program as a host runs it: `python -c <program> ...` with the script on stdin."""
    import json
    import subprocess

    from eltctl.hosts import programs

    r = subprocess.run(programs.command(sys.executable, "script_imports", json.dumps(list(neighbours)),
                                        json.dumps(list(paths))), shell=True, input=source, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_script_imports_are_found_without_running_the_script(tmp_path):
    marker = tmp_path / "ran"
    found = run_script_imports(f'"""doc"""\nimport os, json\nfrom collections import abc\nimport model\n'
                               f'import nosuchmodule_xyz.sub\nfrom . import rel\n'
                               f'open({str(marker)!r}, "w")\n'
                               f'import later_nosuch  # after other code: maybe after a sys.path edit\n'
                               f'try:\n    import optional_nosuch\nexcept ImportError:\n    pass\n',
                               neighbours=["model"])
    assert found["missing"] == [["nosuchmodule_xyz", 5]] and found["checked"] == 5
    assert not marker.exists()  # nothing of the script ran
    assert run_script_imports("import os\ndef f(:\n    pass\n")["syntax"]["line"] == 2
    lib = tmp_path / "lib"
    (lib / "extra_pkg_xyz").mkdir(parents=True)
    (lib / "extra_pkg_xyz" / "__init__.py").write_text("raise SystemExit('imported!')\n")
    assert run_script_imports("import extra_pkg_xyz\n", paths=[str(lib)])["missing"] == []


@pytest.mark.parametrize("answer, status, words", [
    ('{"python": "3.11.2", "checked": 3, "missing": []}', Status.OK, "its 3 top-level import(s) are found"),
    ('{"python": "3.11.2", "checked": 3, "missing": [["tqdm", 4]]}', Status.FAIL,
     "train.py imports what python3 (Python 3.11.2) on the host cannot find: tqdm (line 4)"),
    ('{"python": "3.8.1", "syntax": {"line": 7, "message": "invalid syntax"}}', Status.FAIL,
     "train.py line 7 does not compile with the host's Python 3.8.1: invalid syntax"),
    ("Traceback ...", Status.WARN, "gave no answer"),
])
def test_script_imports_check(answer, status, words):
    from eltctl.doctor import script_imports_check

    check = script_imports_check(answer, "train.py", "python3")
    assert check.status is status and words in check.detail, check


def test_doctor_fails_a_script_whose_import_is_broken(tmp_path):
    """`doctor` passed a script whose `import` fails on the host; the workers then all
    crashed at start. Its top-level imports are now found (not run) by the host's Python."""
    import os
    import subprocess

    proj = tmp_path / "proj"
    proj.mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}
    env.pop("ELTCTL_INVENTORY", None)
    assert subprocess.run([sys.executable, "-m", "eltctl", "init"], cwd=proj, env=env, capture_output=True,
                          timeout=300, stdin=subprocess.DEVNULL).returncode == 0
    (proj / "model.py").write_text("X = 1\n")
    (proj / "train.py").write_text("import os\nimport model\nimport eltctl_runtime\nimport tqdm_not_installed_xyz\n"
                                   "print('training')\n")
    r = subprocess.run([sys.executable, "-m", "eltctl", "doctor"], cwd=proj, env=env, capture_output=True, text=True,
                       timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 3, r.stdout + r.stderr
    assert ("FAIL script imports: train.py imports what" in r.stdout
            and "cannot find: tqdm_not_installed_xyz (line 4)" in r.stdout), r.stdout
    assert "install the package that provides tqdm_not_installed_xyz" in r.stdout

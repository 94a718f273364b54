"""The test bed itself: real sshd hosts, their environment, the simulated nvidia-smi,
foreign and own processes on GPUs, host keys, crashes and teardown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eltctl.sim import nvidia_smi
from eltctl.sim.gpustate import DRIVER_FAILURE_MESSAGE, GpuState, install_nvidia_smi
from tests.testbed import PYTHON, Testbed, make_testbed, sshd_missing_reason
from tests.testbed.jobenv import end_job
from tests.testbed.sshd import SshdConfig, banner_ready

pytestmark = pytest.mark.sshd
needs_sshd = pytest.mark.skipif(sshd_missing_reason() is not None, reason=str(sshd_missing_reason()))

GPU_QUERY = "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu"
APPS_QUERY = "--query-compute-apps=gpu_uuid,pid,used_memory,process_name"
CSV = "--format=csv,noheader,nounits"


def ssh(host, command: str, *, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(host.ssh_argv(command), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"ssh {host.name} {command!r}: exit {result.returncode}\n{result.stderr}")
    return result


def rows(text: str) -> list[list[str]]:
    return [line.split(", ") for line in text.splitlines() if line]


def sleepers(host, n: int) -> list[int]:
    """The host's `sleep` processes, once there are `n` (a backgrounded command
    may not have exec'd yet when ssh returns)."""
    found: list[int] = []

    def ready() -> bool:
        found[:] = [p for p in host.pids() if _cmdline(p).startswith(b"sleep")]
        return len(found) == n
    assert wait_until(ready), f"expected {n} sleep processes on {host.name}, found {found}"
    return found


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# -- sessions and their environment -------------------------------------------------


def test_session_environment_is_per_host(testbed):
    h1, h2 = testbed.add_host("h1"), testbed.add_host("h2")
    for host in (h1, h2):
        out = ssh(host, 'echo "$HOME"; echo "$PATH"; echo "$ELTSIM_HOST"; echo "$ELTSIM_STATE"; pwd; '
                        'command -v nvidia-smi; command -v python').stdout.splitlines()
        assert out[0] == str(host.home)
        assert out[1] == f"{host.dir / 'bin'}:/usr/local/bin:/usr/bin:/bin"
        assert out[2] == host.name
        assert out[3] == str(host.dir / "gpus.json")
        assert out[4] == str(host.home)  # a command starts in the host's home
        assert out[5] == str(host.dir / "bin" / "nvidia-smi")
        assert out[6] == str(host.dir / "bin" / "python")
    assert h1.home != h2.home and h1.address != h2.address


@pytest.mark.skipif(os.geteuid() != 0, reason="a login account of its own needs root (useradd)")
def test_a_host_can_log_in_as_an_account_of_its_own(testbed):
    """As on a lab whose machines' accounts differ from the control machine's: h2's sessions
    run as eltsim-h2, which owns h2's directory and runs the host interpreter; h1 stays ours."""
    h1, h2 = testbed.add_host("h1"), testbed.add_host("h2", login=True)
    assert h1.user == testbed.user and h2.user == "eltsim-h2"
    out = ssh(h2, 'id -un; pwd; touch "$HOME/mine" && stat -c %U "$HOME/mine"; '
                  'python -c "import torch, sys; print(sys.version_info[0])" 2>/dev/null').stdout.split()
    assert out == ["eltsim-h2", str(h2.home), "eltsim-h2", "3"]
    assert ssh(h1, "id -un").stdout.strip() == testbed.user
    assert f'user = "eltsim-h2"' in testbed.write_inventory().read_text()


def test_host_python_has_torch_and_nothing_else(testbed):
    """A host has what `pip install torch==2.13.0` leaves: the host interpreter, not the test tools'."""
    host = testbed.add_host()
    out = ssh(host, "python -c 'import sys, torch; print(sys.prefix)'; python3 -c 'import numpy'", check=False)
    prefix = subprocess.run([PYTHON, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True)
    assert out.stdout.strip() == prefix.stdout.strip() != sys.prefix
    assert "No module named 'numpy'" in out.stderr


def test_a_host_holds_a_torch_stamp_that_up_believes(testbed):
    """Each host's home holds the record of a good `import torch` (torchstamp.py) that
    `up`'s check (doctor_script with torch_cached) matches: it answers from the stamp,
    which it would replace (a new inode) had it imported torch again."""
    import shlex

    from eltctl.doctor import TORCH_STAMP, doctor_script, parse_remote_facts

    host = testbed.add_host()
    stamp = host.home / TORCH_STAMP
    before = stamp.stat()
    out = ssh(host, "sh -c " + shlex.quote(doctor_script(host.python, torch_cached=True)))
    facts = parse_remote_facts(out.stdout)
    assert facts.torch_version and stamp.read_text().splitlines()[1] == f"torch={facts.torch_version}"
    assert stamp.stat().st_ino == before.st_ino, "the check imported torch: the stamp does not match the host"
    with Testbed(torch_seen=False) as fresh:  # hosts that never ran eltctl: none
        bare = fresh.add_host("bare")
        assert not (bare.home / TORCH_STAMP).exists()


def test_asyncssh_sees_the_host_environment(testbed):
    asyncssh = pytest.importorskip("asyncssh")
    host = testbed.add_host()

    async def probe() -> str:
        async with asyncssh.connect(host.address, host.port, known_hosts=str(testbed.known_hosts),
                                    client_keys=[str(testbed.client_key)], username=testbed.user) as conn:
            result = await conn.run('echo $HOME; which nvidia-smi; echo $ELTSIM_HOST', check=True)
            async with conn.start_sftp_client() as sftp:
                await sftp.put(str(marker), "put-by-sftp.txt")  # relative: lands in HOME
            return result.stdout

    marker = testbed.dir / "marker.txt"
    marker.write_text("hello")
    out = asyncio.run(asyncio.wait_for(probe(), 60)).splitlines()
    assert out == [str(host.home), str(host.dir / "bin" / "nvidia-smi"), host.name]
    assert (host.home / "put-by-sftp.txt").read_text() == "hello"


def test_inventory_lists_hosts_with_test_credentials(testbed):
    tomllib = pytest.importorskip("tomllib")
    hosts = testbed.add_hosts(2)
    path = testbed.write_inventory(job={"name": "demo", "command": ["python", "-c", "print(1)"]},
                                   extra='[policy]\nidle_for = 0')
    data = tomllib.loads(path.read_text())
    assert data["job"]["name"] == "demo" and data["job"]["workdir"] == "."
    assert data["ssh"]["identity_file"] == str(testbed.client_key)
    assert data["ssh"]["known_hosts"] == str(testbed.known_hosts)
    assert [(h["name"], h["address"], h["port"]) for h in data["hosts"]] == \
        [(h.name, h.address, h.port) for h in hosts]
    assert data["hosts"][0]["python"] == PYTHON
    assert data["policy"]["idle_for"] == 0


# -- the simulated nvidia-smi over ssh --------------------------------------------------


def test_gpu_query_ok_mode_all_format_variants(testbed):
    host = testbed.add_host(gpus=2)
    host.set_gpu(1, memory_used_mib=1234, utilization=7)
    plain = rows(ssh(host, f"nvidia-smi {GPU_QUERY} {CSV}").stdout)
    assert [r[0] for r in plain] == ["0", "1"]
    assert plain[1][2:] == ["NVIDIA A100-SXM4-40GB", "1234", "40960", "7"]
    assert plain[0][1].startswith("GPU-") and plain[0][1] != plain[1][1]

    full = ssh(host, f"nvidia-smi {GPU_QUERY} --format=csv").stdout.splitlines()
    assert full[0] == "index, uuid, name, memory.used [MiB], memory.total [MiB], utilization.gpu [%]"
    assert full[2].endswith(", 1234 MiB, 40960 MiB, 7 %")

    units = ssh(host, f"nvidia-smi {GPU_QUERY} --format=csv,noheader").stdout.splitlines()
    assert len(units) == 2 and units[1] == full[2]

    extra = rows(ssh(host, f"nvidia-smi --query-gpu=pci.bus_id,driver_version,index {CSV}").stdout)
    assert extra[0][1] == "535.129.03" and extra[1][2] == "1" and extra[0][0] != extra[1][0]

    listing = ssh(host, "nvidia-smi -L").stdout.splitlines()
    assert listing[1] == f"GPU 1: NVIDIA A100-SXM4-40GB (UUID: {plain[1][1]})"
    assert "DRIVER version" in ssh(host, "nvidia-smi --version").stdout
    assert "A100" in ssh(host, "nvidia-smi").stdout


def test_na_mode_reports_not_available_fields(testbed):
    host = testbed.add_host(gpus=1)
    host.set_mode("na")
    host.start_foreign_process(0, memory_mib=3000, user=None)
    gpu = rows(ssh(host, f"nvidia-smi {GPU_QUERY} {CSV}").stdout)[0]
    assert gpu[5] == "[N/A]" and gpu[3] == "3000"
    with_units = ssh(host, f"nvidia-smi {GPU_QUERY} --format=csv,noheader").stdout
    assert with_units.strip().endswith("3000 MiB, 40960 MiB, [N/A]")
    app = rows(ssh(host, f"nvidia-smi {APPS_QUERY} {CSV}").stdout)[0]
    assert app[2] == "[N/A]"
    host.set_mode("ok")
    host.set_gpu(0, utilization="[Not Supported]")
    assert rows(ssh(host, f"nvidia-smi {GPU_QUERY} {CSV}").stdout)[0][5] == "[Not Supported]"


def test_fail_mode_prints_driver_message_and_exits_9(testbed):
    host = testbed.add_host()
    host.set_mode("fail")
    result = ssh(host, f"nvidia-smi {GPU_QUERY} {CSV}", check=False)
    assert result.returncode == 9
    assert result.stdout.strip() == DRIVER_FAILURE_MESSAGE


def test_hang_mode_never_answers_and_is_cleaned_up(testbed):
    host = testbed.add_host()
    host.set_mode("hang")
    result = ssh(host, f"timeout 2 nvidia-smi {GPU_QUERY} {CSV}; echo status=$?", timeout=60)
    assert result.stdout.strip() == "status=124"
    # Without a timeout the call stays behind on the host until the host goes away.
    ssh(host, f"setsid nvidia-smi {GPU_QUERY} {CSV} </dev/null >/dev/null 2>&1 &")
    assert wait_until(lambda: any(b"nvidia" in _cmdline(p) for p in host.pids()))
    hung = [p for p in host.pids() if b"nvidia" in _cmdline(p)]
    host.crash()
    assert not any(_alive(p) for p in hung)


def test_missing_mode_has_no_nvidia_smi_on_path(testbed):
    host = testbed.add_host()
    host.set_mode("missing")
    result = ssh(host, "command -v nvidia-smi; echo status=$?")
    assert result.stdout.strip() == "status=1"
    host.set_mode("ok")
    assert ssh(host, "command -v nvidia-smi").stdout.strip() == str(host.dir / "bin" / "nvidia-smi")


# -- processes on GPUs -------------------------------------------------------------------


def test_foreign_process_is_listed_with_its_real_pid_until_stopped(testbed):
    host = testbed.add_host(gpus=2)
    pid = host.start_foreign_process(1, memory_mib=2000, utilization=50)
    apps = rows(ssh(host, f"nvidia-smi {APPS_QUERY} {CSV}").stdout)
    gpus = rows(ssh(host, f"nvidia-smi {GPU_QUERY} {CSV}").stdout)
    assert apps == [[gpus[1][1], str(pid), "2000", "sleep"]]
    assert gpus[1][3] == "2000" and gpus[1][5] == "50" and gpus[0][3] == "0"
    owner = ssh(host, f"ps -o user= -p {pid}").stdout.strip()
    expected = "eltsim" if os.geteuid() == 0 else testbed.user
    assert owner == expected
    header = ssh(host, f"nvidia-smi {APPS_QUERY},gpu_bus_id,name --format=csv").stdout.splitlines()[0]
    assert header == "gpu_uuid, pid, used_gpu_memory [MiB], process_name, gpu_bus_id, process_name"

    host.stop_foreign_process(pid)
    assert not _alive(pid)
    assert ssh(host, f"nvidia-smi {APPS_QUERY} {CSV}").stdout == ""
    assert rows(ssh(host, f"nvidia-smi {GPU_QUERY} {CSV}").stdout)[1][3] == "0"


def test_killed_foreign_process_frees_its_gpu(testbed):
    host = testbed.add_host(gpus=1)
    pid = host.start_foreign_process(0, user=None)
    os.kill(pid, signal.SIGKILL)
    host._foreign[pid].wait(timeout=10)  # reaped, as a real exited process would be
    assert ssh(host, f"nvidia-smi {APPS_QUERY} {CSV}").stdout == ""


def test_worker_with_host_and_cuda_visible_devices_is_on_that_gpu(testbed):
    host = testbed.add_host(gpus=2)
    other = testbed.add_host(gpus=2)
    ssh(host, "CUDA_VISIBLE_DEVICES=1 setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!")
    worker_pids = sleepers(host, 1)
    gpus = rows(ssh(host, f"nvidia-smi {GPU_QUERY} {CSV}").stdout)
    apps = rows(ssh(host, f"nvidia-smi {APPS_QUERY} {CSV}").stdout)
    assert apps == [[gpus[1][1], str(worker_pids[0]), "600", "sleep"]]
    assert gpus[1][3] == "600" and gpus[0][3] == "0"
    # Another host's nvidia-smi does not see it.
    assert ssh(other, f"nvidia-smi {APPS_QUERY} {CSV}").stdout == ""


@needs_sshd
def test_same_host_name_in_two_test_beds_does_not_mix():
    with make_testbed(1) as bed_a, make_testbed(1) as bed_b:
        a, b = bed_a.hosts[0], bed_b.hosts[0]
        assert a.name == b.name == "h1"
        ssh(a, "CUDA_VISIBLE_DEVICES=0 setsid sleep 600 </dev/null >/dev/null 2>&1 &")
        sleepers(a, 1)
        assert len(rows(ssh(a, f"nvidia-smi {APPS_QUERY} {CSV}").stdout)) == 1
        assert ssh(b, f"nvidia-smi {APPS_QUERY} {CSV}").stdout == ""
        b.crash()
        assert len(rows(ssh(a, f"nvidia-smi {APPS_QUERY} {CSV}").stdout)) == 1


def test_local_process_with_host_env_counts_as_a_worker(testbed):
    host = testbed.add_host(gpus=2)
    env = {**os.environ, **host.env(), "CUDA_VISIBLE_DEVICES": "0"}
    proc = subprocess.Popen(["sleep", "600"], env=env)
    try:
        apps = rows(ssh(host, f"nvidia-smi {APPS_QUERY} {CSV}").stdout)
        assert [a[1] for a in apps] == [str(proc.pid)]
    finally:
        proc.kill()
        proc.wait()
    assert ssh(host, f"nvidia-smi {APPS_QUERY} {CSV}").stdout == ""


# -- host keys --------------------------------------------------------------------------


def test_unknown_host_key_is_refused(testbed):
    known = testbed.add_host("known")
    unknown = testbed.add_host("stranger", known=False)
    assert ssh(known, "true").returncode == 0
    result = ssh(unknown, "true", check=False)
    assert result.returncode == 255
    assert "Host key verification failed" in result.stderr


def test_changed_host_key_is_refused(testbed):
    host = testbed.add_host()
    host.change_host_key()
    result = ssh(host, "true", check=False)
    assert result.returncode == 255
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in result.stderr


# -- failures ----------------------------------------------------------------------------


def test_crash_kills_host_processes_and_restore_brings_sshd_back(testbed):
    host = testbed.add_host()
    survivor = testbed.add_host()
    ssh(host, "setsid sleep 600 </dev/null >/dev/null 2>&1 &")
    ssh(survivor, "setsid sleep 600 </dev/null >/dev/null 2>&1 &")
    foreign = host.start_foreign_process(0, user=None)
    doomed = sleepers(host, 2)
    assert foreign in doomed
    sshd = host.sshd_pid
    other_sleepers = sleepers(survivor, 1)

    host.crash()
    assert not any(_alive(p) for p in [*doomed, sshd])
    assert host.pids() == []
    assert ssh(host, "true", check=False).returncode == 255
    assert all(_alive(p) for p in other_sleepers)  # the other host is untouched

    host.restore()
    assert ssh(host, "echo $ELTSIM_HOST").stdout.strip() == host.name
    assert host.sshd_pid not in (None, sshd)


def test_crash_drops_established_connections(testbed):
    host = testbed.add_host()
    client = subprocess.Popen(host.ssh_argv("sleep 600"), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: any(_cmdline(p).startswith(b"sleep") for p in host.pids()))
        host.crash()
        assert client.wait(timeout=60) == 255
    finally:
        client.kill()
        client.wait()


def test_stop_sshd_makes_host_unreachable_but_keeps_processes(testbed):
    host = testbed.add_host()
    ssh(host, "setsid sleep 600 </dev/null >/dev/null 2>&1 &")
    [sleeper] = sleepers(host, 1)
    host.stop_sshd()
    result = ssh(host, "true", check=False)
    assert result.returncode == 255 and "refused" in result.stderr
    assert _alive(sleeper)
    host.restore()
    assert ssh(host, "true").returncode == 0


def test_silent_host_accepts_but_never_speaks(testbed):
    address, port = testbed.silent_host()
    assert not banner_ready(address, port, timeout=1.0)
    argv = ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "ConnectTimeout=2",
            "-o", f"UserKnownHostsFile={testbed.known_hosts}", "-p", str(port), f"root@{address}", "true"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 255 and "timed out" in result.stderr.lower()


def test_dead_address_refuses_connections(testbed):
    address, port = testbed.dead_address()
    import socket
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, port), timeout=5).close()


@needs_sshd
def test_teardown_leaves_no_process_behind():
    with make_testbed(2) as bed:
        h1, h2 = bed.hosts
        ssh(h1, "setsid sleep 600 </dev/null >/dev/null 2>&1 &")
        sleepers(h1, 1)
        h2.set_mode("hang")
        ssh(h2, "setsid nvidia-smi -L </dev/null >/dev/null 2>&1 &")
        assert wait_until(lambda: any(b"nvidia-smi" in _cmdline(p) for p in h2.pids()))
        h2.start_foreign_process(0)
        pids = h1.pids() + h2.pids()
        assert h1.sshd_pid in pids and h2.sshd_pid in pids
        assert len(pids) >= 5
        directory = bed.dir
    assert [p for p in pids if _alive(p)] == []
    assert not directory.exists()


@needs_sshd
def test_teardown_runs_when_a_test_body_fails():
    pids: list[int] = []
    with pytest.raises(RuntimeError):
        with make_testbed(1) as bed:
            pids.extend(bed.hosts[0].pids())
            raise RuntimeError("the test failed")
    assert pids and not any(_alive(p) for p in pids)


@needs_sshd
def test_reaper_cleans_up_after_a_killed_test_process(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(
        "import json, subprocess, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "from tests.testbed import make_testbed\n"
        "with make_testbed(2) as bed:\n"
        "    h1, h2 = bed.hosts\n"
        "    subprocess.run(h1.ssh_argv('setsid sleep 600 </dev/null >/dev/null 2>&1 &'), check=True)\n"
        "    h2.start_foreign_process(0)\n"
        "    time.sleep(0.5)\n"
        "    print(json.dumps({'dir': str(bed.dir), 'pids': h1.pids() + h2.pids()}), flush=True)\n"
        "    time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        import json
        report = json.loads(owner.stdout.readline())
    finally:
        owner.kill()  # SIGKILL: no finally, no close()
        owner.wait()
    pids = report["pids"]
    assert len(pids) >= 4  # 2 sshd listeners, the sleeper, the foreign process
    assert wait_until(lambda: not any(_alive(p) for p in pids), timeout=60)
    assert wait_until(lambda: not Path(report["dir"]).exists(), timeout=60)


def test_job_env_teardown_kills_the_tests_own_processes_and_no_other(tmp_path):
    """end_job (job_env's finalizer): every process whose environment names the job or the
    test's state directory, or whose command line names its temporary directory, is gone
    when it returns; a process of a job with a longer name, or naming a longer directory,
    is left alone."""
    job, root = "tjobend1", tmp_path / "eltc-x"
    state = root / "state"
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}

    def start(env: dict, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", *args],
                                env={**base, **env}, stdin=subprocess.DEVNULL)

    ours = [start({"ELTCTL_JOB": job}), start({"XDG_STATE_HOME": str(state)}), start({}, f"{root}/hosts.toml")]
    others = [start({"ELTCTL_JOB": job + "2"}), start({"XDG_STATE_HOME": f"{state}2"}),
              start({}, f"{root}2/hosts.toml")]
    try:
        killed = end_job(job, root, state)
        assert sorted(killed) == sorted(p.pid for p in ours)
        assert [p.wait(timeout=10) for p in ours] == [-signal.SIGKILL] * 3
        assert [p.poll() for p in others] == [None] * 3
    finally:
        for p in ours + others:
            p.kill()
            p.wait()


# -- pure parts, no sshd -------------------------------------------------------------------


@pytest.mark.parametrize("fmt,expected", [
    ("csv", {"header": True, "units": True}),
    ("csv,noheader", {"header": False, "units": True}),
    ("csv,nounits", {"header": True, "units": False}),
    ("csv,noheader,nounits", {"header": False, "units": False}),
])
def test_format_options(fmt, expected):
    assert nvidia_smi.parse_format(fmt) == expected


@pytest.mark.parametrize("base_used,base_util,procs,na,expected", [
    (0, 0, [], False, (0, 0)),                                   # idle
    (100, 5, [(2000, 50), (600, 0)], False, (2700, 55)),         # base + every process
    (40000, 90, [(2000, 50)], False, (40960, 100)),              # capped at total / 100 %
    ("[N/A]", 0, [(2000, 50)], False, ("[N/A]", 50)),            # board does not report it
    (0, 0, [(2000, "[N/A]")], False, (2000, 0)),                 # an N/A part adds nothing
    (0, 0, [(2000, 50)], True, (2000, "[N/A]")),                 # mode na
])
def test_gpu_totals(base_used, base_util, procs, na, expected):
    gpu = {"index": 0, "uuid": "GPU-x", "name": "n", "memory_total_mib": 40960,
           "memory_used_mib": base_used, "utilization": base_util}
    listed = [{"gpu": 0, "used_memory_mib": m, "utilization": u} for m, u in procs]
    row = nvidia_smi.gpu_row(gpu, {}, listed, na, 1)
    assert (row["memory.used"], row["utilization.gpu"]) == expected


def test_unknown_field_is_rejected_like_the_real_tool(tmp_path):
    state = GpuState(tmp_path / "gpus.json", "x")
    state.initialize(1)
    launcher = install_nvidia_smi(tmp_path / "bin")
    result = subprocess.run([str(launcher), "--query-gpu=index,bogus", "--format=csv"],
                            env={"ELTSIM_STATE": str(state.path), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and 'Field "bogus" is not a valid field to query.' in result.stdout


def test_state_file_is_replaced_atomically(tmp_path):
    state = GpuState(tmp_path / "gpus.json", "x")
    state.initialize(2)
    inode = state.path.stat().st_ino
    state.set_gpu(0, memory_used_mib=5)
    assert state.path.stat().st_ino != inode
    assert state.read()["gpus"][0]["memory_used_mib"] == 5
    assert [p.name for p in tmp_path.iterdir()] == ["gpus.json"]
    with pytest.raises(ValueError):
        state.set_gpu(0, bogus=1)


def test_sshd_config_sets_session_environment():
    text = SshdConfig(address="127.1.2.3", port=2222, host_key=Path("/k"), pid_file=Path("/p"),
                      authorized_keys=Path("/a"), home=Path("/h"),
                      env=(("HOME", "/h"), ("ELTSIM_HOST", "h1"))).render()
    assert 'SetEnv "HOME=/h" "ELTSIM_HOST=h1"' in text
    assert "PasswordAuthentication no" in text and "ListenAddress 127.1.2.3" in text


def test_missing_sshd_is_a_skip_reason_that_says_how_to_install(monkeypatch):
    from tests.testbed import sshd as sshd_module
    monkeypatch.setattr(sshd_module, "SSHD", "/nonexistent/sshd")
    reason = sshd_module.sshd_missing_reason()
    assert reason is not None and "apt-get install openssh-server" in reason


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False

"""The probe's pure parts (tables of cases) and the script itself on this machine.

The script runs here through the local transport with the simulated nvidia-smi on
PATH, so these tests need no sshd; tests/test_probe_sshd.py runs it over SSH.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from eltctl.inventory import Host, Policy
from eltctl.probe import (
    MARK,
    Gpu,
    GpuProcess,
    GpuUse,
    HostState,
    assess_host,
    classify_gpu,
    parse_app_line,
    parse_gpu_line,
    parse_number,
    parse_probe_output,
    probe_fleet,
    report_to_json,
)
from eltctl.hosts.fleet import Fleet

POLICY = Policy(memory_threshold_mib=500, utilization_threshold=10, nvidia_smi_timeout=2.0)
U0, U1 = "GPU-aaaa", "GPU-bbbb"


def gpu(mem=0, util=0, *, uuid=U0, index=0, total=40960):
    return Gpu(index=index, uuid=uuid, name="NVIDIA A100", memory_used_mib=mem,
               memory_total_mib=total, utilization=util)


def proc(pid, *, ours=False, user="alice", uuid=U0, mem=1000):
    return GpuProcess(pid=pid, gpu_uuid=uuid, used_memory_mib=mem, name="python", user=user, ours=ours)


# --------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text, value", [
    ("0", 0), ("40960", 40960), (" 12 ", 12), ("[N/A]", None), ("[Not Supported]", None),
    ("N/A", None), ("[Unknown Error]", None), ("", None), ("35 %", 35), ("1024 MiB", 1024),
    ("12.6", 13), ("garbage", None),
])
def test_parse_number_handles_units_and_not_available(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("line, expected", [
    ("0, GPU-1, NVIDIA A100-SXM4-40GB, 3, 40960, 0",
     Gpu(0, "GPU-1", "NVIDIA A100-SXM4-40GB", 3, 40960, 0)),
    ("1, GPU-2, NVIDIA A100-SXM4-40GB, 3, 40960, [N/A]",
     Gpu(1, "GPU-2", "NVIDIA A100-SXM4-40GB", 3, 40960, None)),
    ("2, GPU-3, Tesla, weird, name, [Not Supported], [Not Supported], [Not Supported]",
     Gpu(2, "GPU-3", "Tesla, weird, name", None, None, None)),
    ("No devices were found", None),
    ("0, GPU-1, too short", None),
    ("x, GPU-1, A, 1, 2, 3", None),
])
def test_parse_gpu_line(line, expected):
    assert parse_gpu_line(line) == expected


@pytest.mark.parametrize("line, expected", [
    ("GPU-1, 4242, 2000, python", GpuProcess(4242, "GPU-1", 2000, "python")),
    ("GPU-1, 4242, [N/A], /usr/bin/python3", GpuProcess(4242, "GPU-1", None, "/usr/bin/python3")),
    ("GPU-1, [N/A], 10, x", None),
    ("garbage", None),
])
def test_parse_app_line(line, expected):
    assert parse_app_line(line) == expected


def _output(*, smi="/usr/bin/nvidia-smi", gpus_rc=0, gpus="", apps_rc=0, apps="", owners="", end=True):
    parts = [f"{MARK}probe 1", f"{MARK}cpus", "16", f"{MARK}loadavg", "0.50 0.25 0.10 1/234 5678",
             f"{MARK}who", "bob      pts/0        2026-11-21 10:00 (10.0.0.9)",
             "alice    pts/1        2026-11-21 10:05", "bob      pts/2        2026-11-21 11:00",
             f"{MARK}smi", smi or ""]
    if smi:
        parts += [f"{MARK}gpus {gpus_rc}", gpus]
        if gpus_rc == 0:
            parts += [f"{MARK}apps {apps_rc}", apps, f"{MARK}owners", owners]
    if end:
        parts.append(f"{MARK}end")
    return "\n".join(parts) + "\n"


def test_parse_probe_output_collects_facts_and_merges_owners():
    text = _output(gpus=f"0, {U0}, NVIDIA A100, 2600, 40960, 55\n1, {U1}, NVIDIA A100, 0, 40960, 0",
                   apps=f"{U0}, 111, 2000, python\n{U0}, 222, 600, train.py",
                   owners="111 0 alice\n222 1 root")
    p = parse_probe_output(text)
    assert p.complete and p.cpu_count == 16 and p.load_avg == (0.5, 0.25, 0.1)
    assert p.users == ("alice", "bob")
    assert p.nvidia_smi == "/usr/bin/nvidia-smi" and p.gpu_status == 0 and p.apps_status == 0
    assert [g.index for g in p.gpus] == [0, 1]
    assert p.processes == (GpuProcess(111, U0, 2000, "python", "alice", False),
                           GpuProcess(222, U0, 600, "train.py", "root", True))


def test_control_characters_from_a_host_are_made_visible():
    text = _output(gpus=f"0, {U0}, NVIDIA A100, 2600, 40960, 55",
                   apps=f"{U0}, 111, 2000, \x1b[2Jevil\x9b",
                   owners="111 0 mal\x07lory")
    p = parse_probe_output(text)
    assert p.processes[0].name == "\\x1b[2Jevil\\x9b" and p.processes[0].user == "mal\\x07lory"


def test_parse_probe_output_without_nvidia_smi_or_end_marker():
    p = parse_probe_output(_output(smi=None, end=False))
    assert p.nvidia_smi is None and not p.complete and p.gpus == ()


def test_owner_unknown_is_parsed_as_none():
    p = parse_probe_output(_output(gpus=f"0, {U0}, A, 1, 2, 3", apps=f"{U0}, 7, 1, x", owners="7 0 ?"))
    assert p.processes[0].user is None and not p.processes[0].ours


# --------------------------------------------------------------------------- classify_gpu

@pytest.mark.parametrize("case, g, procs, state, words", [
    ("idle", gpu(3, 0), [], GpuUse.FREE, ["no processes", "3 MiB", "0%"]),
    ("a clean GPU at the memory threshold", gpu(500, 10), [], GpuUse.FREE, ["no processes"]),
    ("process of another user", gpu(2000, 50), [proc(111, user="alice")], GpuUse.BUSY,
     ["pid 111", "alice"]),
    ("foreign process even while idle-looking", gpu(0, 0), [proc(5, user="bob", mem=None)],
     GpuUse.BUSY, ["pid 5", "bob"]),
    ("owner unreadable", gpu(0, 0), [proc(5, user=None)], GpuUse.BUSY, ["unknown user"]),
    ("ours", gpu(600, 0), [proc(9, ours=True, user="root")], GpuUse.OURS, ["this job", "pid 9"]),
    ("ours busy by numbers is still ours", gpu(39000, 100), [proc(9, ours=True)], GpuUse.OURS,
     ["this job"]),
    ("ours and foreign together", gpu(3000, 60), [proc(9, ours=True), proc(10, user="carol")],
     GpuUse.BUSY, ["pid 10", "carol", "shares it with this job", "pid 9"]),
    ("memory over threshold, no process (container)", gpu(501, 0), [], GpuUse.BUSY,
     ["501 of 40960 MiB", "no process listed"]),
    ("utilisation over threshold, no process", gpu(0, 11), [], GpuUse.BUSY, ["11%", "threshold 10%"]),
    ("utilisation N/A: judged by memory", gpu(3, None), [], GpuUse.FREE,
     ["utilisation not reported", "judged by memory and processes"]),
    ("utilisation N/A, memory high", gpu(8000, None), [], GpuUse.BUSY, ["8000"]),
    ("memory N/A: judged by utilisation", gpu(None, 0), [], GpuUse.FREE,
     ["memory use not reported", "judged by utilisation and processes"]),
    ("everything N/A", gpu(None, None), [], GpuUse.FREE, ["judged by the process list only"]),
    ("everything N/A with a foreign process", gpu(None, None), [proc(3, user="dave")], GpuUse.BUSY,
     ["dave"]),
    ("a process on another GPU does not count", gpu(0, 0), [proc(3, uuid=U1)], GpuUse.FREE,
     ["no processes"]),
])
def test_classify_gpu(case, g, procs, state, words):
    got_state, reason = classify_gpu(g, procs, POLICY)
    assert got_state is state, (case, reason)
    for w in words:
        assert w in reason, (case, reason)


def test_thresholds_come_from_the_policy():
    strict = Policy(memory_threshold_mib=10, utilization_threshold=0)
    assert classify_gpu(gpu(11, 0), [], strict)[0] is GpuUse.BUSY
    assert classify_gpu(gpu(0, 1), [], strict)[0] is GpuUse.BUSY
    assert classify_gpu(gpu(11, 0), [], POLICY)[0] is GpuUse.FREE


# --------------------------------------------------------------------------- assess_host

HOST = Host(name="h", address="10.0.0.1", slots=4)
TWO_GPUS = f"0, {U0}, NVIDIA A100, 0, 40960, 0\n1, {U1}, NVIDIA A100, 9000, 40960, 80"


@pytest.mark.parametrize("case, text, state, words", [
    ("gpu host", _output(gpus=TWO_GPUS), HostState.OK, ["1 free", "1 busy"]),
    ("no nvidia-smi", _output(smi=None), HostState.CPU_ONLY, ["CPU-only", "4 slot"]),
    ("nvidia-smi not runnable", _output(gpus_rc=127, gpus="sh: nvidia-smi: not found"),
     HostState.CPU_ONLY, ["exit 127"]),
    ("driver failure", _output(gpus_rc=9, gpus="NVIDIA-SMI has failed because it couldn't communicate"),
     HostState.UNHEALTHY, ["exit 9", "couldn't communicate"]),
    ("hang", _output(gpus_rc=124), HostState.UNHEALTHY, ["did not answer in 2 s", "wedged"]),
    ("hang killed", _output(gpus_rc=137), HostState.UNHEALTHY, ["did not answer"]),
    ("process query hangs", _output(gpus=TWO_GPUS, apps_rc=124), HostState.UNHEALTHY,
     ["process query did not answer"]),
    ("process query fails", _output(gpus=TWO_GPUS, apps_rc=3, apps="boom"), HostState.UNHEALTHY,
     ["process query failed", "boom"]),
    ("no GPUs listed", _output(gpus="No devices were found"), HostState.UNHEALTHY, ["no GPUs"]),
    ("cut short", _output(gpus=TWO_GPUS, end=False), HostState.UNHEALTHY, ["cut short"]),
])
def test_assess_host_states(case, text, state, words):
    r = assess_host(HOST, parse_probe_output(text), POLICY)
    assert r.state is state, (case, r.reason)
    for w in words:
        assert w in r.reason, (case, r.reason)
    assert r.reachable
    if state is not HostState.OK:
        assert r.gpus == ()


def test_slots_are_free_gpus_on_a_gpu_host_and_inventory_slots_on_a_cpu_host():
    assert assess_host(HOST, parse_probe_output(_output(gpus=TWO_GPUS)), POLICY).slots == 1
    assert assess_host(HOST, parse_probe_output(_output(smi=None)), POLICY).slots == 4
    assert assess_host(HOST, parse_probe_output(_output(gpus_rc=9)), POLICY).slots == 0


def test_host_gpus_list_restricts_the_gpus_considered():
    host = Host(name="h", address="x", gpus=(1, 5))
    r = assess_host(host, parse_probe_output(_output(gpus=TWO_GPUS)), POLICY)
    assert [g.gpu.index for g in r.gpus] == [1]
    assert "GPU(s) 5" in r.reason


def test_json_document_has_the_documented_keys():
    text = _output(gpus=TWO_GPUS, apps=f"{U1}, 77, 9000, x", owners="77 0 eve")
    doc = json.loads(json.dumps(report_to_json(assess_host(HOST, parse_probe_output(text), POLICY))))
    assert {"name", "address", "state", "reachable", "reason", "error", "cpu_count", "slots", "load_avg",
            "users", "gpus"} <= set(doc)
    g1 = doc["gpus"][1]
    assert {"index", "uuid", "name", "state", "reason", "memory_used_mib", "memory_total_mib",
            "utilization", "processes"} <= set(g1)
    assert g1["state"] == "busy" and g1["processes"] == [
        {"pid": 77, "user": "eve", "ours": False, "job": None, "used_memory_mib": 9000, "name": "x"}]
    assert g1["job"] is None
    assert doc["error"] is None and doc["reachable"] is True


# --------------------------------------------------------------------------- the script, locally

@pytest.fixture
def sim_host(tmp_path):
    """A local host whose PATH has the simulated nvidia-smi (no sshd needed)."""
    from eltctl.sim.gpustate import GpuState, install_nvidia_smi

    install_nvidia_smi(tmp_path / "bin")
    state = GpuState(tmp_path / "state.json", "h1")
    state.initialize(2)
    env = (("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}"),
           ("ELTSIM_STATE", str(state.path)), ("ELTSIM_HOST", "h1"),
           ("ELTCTL_CLAIMS_DIR", str(tmp_path / "claims")))
    yield Host(name="h1", address="local", env=env), state
    state.path.unlink(missing_ok=True)  # ends a leaked `hang` stand-in


def _probe(hosts, job="job1", policy=POLICY):
    async def main():
        async with Fleet(hosts) as fleet:
            return await probe_fleet(fleet, job=job, policy=policy)
    return asyncio.run(main())


def test_probe_script_classifies_a_local_simulated_host(sim_host):
    host, state = sim_host
    state.set_gpu(1, memory_used_mib=3000)
    [r] = _probe([host])
    assert r.state is HostState.OK
    assert [(g.gpu.index, g.state) for g in r.gpus] == [(0, GpuUse.FREE), (1, GpuUse.BUSY)]
    assert r.cpu_count and r.load_avg is not None


def test_probe_script_finds_our_worker_by_its_job_variable(sim_host, tmp_path):
    import subprocess

    host, state = sim_host
    env = {**os.environ, **dict(host.env), "CUDA_VISIBLE_DEVICES": "1", "ELTCTL_JOB": "job1"}
    worker = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while True:  # /proc/<pid>/environ is there once exec is done
            [r] = _probe([host])
            if r.gpus[1].state is not GpuUse.FREE or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.gpus[1].state is GpuUse.OURS, r.gpus[1].reason
        assert r.gpus[1].processes[0].pid == worker.pid and r.gpus[1].processes[0].ours
        assert r.gpus[0].state is GpuUse.FREE
        [other] = _probe([host], job="another-job")
        # another eltctl job's worker is not an owner (issue 13): taken, by that job
        assert other.gpus[1].state is GpuUse.TAKEN and other.gpus[1].job == "job1", other.gpus[1].reason
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.parametrize("mode, state, words", [
    ("fail", HostState.UNHEALTHY, ["exit 9"]),
    ("hang", HostState.UNHEALTHY, ["did not answer in 1 s"]),
    ("na", HostState.OK, ["utilisation not reported"]),
])
def test_probe_script_modes(sim_host, mode, state, words):
    host, gs = sim_host
    gs.set_mode(mode)
    [r] = _probe([host], policy=Policy(nvidia_smi_timeout=1.0))
    assert r.state is state, r.reason
    text = r.reason + " ".join(g.reason for g in r.gpus)
    for w in words:
        assert w in text


def test_host_without_nvidia_smi_is_cpu_only():
    [r] = _probe([Host(name="c", address="local", slots=3,
                       env=(("PATH", "/usr/bin:/bin"),))])
    if Path("/usr/bin/nvidia-smi").exists():
        pytest.skip("this machine has a real nvidia-smi")
    assert r.state is HostState.CPU_ONLY and r.slots == 3


# --------------------------------------------------------------------------- the data plane

NET = ":::eltctl:net {ssh}\n1: lo    inet 127.0.0.1/8 scope host lo\n2: eth0    inet 10.0.0.5/24 scope global eth0\n"


@pytest.mark.parametrize("ssh, interface, local, expect", [
    ("10.0.0.5", None, False, {"interface": "eth0", "address": "10.0.0.5", "source": "address", "error": None}),
    ("10.0.0.5", "lo", False, {"interface": "lo", "address": "127.0.0.1", "source": "inventory", "error": None}),
    ("", None, True, {"interface": None, "address": None, "source": "store route", "error": None}),
    ("10.0.0.5", None, True, {"interface": None, "address": None, "source": "store route", "error": None}),
])
def test_the_probe_shows_where_the_collectives_listen(ssh, interface, local, expect):
    text = _output(smi=None).replace(":::eltctl:end", NET.format(ssh=ssh) + ":::eltctl:end")
    host = Host(name="h", address="local" if local else "h.lab", data_interface=interface)
    r = assess_host(host, parse_probe_output(text), POLICY)
    assert report_to_json(r)["data_plane"] == expect


def test_a_data_interface_the_host_lacks_is_in_the_probes_reason():
    text = _output(smi=None).replace(":::eltctl:end", NET.format(ssh="10.0.0.5") + ":::eltctl:end")
    r = assess_host(Host(name="h", address="h.lab", data_interface="eth9"), parse_probe_output(text), POLICY)
    assert r.data_plane["error"].startswith("data_interface 'eth9' is not an interface of this host; it has: "
                                            "eth0 (10.0.0.5), lo (127.0.0.1)")
    assert "data_interface 'eth9'" in r.reason


def test_the_probe_script_lists_this_hosts_interfaces(sim_host):
    host, _state = sim_host
    [r] = _probe([Host(name="h1", address="local", env=host.env, data_interface="lo")])
    assert r.data_plane == {"interface": "lo", "address": "127.0.0.1", "source": "inventory", "error": None}

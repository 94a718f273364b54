"""`eltctl probe` against real sshd hosts on loopback (tests/testbed).

The plan: one test bed holds a host of every kind a lab has, built once for the
module (starting sshd hosts is the slow part):

    free      h-free     two idle GPUs
    busy      h-busy     GPU 0 held by a process of another user (eltsim)
    ours      h-ours     GPU 1 held by a process started over SSH with ELTCTL_JOB=test
    na        h-na       nvidia-smi answers [N/A] for utilisation
    cpu-only  h-cpu      no nvidia-smi
    unhealthy h-fail     nvidia-smi fails (driver message, exit 9)
    unhealthy h-hang     nvidia-smi never answers
    unreach.  h-stopped  sshd stopped (connection refused)
    unreach.  h-unknown  host key not in known_hosts
    unreach.  dead       nothing listens
    unreach.  silent     accepts TCP, never speaks SSH

Every host must be classified, through the CLI (`--json`, a subprocess) and the
library, and the slow hosts must not hold up the others.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.testbed import Testbed, sshd_missing_reason

pytestmark = pytest.mark.sshd

ELTCTL = [sys.executable, "-m", "eltctl"]
NVIDIA_SMI_TIMEOUT = 2
CONNECT_TIMEOUT = 4
# A probe's worst case is the slowest of: connect timeout, a hanging nvidia-smi.
# Everything must be done well within that plus a generous margin for a busy machine.
BOUND = CONNECT_TIMEOUT + 2 * (NVIDIA_SMI_TIMEOUT + 2) + 10 + 30


def start_ours(host, job: str, gpu: int) -> int:
    """A process on the host that belongs to job `job` (as the daemon will start workers)."""
    cmd = (f"ELTSIM_HOST=$ELTSIM_HOST CUDA_VISIBLE_DEVICES={gpu} ELTCTL_JOB={job} "
           "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!")
    out = subprocess.run(host.ssh_argv(cmd), capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    reason = sshd_missing_reason()
    if reason:
        pytest.skip(reason)
    tb = Testbed()
    try:
        names = ["h-free", "h-busy", "h-ours", "h-na", "h-cpu", "h-fail", "h-hang", "h-stopped"]
        hosts = dict(zip(names, tb.add_hosts(len(names), names=names)))
        unknown = tb.add_host("h-unknown", known=False)
        hosts["h-busy"].start_foreign_process(0, memory_mib=3000, utilization=70)
        start_ours(hosts["h-ours"], "test", 1)
        hosts["h-na"].set_mode("na")
        hosts["h-cpu"].set_mode("missing")
        hosts["h-fail"].set_mode("fail")
        hosts["h-hang"].set_mode("hang")
        hosts["h-stopped"].stop_sshd()
        silent, dead = tb.silent_host(), tb.dead_address()
        extra = f"""
[policy]
nvidia_smi_timeout = {NVIDIA_SMI_TIMEOUT}

[[hosts]]
name = "silent"
address = "{silent[0]}"
port = {silent[1]}

[[hosts]]
name = "dead"
address = "{dead[0]}"
port = {dead[1]}
"""
        inventory = tb.write_inventory(hosts=[*hosts.values(), unknown], extra=extra,
                                       connect_timeout=CONNECT_TIMEOUT)
        yield tb, inventory
    finally:
        tb.close()


EXPECTED_HOSTS = {
    "h-free": "ok", "h-busy": "ok", "h-ours": "ok", "h-na": "ok", "h-cpu": "cpu-only",
    "h-fail": "unhealthy", "h-hang": "unhealthy", "h-stopped": "unreachable",
    "h-unknown": "unreachable", "silent": "unreachable", "dead": "unreachable",
}
EXPECTED_GPUS = {
    "h-free": ["free", "free"], "h-busy": ["busy", "free"], "h-ours": ["free", "ours"],
    "h-na": ["free", "free"],
}
EXPECTED_ERROR_KINDS = {"h-stopped": "unreachable", "h-unknown": "host-key-unknown",
                        "silent": "timeout", "dead": "unreachable"}


def check_document(doc: list[dict]) -> None:
    by = {h["name"]: h for h in doc}
    assert [h["name"] for h in doc] == list(EXPECTED_HOSTS)  # inventory order
    assert {n: h["state"] for n, h in by.items()} == EXPECTED_HOSTS
    assert {n: [g["state"] for g in h["gpus"]] for n, h in by.items() if h["gpus"]} == EXPECTED_GPUS
    for name, kind in EXPECTED_ERROR_KINDS.items():
        h = by[name]
        assert h["reachable"] is False and h["error"]["kind"] == kind, h
        assert h["error"]["hint"], h
    assert "eltctl doctor --accept-new" in by["h-unknown"]["error"]["hint"]
    assert "SHA256:" in by["h-unknown"]["error"]["message"]

    busy = by["h-busy"]["gpus"][0]
    assert busy["processes"][0]["user"] == "eltsim" and not busy["processes"][0]["ours"]
    assert "eltsim" in busy["reason"] and busy["memory_used_mib"] >= 3000
    ours = by["h-ours"]["gpus"][1]
    assert ours["processes"][0]["ours"] is True and "this job" in ours["reason"]
    assert by["h-na"]["gpus"][0]["utilization"] is None
    assert "utilisation not reported" in by["h-na"]["gpus"][0]["reason"]
    assert by["h-cpu"]["slots"] == 1 and by["h-cpu"]["gpus"] == []
    assert "exit 9" in by["h-fail"]["reason"]
    assert f"did not answer in {NVIDIA_SMI_TIMEOUT} s" in by["h-hang"]["reason"]
    assert by["h-free"]["slots"] == 2 and by["h-free"]["cpu_count"] >= 1
    assert len(by["h-free"]["load_avg"]) == 3 and isinstance(by["h-free"]["users"], list)
    # the hosts' sshd listen on loopback addresses (127.x.y.z): their collectives would too, on lo
    assert by["h-free"]["data_plane"] == {"interface": "lo", "address": by["h-free"]["address"],
                                          "source": "address", "error": None}, by["h-free"]
    for h in doc:
        for g in h["gpus"]:
            assert {"index", "uuid", "state", "reason", "memory_used_mib", "memory_total_mib",
                    "utilization", "processes"} <= set(g)


def test_probe_json_cli_classifies_every_kind_of_host(bed):
    _, inventory = bed
    started = time.monotonic()
    out = subprocess.run([*ELTCTL, "-i", str(inventory), "probe", "--json"], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).parents[1])
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    check_document(doc)
    assert took < BOUND, f"probe took {took:.1f} s; a slow host held up the batch"
    # the link test: a ring of the usable hosts (ok, cpu-only), in inventory order, each
    # sending to the next over its data plane (loopback here: fast)
    links = {h["name"]: h["link"] for h in doc}
    ring = ["h-free", "h-busy", "h-ours", "h-na", "h-cpu"]
    for sender, receiver in zip(ring, ring[1:] + ring[:1]):
        link = links.pop(sender)
        assert (link["from"], link["to"], link["error"]) == (sender, receiver, None), link
        assert link["mbit_s"] > 0 and link["address"].startswith("127."), link
    assert set(links.values()) == {None}, links  # unhealthy and unreachable hosts take no part


def test_probe_library_gives_the_same_answers(bed):
    from eltctl.inventory import load_inventory
    from eltctl.probe import probe_inventory, reports_to_json

    _, inventory = bed
    check_document(reports_to_json(probe_inventory(load_inventory(inventory))))


def test_probe_table_names_states_and_fixes(bed):
    _, inventory = bed
    out = subprocess.run([*ELTCTL, "-i", str(inventory), "probe"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "COLUMNS": "200"}, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    for word in ("h-free", "free", "busy", "ours", "cpu-only", "unhealthy", "unreachable",
                 "eltsim", "--accept-new", "did not answer"):
        assert word in out.stdout, word


def test_slow_hosts_do_not_hold_up_the_others(bed):
    """The silent host (connect timeout) finishes last and the hanging nvidia-smi is cut
    off by its timeout; the healthy hosts' results come in first; the batch is bounded."""
    from eltctl.inventory import load_inventory
    from eltctl.probe import probe_host
    from eltctl.hosts.fleet import Fleet

    _, path = bed
    inv = load_inventory(path)
    finished: dict[str, float] = {}

    async def one(host, transport):
        return await probe_host(host, transport, job=inv.job.name, policy=inv.policy)

    async def main():
        async with Fleet(inv) as fleet:
            async def timed(host):  # one host's outcome, and when it came in
                outcome = (await fleet.each([host], one))[host.name]
                finished[host.name] = time.monotonic()
                return outcome

            started = time.monotonic()
            outcomes = await asyncio.gather(*(timed(h) for h in inv.hosts))
            return {o.host.name: o for o in outcomes}, time.monotonic() - started

    outcomes, took = asyncio.run(main())
    assert set(outcomes) == set(EXPECTED_HOSTS)
    assert outcomes["silent"].error.kind == "timeout"
    assert outcomes["h-hang"].value.state.value == "unhealthy"
    fast = [finished[n] for n in ("h-free", "h-busy", "h-ours", "h-cpu", "h-fail")]
    # The silent host costs its whole connect timeout (4 s); the others answer in well
    # under a second unless they were made to wait for it.
    assert max(fast) < finished["silent"], "a healthy host waited for the silent one"
    assert finished["h-hang"] < finished["silent"] + CONNECT_TIMEOUT, "the hang was not cut off"
    assert took < BOUND


def test_host_gpus_list_in_the_inventory_restricts_the_probe(bed, tmp_path):
    from eltctl.inventory import load_inventory
    from eltctl.probe import probe_inventory

    tb, _ = bed
    busy = tb.host("h-busy")
    text = tb.write_inventory(tmp_path / "one.toml", hosts=[busy]).read_text()
    text = text.replace(f"port = {busy.port}\n", f"port = {busy.port}\ngpus = [1]\n")
    (tmp_path / "one.toml").write_text(text)
    [r] = probe_inventory(load_inventory(tmp_path / "one.toml"))
    assert [(g.gpu.index, g.state.value) for g in r.gpus] == [(1, "free")]

"""`eltctl doctor` against real sshd hosts: each problem found, each with its fix.

The plan:
    h-good     everything fine                                 -> all checks ok
    h-cpu      no nvidia-smi                                   -> ok (a CPU-only host)
    h-fail     nvidia-smi fails                                -> nvidia-smi FAIL
    h-nokey    its key is not in known_hosts                   -> host key FAIL; --accept-new records it
    h-changed  its key changed after it was recorded           -> host key FAIL, CHANGED; never replaced
    h-noauth   our public key is not authorized                -> auth FAIL
    h-nopy     `python` points at a missing interpreter        -> python FAIL
    h-nofwd    its sshd has AllowStreamLocalForwarding no       -> store forward FAIL (the store's forward)
    dead       nothing listens                                 -> reachable FAIL
Exit status 3 while any host fails; 0 once all pass.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sshd

ELTCTL = [sys.executable, "-m", "eltctl"]
ROOT = Path(__file__).parents[1]


def doctor(inventory: Path, *args: str) -> subprocess.CompletedProcess:
    # The job's script (the test bed's inventory runs train.py from its directory): doctor
    # checks the job as `up` does, and these tests are about the hosts.
    (inventory.parent / "train.py").touch()
    return subprocess.run([*ELTCTL, "-i", str(inventory), "doctor", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**__import__("os").environ, "COLUMNS": "250"})


def section(out: str, host: str) -> str:
    """The lines of one host's tree in doctor's output."""
    lines, inside = [], False
    for line in out.splitlines():
        if not line.startswith((" ", "├", "└", "│")):
            inside = line.startswith(host + " ")
        if inside:
            lines.append(line)
    return "\n".join(lines)


def test_doctor_finds_each_problem_and_accept_new_records_only_unknown_keys(testbed, tmp_path):
    names = ["h-good", "h-cpu", "h-fail", "h-changed", "h-noauth", "h-nopy", "h-nofwd"]
    hosts = dict(zip(names, testbed.add_hosts(len(names), names=names)))
    hosts["h-nokey"] = testbed.add_host("h-nokey", known=False)
    hosts["h-cpu"].set_mode("missing")
    hosts["h-fail"].set_mode("fail")
    hosts["h-changed"].change_host_key()
    (hosts["h-noauth"].dir / "authorized_keys").write_text("")
    hosts["h-nofwd"].set_sshd_option("AllowStreamLocalForwarding", "no")
    dead = testbed.dead_address()
    inventory = testbed.write_inventory(extra=f"""
[policy]
nvidia_smi_timeout = 3

[[hosts]]
name = "dead"
address = "{dead[0]}"
port = {dead[1]}
""")
    text = inventory.read_text()
    nopy = hosts["h-nopy"]
    text = text.replace(f'port = {nopy.port}\npython = "{nopy.python}"',
                        f'port = {nopy.port}\npython = "/nonexistent/python3"')
    inventory.write_text(text)
    known_before = testbed.known_hosts.read_text()

    out = doctor(inventory)
    assert out.returncode == 3, out.stdout + out.stderr
    good = section(out.stdout, "h-good")
    # script imports: the job's (empty) train.py checked, its input ended (not 60 s of waiting for it)
    for check in ("reachable", "host key", "auth", "python", "torch", "nvidia-smi", "work directory",
                  "store forward", "script imports"):
        assert f"ok {check}" in good, good
    assert "FAIL" not in good
    assert "CPU-only" in section(out.stdout, "h-cpu") and "FAIL" not in section(out.stdout, "h-cpu")
    assert "FAIL nvidia-smi" in section(out.stdout, "h-fail") and "fix:" in section(out.stdout, "h-fail")
    nokey = section(out.stdout, "h-nokey")
    assert "FAIL host key" in nokey and "SHA256:" in nokey and "--accept-new" in nokey
    changed = section(out.stdout, "h-changed")
    assert "FAIL host key" in changed and "CHANGED" in changed and "ssh-keygen -R" in changed
    noauth = section(out.stdout, "h-noauth")
    assert "ok host key" in noauth and "FAIL auth" in noauth and "fix:" in noauth
    nopy_out = section(out.stdout, "h-nopy")
    assert "FAIL python" in nopy_out and "/nonexistent/python3" in nopy_out
    assert "FAIL reachable" in section(out.stdout, "dead")
    nofwd = section(out.stdout, "h-nofwd")
    assert "FAIL store forward" in nofwd and "AllowStreamLocalForwarding yes" in nofwd and "ok python" in nofwd, nofwd
    assert testbed.known_hosts.read_text() == known_before, "doctor without --accept-new wrote known_hosts"

    out = doctor(inventory, "--accept-new")
    assert out.returncode == 3, out.stdout + out.stderr
    nokey = section(out.stdout, "h-nokey")
    assert "recorded new key SHA256:" in nokey and "FAIL" not in nokey, nokey
    changed = section(out.stdout, "h-changed")
    assert "FAIL host key" in changed and "never replaces" in changed
    known_after = testbed.known_hosts.read_text()
    added = known_after[len(known_before):].splitlines()
    assert added == [f"[{hosts['h-nokey'].address}]:{hosts['h-nokey'].port} "
                     + " ".join(hosts["h-nokey"].public_key.split()[:2])]

    # A third run needs nothing new: the recorded key is now simply verified.
    out = doctor(inventory)
    assert "ok host key: verified" in section(out.stdout, "h-nokey")
    assert testbed.known_hosts.read_text() == known_after


def test_doctor_exits_0_when_every_host_passes(testbed):
    testbed.add_hosts(2)
    out = doctor(testbed.write_inventory())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "job ok; 2 of 2 host(s) ready" in out.stdout
    # the link test (eltctl/linkspeed.py): the two hosts sent to each other over their data
    # plane (their sshd's loopback address); loopback is fast, a loaded machine may still warn
    import re

    for sender, receiver in (("h1", "h2"), ("h2", "h1")):
        assert re.search(rf"(ok|warn) link: .*{sender} -> {receiver} \(127\.[0-9.]+\): [0-9,]+ Mbit/s",
                         section(out.stdout, sender)), out.stdout


def test_accept_new_creates_a_missing_known_hosts_file(testbed, tmp_path):
    host = testbed.add_host("h1", known=False)
    inventory = testbed.write_inventory()
    kh = tmp_path / "sub" / "known_hosts"
    inventory.write_text(inventory.read_text().replace(str(testbed.known_hosts), str(kh)))
    out = doctor(inventory)
    assert out.returncode == 3 and "FAIL host key" in out.stdout and not kh.exists()
    out = doctor(inventory, "--accept-new")
    assert out.returncode == 0, out.stdout + out.stderr
    assert kh.read_text().strip() == f"[{host.address}]:{host.port} " + " ".join(host.public_key.split()[:2])

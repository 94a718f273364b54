"""`eltctl status HOST` and the terminal's width, as a user runs the command: the
compact hosts table at 80 columns, the wide one at 160, one host's full entry, and
an unknown HOST as a usage error naming the inventory's hosts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.test_statusview import CRASH_REASON, CROWDED, LONG_NAME, TIMEOUT, _hosts_section, cli_env, state_dir

INVENTORY = f"""\
[job]
name = "mnist"
command = "python train.py"

[[hosts]]
name = "ws1"
address = "local"

[[hosts]]
name = "lab-workstation-of-alice"
address = "local"

[[hosts]]
name = "{LONG_NAME}"
address = "local"

[[hosts]]
name = "cpu1"
address = "local"

[[hosts]]
name = "spare"
address = "local"
"""


def setup(tmp_path: Path) -> None:
    (tmp_path / "hosts.toml").write_text(INVENTORY)
    # Written now: a status as fresh as the live controller's.
    (state_dir(tmp_path) / "status.json").write_text(json.dumps({**CROWDED, "updated": time.time()}))


def eltctl(tmp_path: Path, *args: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**cli_env(tmp_path), "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "eltctl", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)


def test_status_at_80_columns_is_compact_and_fits(tmp_path):
    setup(tmp_path)
    r = eltctl(tmp_path, "status", columns=80)
    assert r.returncode == 0, r.stderr
    assert all(len(line) <= 80 for line in r.stdout.splitlines()), r.stdout
    assert "full reasons: eltctl status HOST" in r.stdout
    for brief in ("GPU 0 ours w3", "GPU 1 busy alice, b…", "GPU 1 busy 23000 MiB", "GPU 7 ours w7"):
        assert sum(brief in line for line in r.stdout.splitlines()) == 1, brief


def test_status_at_160_columns_is_wide_with_full_reasons(tmp_path):
    setup(tmp_path)
    r = eltctl(tmp_path, "status", columns=160)
    assert r.returncode == 0, r.stderr
    assert "heartbeat" in r.stdout and "full reasons: eltctl status HOST" not in r.stdout
    assert all(len(line) <= 160 for line in r.stdout.splitlines())
    # Folded in its column beside the long host name, but whole.
    header = next(line for line in r.stdout.splitlines() if "heartbeat" in line)
    gpus = "".join(line[header.index("GPUs"):header.index("note")] for line in _hosts_section(r.stdout))
    assert "GPU0busyusedbypid999python(alice);sharesitwiththisjob'spid4712" in "".join(gpus.split())


def test_status_host_shows_that_hosts_full_entry(tmp_path):
    setup(tmp_path)
    r = eltctl(tmp_path, "status", LONG_NAME, columns=100)
    assert r.returncode == 0, r.stderr
    flat = " ".join(r.stdout.split())
    assert "".join(CRASH_REASON.split()) in "".join(r.stdout.split())
    assert "1 busy 23000 of 24576 MiB used (threshold 1000 MiB) with no process listed (another container?)" in flat
    assert "6 unknown nvidia-smi did not answer within 10 s" in flat
    assert "2 failure(s) in a row" in flat
    assert "ws1 " not in r.stdout  # only that host


def test_status_host_json_is_that_hosts_entry(tmp_path):
    setup(tmp_path)
    r = eltctl(tmp_path, "status", "ws1", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == CROWDED["hosts"][0]


def test_status_of_a_host_the_job_has_not_seen_says_so(tmp_path):
    setup(tmp_path)
    r = eltctl(tmp_path, "status", "spare", columns=100)
    assert r.returncode == 0, r.stderr
    assert "spare not in the job's status" in " ".join(r.stdout.split())


def test_status_of_an_unknown_host_is_a_usage_error_naming_the_hosts(tmp_path):
    setup(tmp_path)
    r = eltctl(tmp_path, "status", "nope")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"error: no host 'nope' in {tmp_path / 'hosts.toml'}\n"
                        f"  hint: hosts: ws1, lab-workstation-of-alice, {LONG_NAME}, cpu1, spare\n")

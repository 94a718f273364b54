"""The run id's delivery to the inventory's local hosts (eltctl/storeforward.py), without sshd.

Issue 50, finding 1: a second `address = "local"` host written into hosts.toml while the
job ran never got the keeper's run id (the keeper wrote it only at its start, the
forwarder's re-read skipped local hosts), so its daemon signed with another run id and
it and the job took each other's values for forgeries. Now the forwarder writes it at
every re-read (at once on `reload()`, the keeper's SIGHUP), and the controller starts a
host's daemon only once the forwards file says it is there (`run_delivered`).
The remote hosts' forwards: tests/controller/test_store_forwards_sshd.py.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from eltctl.storeforward import Forwarder, nudge_keeper, read_forwards, run_delivered
from tests.testbed.jobenv import wait_for


def _write(inventory, tmp_path, *names):
    text = '[job]\nname = "lj"\ncommand = "python t.py"\n'
    for name in names:
        text += (f'[[hosts]]\nname = "{name}"\naddress = "local"\n'
                 f'env = {{ HOME = {json.dumps(str(tmp_path / "home" / name))} }}\n')
    inventory.write_text(text)


def _run_file(tmp_path, name):
    return tmp_path / "home" / name / ".eltctl" / "jobs" / "lj" / name / "run"


def test_a_local_host_written_into_the_inventory_gets_the_run_id_before_it_counts_as_delivered(tmp_path):
    inventory, state = tmp_path / "hosts.toml", tmp_path / "forwards.json"
    _write(inventory, tmp_path, "here")
    fw = Forwarder(inventory, state, None, "a" * 32, forward=False)
    fw.deliver_local()  # the keeper, before its store serves
    assert _run_file(tmp_path, "here").read_text() == "a" * 32 + "\n"
    assert stat.S_IMODE(_run_file(tmp_path, "here").stat().st_mode) == 0o600
    doc = read_forwards(state)
    assert run_delivered(doc, "here", os.getpid()) and not run_delivered(doc, "here", os.getpid() + 1)
    assert not run_delivered(doc, "here2", os.getpid())  # not in the file yet: its daemon must wait
    try:
        fw.start()
        wait_for(lambda: fw._mtime is not None, 10, "the forwarder's first read", interval=0.05)
        before = inventory.stat()
        _write(inventory, tmp_path, "here", "here2")
        os.utime(inventory, ns=(before.st_atime_ns, before.st_mtime_ns))  # an edit its mtime does not show
        fw.reload()  # the keeper's SIGHUP (the controller's nudge): read now, whatever the mtime says
        wait_for(lambda: run_delivered(read_forwards(state), "here2", os.getpid()), 10, "here2's run id",
                 interval=0.05)
        assert _run_file(tmp_path, "here2").read_text() == "a" * 32 + "\n"
        assert read_forwards(state)["hosts"]["here2"]["local"] is True

        _write(inventory, tmp_path, "here")  # removed from the file: no longer listed
        fw.reload()
        wait_for(lambda: "here2" not in read_forwards(state)["hosts"], 10, "here2 to leave the file",
                 interval=0.05)
    finally:
        fw.stop()


def test_a_keeper_from_before_lists_no_local_hosts_and_wrote_them_all_at_its_start():
    # an adopted keeper of an older eltctl: its file has no "local_runs"; its local hosts were served
    old = {"keeper": 42, "hosts": {"remote": {"socket": "/x/store.sock", "up": True}}}
    assert run_delivered(old, "here", 42) and not run_delivered(old, "here", 43)


def test_the_keeper_is_nudged_only_when_it_holds_the_forwards_file(tmp_path):
    state = tmp_path / "forwards.json"
    assert not nudge_keeper(state, os.getpid())  # no file: a keeper without a Forwarder would stop on SIGHUP
    state.write_text(json.dumps({"keeper": os.getpid() + 100000, "hosts": {}}))
    assert not nudge_keeper(state, os.getpid())


def test_the_direct_modes_address_is_written_beside_the_run_id_on_local_and_remote_hosts(tmp_path):
    """A direct-mode keeper restarted on a new port (another process took the old one)
    tells the hosts where it is: `store.address` beside `run`, 0600, on a local host
    (deliver_local) and on a remote one (prepare_command's shell, run here by sh)."""
    import subprocess

    from eltctl.hosts import layout
    from eltctl.storeforward import prepare_command
    from eltctl_runtime.store.loss import STORE_ADDRESS_FILE, read_store_address

    assert layout.STORE_ADDRESS == STORE_ADDRESS_FILE  # the name the runtime reads
    inventory, state = tmp_path / "hosts.toml", tmp_path / "forwards.json"
    _write(inventory, tmp_path, "here")
    Forwarder(inventory, state, None, "b" * 32, forward=False, store="tcp:10.0.0.5:4711").deliver_local()
    job_dir = _run_file(tmp_path, "here").parent
    assert read_store_address(job_dir / layout.STORE_ADDRESS) == "tcp:10.0.0.5:4711"
    assert stat.S_IMODE((job_dir / layout.STORE_ADDRESS).stat().st_mode) == 0o600

    home = tmp_path / "remote"
    home.mkdir()
    out = subprocess.run(["sh", "-c", prepare_command("lj", "far", store=True)], input="tcp:10.0.0.5:4712\n"
                         + "c" * 32 + "\n", capture_output=True, text=True, env={"HOME": str(home), "PATH":
                         os.environ["PATH"]}, timeout=30)
    assert out.returncode == 0, out.stderr
    far = Path(out.stdout.strip().splitlines()[-1])
    assert far == home / ".eltctl" / "jobs" / "lj" / "far"
    assert (far / "run").read_text() == "c" * 32 + "\n"
    assert read_store_address(far / layout.STORE_ADDRESS) == "tcp:10.0.0.5:4712"
    assert stat.S_IMODE((far / layout.STORE_ADDRESS).stat().st_mode) == 0o600
    # the ssh mode: the run id alone, no address file
    out = subprocess.run(["sh", "-c", prepare_command("lj", "far2")], input="d" * 32 + "\n", capture_output=True,
                         text=True, env={"HOME": str(home), "PATH": os.environ["PATH"]}, timeout=30)
    far2 = Path(out.stdout.strip().splitlines()[-1])
    assert (far2 / "run").read_text() == "d" * 32 + "\n" and not (far2 / layout.STORE_ADDRESS).exists()

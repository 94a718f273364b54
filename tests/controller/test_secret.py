"""The job's secret on the control side: made once in the state directory (0600) and
kept by every later `up`; delivered to a host over the command's stdin into a 0600
file that daemon.json names, never on a command line."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest

from eltctl.controller.statedir import StateDir, existing_secret, job_secret
from eltctl.hosts import ops as hostops
from eltctl.hosts.layout import HostPaths
from eltctl.hosts.local import LocalTransport
from eltctl.inventory import Host, parse_inventory
from eltctl_runtime.store.auth import SECRET_BYTES, SecretError, encode_secret, read_secret


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_secret_is_made_once_private_and_kept_across_ups(tmp_path):
    state = StateDir(tmp_path / "state" / "j")
    assert existing_secret(state) is None
    old = os.umask(0o022)  # a careless umask changes nothing
    try:
        first = job_secret(state)
    finally:
        os.umask(old)
    assert len(first) == SECRET_BYTES and mode(state.secret) == 0o600 and mode(state.path) == 0o700
    assert job_secret(state) == first == existing_secret(state)  # the next `up` (cron) keeps it
    assert read_secret(state.secret) == first


def test_a_secret_others_can_read_is_refused_with_the_fix(tmp_path):
    state = StateDir(tmp_path / "j")
    job_secret(state)
    state.secret.chmod(0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        job_secret(state)


def test_the_daemon_start_writes_the_secret_0600_from_stdin(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    # `true` stands in for the host's Python: the daemon itself is not the point here
    host = Host(name="here", address="local", python="true", env=(("HOME", str(home)),))
    inv = parse_inventory('[job]\nname = "j"\ncommand = "python t.py"\n[[hosts]]\nname = "here"\naddress = "local"\n',
                          tmp_path / "hosts.toml")
    paths = HostPaths(home=str(home), job="j", host="here")
    secret = bytes(range(32))
    config = hostops.daemon_config(inv, host, paths, "127.0.0.1:1", None, secret=True)
    assert config["secret_file"] == f"{paths.job_dir}/secret"
    assert "secret_file" not in hostops.daemon_config(inv, host, paths, "127.0.0.1:1", None)
    command = hostops.start_daemon_command(host, paths, "/rt", "j", None, secret=True)
    assert secret.hex() not in command

    old = os.umask(0o022)
    try:
        asyncio.run(hostops.start_daemon(LocalTransport(host, default_timeout=60), paths, "/rt", config,
                                         secret=secret))
        written = Path(paths.job_dir) / "secret"
        assert mode(written) == 0o600 and written.read_text() == encode_secret(secret)
        assert read_secret(written) == secret
        assert json.loads(Path(paths.daemon_json).read_text())["secret_file"] == str(written)
        assert not (Path(paths.job_dir) / hostops.SECRET_TMP).exists()
        # a later start (a new daemon of the same job) writes the same secret again
        written.chmod(0o644)
        asyncio.run(hostops.start_daemon(LocalTransport(host, default_timeout=60), paths, "/rt", config,
                                         secret=secret))
        assert mode(written) == 0o600 and read_secret(written) == secret
    finally:
        os.umask(old)

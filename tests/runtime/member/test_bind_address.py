"""Where workers' gloo binds: ELTCTL_BIND_ADDRESS (what the daemon takes from its SSH
connection when the store is reached through an SSH forward on 127.0.0.1), else the
local address towards the store; and the start command's fragment that sets it."""

from __future__ import annotations

import subprocess

from eltctl_runtime.member import collectives


def test_bind_address_prefers_the_environment(monkeypatch):
    monkeypatch.setenv(collectives.BIND_ADDRESS_ENV, "10.1.2.3")
    assert collectives.bind_address("127.0.0.1", 1234) == "10.1.2.3"
    monkeypatch.setenv(collectives.BIND_ADDRESS_ENV, "")
    assert collectives.bind_address("127.0.0.1", 1234) == collectives.local_address_towards("127.0.0.1", 1234)
    monkeypatch.delenv(collectives.BIND_ADDRESS_ENV)
    assert collectives.bind_address("127.0.0.1", 1234) == "127.0.0.1"


def test_start_command_takes_the_server_address_of_ssh_connection():
    from eltctl.hosts.ops import HostPaths, start_daemon_command
    from eltctl.inventory import Host

    paths = HostPaths(home="/h", job="j", host="a")
    cmd = start_daemon_command(Host(name="a", address="a.lab"), paths, "/rt", "j", bind_from_ssh=True)
    fragment = cmd[cmd.index("ELTCTL_BIND_ADDRESS="):cmd.index(" ELTCTL_JOB=")]
    for conn, want in (("10.0.0.9 51000 10.0.0.12 22", "10.0.0.12"), ("", "")):
        out = subprocess.run(["sh", "-c", f"{fragment} sh -c 'printf %s \"$ELTCTL_BIND_ADDRESS\"'"],
                             env={"SSH_CONNECTION": conn, "PATH": "/usr/bin:/bin"}, capture_output=True,
                             text=True, check=True).stdout
        assert out == want, (conn, out)
    assert "ELTCTL_BIND_ADDRESS" not in start_daemon_command(Host(name="a", address="a.lab"), paths, "/rt", "j")

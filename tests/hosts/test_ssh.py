"""The SSH transport against real sshd hosts: what the issue asks of the SSH layer.

~/.ssh/config and ssh-agent honoured, one connection per host reused, the host's
env applied to remote commands, per-host timeouts, and a changed host key reported
as such with the command that fixes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eltctl.errors import HostError
from eltctl.inventory import Host, load_inventory
from eltctl.hosts.fleet import Fleet
from eltctl.hosts.transport import ErrorKind

pytestmark = pytest.mark.sshd

ELTCTL = [sys.executable, "-m", "eltctl"]
ROOT = Path(__file__).parents[2]


def accepted_logins(host) -> int:
    return (host.dir / "sshd.log").read_text(errors="replace").count("Accepted publickey")


def test_one_connection_per_host_is_reused_within_a_command(testbed):
    h = testbed.add_host("h1")
    inv = load_inventory(testbed.write_inventory())
    before = accepted_logins(h)

    async def main():
        async with Fleet(inv) as fleet:
            outs = []
            for _ in range(3):
                outs.append(await fleet.each(None, lambda host, t: t.run("echo $ELTSIM_HOST")))
            # and several commands at once on the one connection
            t = await fleet.transport(inv.hosts[0])
            many = await asyncio.gather(*(t.run(f"echo {i}") for i in range(30)))
            return outs, many

    outs, many = asyncio.run(main())
    assert [o["h1"].value.stdout.strip() for o in outs] == ["h1"] * 3
    assert [r.stdout.strip() for r in many] == [str(i) for i in range(30)]
    deadline = time.monotonic() + 5
    while accepted_logins(h) - before < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert accepted_logins(h) - before == 1


def test_hosts_env_reaches_remote_commands(testbed):
    h = testbed.add_host("h1")
    inv = load_inventory(testbed.write_inventory())
    host = Host(name="h1", address=h.address, port=h.port,
                env=(("ELT_GREETING", "hello 'world' $HOME"), ("ELT_N", "3")))

    async def main():
        async with Fleet([host], ssh=inv.ssh) as fleet:
            return await fleet.each(None, lambda hh, t: t.run('printf "%s|%s" "$ELT_GREETING" "$ELT_N"'))

    out = asyncio.run(main())
    assert out["h1"].value.stdout == "hello 'world' $HOME|3"


def test_empty_input_is_an_ended_input(testbed):
    """`run(input="")` (doctor's check of an empty train.py) ends the command's input at
    once: asyncssh sends end-of-input only after non-empty data, so the command read
    stdin until its timeout (60 s per `up` and `doctor` of an empty script)."""
    testbed.add_host("h1")
    inv = load_inventory(testbed.write_inventory())

    async def main():
        async with Fleet(inv) as fleet:
            t = await fleet.transport(inv.hosts[0])
            return await t.run("cat; echo end", input="", timeout=30)

    out = asyncio.run(main())
    assert out.ok and out.stdout == "end\n", out


SECRET = "tok-9f3c2a7e51b4 with 'quotes' and \\ backslash"


def _cmdlines_holding(text: str) -> list[str]:
    """Every process on this machine whose command line holds `text` (sshd hosts run here)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    line = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # gone meanwhile
            if text in line:
                found.append(f"{entry}: {line}")
    return found


def test_hosts_env_values_never_appear_on_a_command_line(testbed, tmp_path):
    """A host's `env` value is on no process's command line (world-readable through
    `ps`) while a program started there runs, over SSH and locally; the program has it."""
    h = testbed.add_host("h1")
    inv = load_inventory(testbed.write_inventory())
    env = (("ELT_TOKEN", SECRET), ("ELT_PLAIN", "1"))
    hosts = [Host(name="h1", address=h.address, port=h.port, env=env),
             Host(name="here", address="local", env=env)]

    async def hold(host, t):
        # the program: a long-running python, holding until the test has looked
        ready, go = tmp_path / f"{host.name}.pid", tmp_path / f"{host.name}.go"
        prog = (f"import os, time; open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
                f"while not os.path.exists({str(go)!r}): time.sleep(0.02)")
        return await t.run(f"exec {sys.executable} -c {shlex.quote(prog)}", input="", timeout=120)

    async def main():
        async with Fleet(hosts, ssh=inv.ssh) as fleet:
            running = asyncio.ensure_future(fleet.each(None, hold))
            pids = {}
            for name in ("h1", "here"):
                while not (tmp_path / f"{name}.pid").exists() or not (tmp_path / f"{name}.pid").read_text():
                    await asyncio.sleep(0.02)
                pids[name] = int((tmp_path / f"{name}.pid").read_text())
            seen = _cmdlines_holding("9f3c2a7e51b4")
            environs = {name: Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for name, pid in pids.items()}
            for name in pids:
                (tmp_path / f"{name}.go").touch()
            done = await running
            # a byte stream gets the values too, and its own input after them, whole
            s = await (await fleet.transport(hosts[0])).open_stream('printf "%s|" "$ELT_TOKEN"; cat')
            await s.write(bytes(range(256)))
            await s.close_stdin()
            got = bytearray()
            while chunk := await s.read(1 << 16):
                got += chunk
            return seen, environs, done, bytes(got), await s.wait()

    seen, environs, out, streamed, (status, _) = asyncio.run(main())
    assert status == 0 and streamed == SECRET.encode() + b"|" + bytes(range(256))
    assert seen == [], f"a host's env value is on a command line: {seen}"
    for name in ("h1", "here"):
        assert out[name].ok and out[name].value.ok, out[name]
        assert f"ELT_TOKEN={SECRET}".encode() in environs[name] and b"ELT_PLAIN=1" in environs[name]


def test_a_slow_command_is_that_hosts_timeout_only(testbed):
    a, b = testbed.add_hosts(2)
    inv = load_inventory(testbed.write_inventory())

    async def fn(host, t):
        return await t.run("sleep 30" if host.name == a.name else "echo fine", timeout=1)

    async def main():
        async with Fleet(inv) as fleet:
            return await fleet.each(None, fn)

    started = time.monotonic()
    out = asyncio.run(main())
    assert out[a.name].error.kind == ErrorKind.TIMEOUT and "1 s" in out[a.name].error.message
    assert out[b.name].value.stdout == "fine\n"
    assert time.monotonic() - started < 30


def test_ssh_byte_stream_carries_any_bytes_and_reports_the_exit(testbed):
    testbed.add_host("h1")
    inv = load_inventory(testbed.write_inventory())
    data = bytes(range(256)) * 8000  # every byte value, several SSH window sizes

    async def main():
        async with Fleet(inv) as fleet:
            t = await fleet.transport(inv.hosts[0])
            s = await t.open_stream("cat; echo done >&2; exit 4")

            async def feed():
                for i in range(0, len(data), 100_000):
                    await s.write(data[i:i + 100_000])
                await s.close_stdin()

            writer = asyncio.ensure_future(feed())
            got = bytearray()
            while chunk := await s.read(1 << 16):
                got += chunk
            await writer
            return bytes(got), await s.wait(), t.local_address()

    got, (status, err), address = asyncio.run(main())
    assert got == data and (status, err) == (4, "done\n")
    assert address is not None and address.startswith("127.")


def test_changed_host_key_is_reported_with_the_fix_and_never_accepted(testbed):
    h = testbed.add_host("h1")
    h.change_host_key()
    inv = load_inventory(testbed.write_inventory())
    from eltctl.hosts import ssh

    with pytest.raises(HostError) as err:
        asyncio.run(ssh.connect(inv.hosts[0], inv.ssh))
    e = err.value
    assert e.kind == ErrorKind.HOST_KEY_CHANGED and "CHANGED" in e.message and "SHA256:" in e.message
    assert f"ssh-keygen -R '[{h.address}]:{h.port}' -f {testbed.known_hosts}" in e.hint
    with pytest.raises(HostError) as again:
        asyncio.run(ssh.accept_new_host_key(inv.hosts[0], inv.ssh))
    assert again.value.kind == ErrorKind.HOST_KEY_CHANGED
    assert h.public_key.split()[1] not in testbed.known_hosts.read_text()


def test_ssh_config_and_agent_are_honoured(testbed, tmp_path):
    """No identity_file, no port in the inventory: the port comes from ~/.ssh/config and
    the key from ssh-agent, as with the plain ssh client."""
    h = testbed.add_host("h1")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f"Host {h.address}\n  Port {h.port}\n  User {testbed.user}\n")
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(f"""
[job]
name = "test"
command = ["python", "train.py"]
workdir = "."

[ssh]
known_hosts = "{testbed.known_hosts}"
connect_timeout = 10

[[hosts]]
name = "via-config"
address = "{h.address}"
""")
    agent = subprocess.run(["ssh-agent", "-s", "-a", str(tmp_path / "agent.sock")], capture_output=True,
                           text=True, check=True)
    pid = int(agent.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    try:
        env = {**os.environ, "HOME": str(home), "SSH_AUTH_SOCK": str(tmp_path / "agent.sock"),
               "COLUMNS": "200"}
        subprocess.run(["ssh-add", str(testbed.client_key)], env=env, capture_output=True, check=True)
        out = subprocess.run([*ELTCTL, "-i", str(inventory), "probe", "--json"], capture_output=True,
                             text=True, env=env, cwd=ROOT, timeout=120)
        [doc] = json.loads(out.stdout)
        assert doc["state"] == "ok", doc
        # Without the agent the same inventory cannot log in: the key came from the agent.
        env.pop("SSH_AUTH_SOCK")
        out = subprocess.run([*ELTCTL, "-i", str(inventory), "probe", "--json"], capture_output=True,
                             text=True, env=env, cwd=ROOT, timeout=120)
        [doc] = json.loads(out.stdout)
        assert doc["state"] == "unreachable" and doc["error"]["kind"] == "auth", doc
    finally:
        os.kill(pid, signal.SIGTERM)


def test_ssh_config_cannot_turn_host_key_checking_off_or_forward_the_agent(testbed, tmp_path, monkeypatch):
    """~/.ssh/config says `UserKnownHostsFile none`, `StrictHostKeyChecking no` and
    `ForwardAgent yes`: eltctl still checks the host key against its own known_hosts
    (the inventory's, else ~/.ssh/known_hosts) and forwards no agent."""
    from eltctl.inventory import SSHSettings
    from eltctl.hosts import ssh

    h = testbed.add_host("h1")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f"Host {h.address}\n  Port {h.port}\n  User {testbed.user}\n  UserKnownHostsFile none\n"
        "  StrictHostKeyChecking no\n  ForwardAgent yes\n")
    sock = tmp_path / "agent.sock"
    agent = subprocess.run(["ssh-agent", "-s", "-a", str(sock)], capture_output=True, text=True, check=True)
    pid = int(agent.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
    host = Host(name="h1", address=h.address)
    try:
        subprocess.run(["ssh-add", str(testbed.client_key)], capture_output=True, check=True)

        async def try_with(settings):
            t = await ssh.connect(host, settings)
            try:
                return (await t.run("echo agent=${SSH_AUTH_SOCK:-none}")).stdout.strip()
            finally:
                await t.close()

        # No known_hosts in the inventory: ~/.ssh/known_hosts (empty here) decides, not `none`.
        with pytest.raises(HostError) as refused:
            asyncio.run(try_with(SSHSettings(connect_timeout=10)))
        assert refused.value.kind is ErrorKind.HOST_KEY_UNKNOWN, refused.value
        # With the key known: connected, and the remote side has no forwarded agent.
        assert asyncio.run(try_with(SSHSettings(connect_timeout=10, known_hosts=testbed.known_hosts))) == "agent=none"
    finally:
        os.kill(pid, signal.SIGTERM)


def test_a_proxyjump_hop_is_checked_like_the_host(testbed, tmp_path, monkeypatch):
    """~/.ssh/config sends the host through a ProxyJump hop: the hop is verified against
    the inventory's known_hosts and logged into with the same keys (asyncssh alone would
    use the config only, here `UserKnownHostsFile none` for the second hop)."""
    from eltctl.inventory import SSHSettings
    from eltctl.hosts import ssh

    jump, target, stranger = testbed.add_host("jump"), testbed.add_host("target"), testbed.add_host("j2", known=False)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    u = testbed.user
    (home / ".ssh" / "config").write_text(
        f"Host {target.address}\n  Port {target.port}\n  User {u}\n  ProxyJump {u}@{jump.address}:{jump.port}\n"
        f"Host {stranger.address}\n  UserKnownHostsFile none\n  StrictHostKeyChecking no\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    settings = SSHSettings(connect_timeout=10, known_hosts=testbed.known_hosts, identity_file=testbed.client_key)
    host = Host(name="target", address=target.address)

    async def run_on(h):
        t = await ssh.connect(h, settings)
        try:
            return (await t.run("echo ok")).stdout.strip()
        finally:
            await t.close()

    before = accepted_logins(jump)
    assert asyncio.run(run_on(host)) == "ok"
    assert accepted_logins(jump) == before + 1  # it went through the hop
    # The same host behind a hop whose key is not known: refused, whatever the config says.
    (home / ".ssh" / "config").write_text(
        f"Host {target.address}\n  Port {target.port}\n  User {u}\n  ProxyJump {u}@{stranger.address}:{stranger.port}\n"
        f"Host {stranger.address}\n  UserKnownHostsFile none\n  StrictHostKeyChecking no\n")
    with pytest.raises(HostError) as refused:
        asyncio.run(run_on(host))
    assert refused.value.kind is ErrorKind.HOST_KEY_UNKNOWN and "ProxyJump hop" in str(refused.value), refused.value
    assert accepted_logins(stranger) == 0

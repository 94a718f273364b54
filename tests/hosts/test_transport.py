"""The transport seam: the local transport, the Fleet's fan-out rules, and SSH errors
that need no sshd (nothing listening, a listener that never speaks SSH).

Real sshd hosts are in tests/hosts/test_ssh.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from eltctl.errors import HostError
from eltctl.inventory import Host, SSHSettings
from eltctl.hosts.ssh import Endpoint, endpoint
from eltctl.hosts.fleet import Fleet
from eltctl.hosts.local import LocalTransport
from eltctl.hosts.transport import ErrorKind, RunResult, Transport, Wrapped, wrap_env

LOCAL = Host(name="here", address="local")


def run(coro):
    return asyncio.run(coro)


# --------------------------------------------------------------------------- LocalTransport

def test_local_transport_returns_output_and_exit_status():
    t = LocalTransport(LOCAL)
    r = run(t.run("echo out; echo err >&2; exit 3"))
    assert r == RunResult(exit_status=3, stdout="out\n", stderr="err\n")
    assert not r.ok and isinstance(t, Transport)


def test_local_transport_feeds_input():
    r = run(LocalTransport(LOCAL).run("tr a-z A-Z", input="hello"))
    assert r.ok and r.stdout == "HELLO"


def test_local_byte_stream_carries_any_bytes_and_reports_the_exit():
    data = bytes(range(256)) * 5000  # every byte value, more than one pipe buffer

    async def main():
        t = LocalTransport(LOCAL)
        s = await t.open_stream("cat; echo done >&2; exit 4")
        writer = asyncio.ensure_future(_write_all(s, data))
        got = bytearray()
        while chunk := await s.read(1 << 16):
            got += chunk
        await writer
        return bytes(got), await s.wait(), t.local_address()

    got, (status, err), address = run(main())
    assert got == data and (status, err) == (4, "done\n") and address is None


def test_local_byte_stream_kill_ends_the_command():
    async def main():
        s = await LocalTransport(LOCAL).open_stream("sleep 60")
        started = time.monotonic()
        s.kill()
        status, _err = await s.wait()
        s.kill()  # again, after it ended: harmless
        return status, time.monotonic() - started

    status, took = run(main())
    assert status < 0 and took < 10


async def _write_all(stream, data: bytes) -> None:
    for i in range(0, len(data), 100_000):
        await stream.write(data[i:i + 100_000])
    await stream.close_stdin()


def test_local_transport_applies_the_hosts_env():
    host = Host(name="h", address="local", env=(("ELT_A", "x y'z"), ("ELT_B", "2")))
    r = run(LocalTransport(host).run('printf "%s|%s" "$ELT_A" "$ELT_B"'))
    assert r.stdout == "x y'z|2"


def test_local_transport_timeout_kills_the_whole_command(tmp_path):
    pidfile = tmp_path / "child.pid"
    t = LocalTransport(LOCAL)
    started = time.monotonic()
    with pytest.raises(HostError) as err:
        run(t.run(f"sleep 60 & echo $! > {pidfile}; wait", timeout=0.5))
    assert err.value.kind == ErrorKind.TIMEOUT and "0.5 s" in err.value.message
    assert time.monotonic() - started < 30
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the command's children must die with it"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_wrap_env_without_env_is_the_private_command():
    assert wrap_env("echo hi", ()) == Wrapped("umask 077; echo hi")
    assert Wrapped("x").input("in") == "in" and Wrapped("x").input(None) is None


SECRETS = [("A", "s3cret-token"), ("B", "it's a \"test\" $HOME `id` \\c %s \\0134 \\n"),
           ("C", "two\nlines\n\n"), ("D", ""), ("E", "é ünïcode \t tab")]


def test_wrap_env_names_variables_on_the_command_line_and_puts_values_on_stdin():
    w = wrap_env("true", SECRETS)
    for name, value in SECRETS:
        assert f"read -r {name}" in w.command
        if value:
            assert value not in w.command
    assert w.stdin_head.count("\n") == len(SECRETS)  # one line per value, newlines escaped
    assert w.input("rest") == w.stdin_head + "rest" and w.input(None) == w.stdin_head


def test_wrapped_command_sees_every_value_exactly_and_the_input_after_them():
    names = " ".join(f'"${n}"' for n, _ in SECRETS)
    w = wrap_env(f"printf '%s|' {names}; cat", SECRETS)
    r = run(LocalTransport(LOCAL).run(w.command, input=w.input("the input\nstays whole\n")))
    assert r.ok, r.stderr
    assert r.stdout == "".join(v + "|" for _, v in SECRETS) + "the input\nstays whole\n"


def test_wrapped_command_without_its_values_on_stdin_says_so():
    r = run(LocalTransport(LOCAL).run(wrap_env("echo ran", [("TOKEN", "x")]).command, input=""))
    assert r.exit_status == 125 and "TOKEN did not arrive on stdin" in r.stderr and "ran" not in r.stdout


def test_what_a_command_creates_on_a_host_is_private(tmp_path):
    os.umask(0o022)
    r = run(LocalTransport(LOCAL).run(f"mkdir {tmp_path}/d && echo x > {tmp_path}/d/f && umask"))
    assert r.stdout.strip() == "0077"
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o700 and (tmp_path / "d" / "f").stat().st_mode & 0o777 == 0o600


# --------------------------------------------------------------------------- Fleet

class Recorder:
    """A connector for tests: local transports, with counts and scripted failures."""

    def __init__(self, fail: dict[str, BaseException] | None = None, delay: float = 0.0) -> None:
        self.fail = fail or {}
        self.delay = delay
        self.calls: list[str] = []
        self.active = 0
        self.peak = 0
        self.closed: list[str] = []

    async def __call__(self, host: Host) -> Transport:
        self.calls.append(host.name)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay)
            if host.name in self.fail:
                raise self.fail[host.name]
        finally:
            self.active -= 1
        rec = self

        class Closing(LocalTransport):
            async def close(self) -> None:
                rec.closed.append(self.host.name)

        return Closing(host)


def hosts(n: int) -> list[Host]:
    return [Host(name=f"h{i}", address="local") for i in range(n)]


def test_each_returns_one_outcome_per_host_and_failures_do_not_abort_the_others():
    rec = Recorder(fail={"h1": HostError("h1", "refused", kind=ErrorKind.UNREACHABLE)})

    async def fn(host, t):
        if host.name == "h2":
            raise ValueError("a bug for this host only")
        if host.name == "h3":
            return (await t.run("exit 4")).exit_status
        return (await t.run(f"echo {host.name}")).stdout.strip()

    async def main():
        async with Fleet(hosts(5), connector=rec) as fleet:
            return await fleet.each(None, fn)

    out = run(main())
    assert list(out) == ["h0", "h1", "h2", "h3", "h4"]
    assert out["h0"].ok and out["h0"].value == "h0" and out["h4"].value == "h4"
    assert out["h1"].error.kind == ErrorKind.UNREACHABLE and out["h1"].value is None
    assert out["h2"].error.kind == ErrorKind.INTERNAL and isinstance(out["h2"].error.__cause__, ValueError)
    assert out["h3"].ok and out["h3"].value == 4  # a failing command is a value, not an error


def test_a_hanging_host_costs_only_its_own_timeout():
    async def fn(host, t):
        if host.name == "h0":
            await asyncio.sleep(3600)
        return host.name

    async def main():
        async with Fleet(hosts(4), connector=Recorder()) as fleet:
            started = time.monotonic()
            out = await fleet.each(None, fn, timeout=0.5)
            return out, time.monotonic() - started

    out, took = run(main())
    assert out["h0"].error.kind == ErrorKind.TIMEOUT
    assert [out[f"h{i}"].value for i in (1, 2, 3)] == ["h1", "h2", "h3"]
    assert took < 30  # bounded by the timeout (0.5 s) plus a generous margin


def test_one_connection_per_host_reused_across_calls_and_closed_on_exit():
    rec = Recorder(delay=0.05)

    async def fn(host, t):
        return id(t)

    async def main():
        async with Fleet(hosts(3), connector=rec) as fleet:
            a, b = await asyncio.gather(fleet.each(None, fn), fleet.each(None, fn))
            c = await fleet.each(None, fn)
            assert rec.closed == []
            return a, b, c

    a, b, c = run(main())
    assert sorted(rec.calls) == ["h0", "h1", "h2"]
    for name in ("h0", "h1", "h2"):
        assert a[name].value == b[name].value == c[name].value
    assert sorted(rec.closed) == ["h0", "h1", "h2"]


def test_connecting_is_bounded_by_max_parallel():
    rec = Recorder(delay=0.1)

    async def main():
        async with Fleet(hosts(10), connector=rec, max_parallel=3) as fleet:
            return await fleet.each(None, lambda h, t: asyncio.sleep(0, result=h.name))

    out = run(main())
    assert all(o.ok for o in out.values())
    assert rec.peak == 3


def test_a_failed_connection_is_remembered_until_forgotten():
    rec = Recorder(fail={"h0": HostError("h0", "no", kind=ErrorKind.AUTH)})

    async def fn(host, t):
        return "ok"

    async def main():
        async with Fleet(hosts(1), connector=rec) as fleet:
            first = await fleet.each(None, fn)
            second = await fleet.each(None, fn)
            assert rec.calls == ["h0"]
            rec.fail.clear()
            await fleet.forget("h0")
            third = await fleet.each(None, fn)
            return first, second, third

    first, second, third = run(main())
    assert first["h0"].error.kind == ErrorKind.AUTH and second["h0"].error.kind == ErrorKind.AUTH
    assert third["h0"].value == "ok" and rec.calls == ["h0", "h0"]


def test_fleet_uses_the_local_transport_for_local_hosts():
    async def main():
        async with Fleet([LOCAL]) as fleet:
            return await fleet.each(None, lambda h, t: t.run("echo $$"))

    out = run(main())
    assert out["here"].ok and int(out["here"].value.stdout) != os.getpid()


# --------------------------------------------------------------------------- SSH without sshd

@pytest.mark.parametrize("host, settings, expected", [
    (Host("a", "10.0.0.1"), SSHSettings(), Endpoint("10.0.0.1", None, None)),
    (Host("a", "10.0.0.1", port=2222, user="bob"), SSHSettings(user="x", port=2200),
     Endpoint("10.0.0.1", 2222, "bob")),
    (Host("a", "10.0.0.1"), SSHSettings(user="x", port=2200), Endpoint("10.0.0.1", 2200, "x")),
])
def test_inventory_user_and_port_override_ssh_config_only_when_set(host, settings, expected):
    assert endpoint(host, settings) == expected


@pytest.mark.parametrize("ep, name", [
    (Endpoint("10.0.0.1", None, None), "10.0.0.1"),
    (Endpoint("10.0.0.1", 22, None), "10.0.0.1"),
    (Endpoint("127.0.0.2", 2222, None), "[127.0.0.2]:2222"),
])
def test_known_hosts_names_follow_openssh(ep, name):
    assert ep.known_hosts_name == name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_is_unreachable_with_a_fix(tmp_path):
    from eltctl.hosts import ssh

    host = Host("dead", "127.0.0.1", port=_free_port())
    with pytest.raises(HostError) as err:
        run(ssh.connect(host, SSHSettings(connect_timeout=5, known_hosts=tmp_path / "kh")))
    assert err.value.kind == ErrorKind.UNREACHABLE
    assert "127.0.0.1" in err.value.message and err.value.hint


def test_a_listener_that_never_speaks_ssh_times_out(tmp_path):
    from eltctl.hosts import ssh

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        host = Host("silent", "127.0.0.1", port=srv.getsockname()[1])
        started = time.monotonic()
        with pytest.raises(HostError) as err:
            run(ssh.connect(host, SSHSettings(connect_timeout=1, known_hosts=tmp_path / "kh")))
        assert err.value.kind == ErrorKind.TIMEOUT
        assert time.monotonic() - started < 30
    finally:
        stop.set()
        th.join()
        for s in held:
            s.close()
        srv.close()


def test_an_unreadable_identity_file_is_a_clear_auth_error(tmp_path):
    from eltctl.hosts import ssh

    host = Host("h", "127.0.0.1", port=_free_port())
    settings = SSHSettings(identity_file=tmp_path / "missing_key", known_hosts=tmp_path / "kh")
    with pytest.raises(HostError) as err:
        run(ssh.connect(host, settings))
    assert err.value.kind == ErrorKind.AUTH and "missing_key" in err.value.message and err.value.hint

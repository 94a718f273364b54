"""SSH, the one place that knows asyncssh.

`SSHTransport` is the `Transport` (see `eltctl.hosts.transport`) for a remote host; `connect`
opens one with the inventory's `[ssh]` settings on top of what `~/.ssh/config` and the
ssh-agent provide. Host keys are always verified against `known_hosts`; nothing here
ever turns that off. Everything asyncssh raises is turned into a `HostError` whose kind
says what went wrong and whose hint says how to fix it (STYLE.md point 5: no other
module catches asyncssh's exceptions).

`accept_new_host_key` is the explicit trust-on-first-use step behind
`eltctl doctor --accept-new`: it records a key only for a host that has none yet,
never replacing a changed one.

asyncssh is imported inside the functions, so that `eltctl --help` does not pay for it.
"""

from __future__ import annotations

import asyncio
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eltctl.errors import HostError
from eltctl.inventory import Host, SSHSettings
from eltctl.hosts.transport import ErrorKind, RunResult, wrap_env

if TYPE_CHECKING:  # pragma: no cover
    import asyncssh

DEFAULT_PORT = 22
DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts")
# sshd allows 10 sessions per connection by default (MaxSessions); stay below it so
# that callers may run commands concurrently on one connection.
MAX_SESSIONS = 6
SESSION_RETRY_DELAYS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8)  # seconds between refused session opens
KEEPALIVE_INTERVAL = 15.0  # seconds; 3 missed answers drop a dead connection


@dataclass(frozen=True)
class Endpoint:
    """Where one host's sshd is, as far as the inventory says (config may add more)."""

    address: str
    port: int | None  # None: let ~/.ssh/config (or 22) decide
    user: str | None  # None: let ~/.ssh/config (or the local user) decide

    @property
    def effective_port(self) -> int:
        return self.port or DEFAULT_PORT

    @property
    def known_hosts_name(self) -> str:
        """The name OpenSSH writes in known_hosts: `addr`, or `[addr]:port`."""
        if self.effective_port == DEFAULT_PORT:
            return self.address
        return f"[{self.address}]:{self.effective_port}"

    def ssh_command(self) -> str:
        """A plain `ssh` command line reaching the same host, for messages."""
        parts = ["ssh"]
        if self.port:
            parts += ["-p", str(self.port)]
        parts.append(f"{self.user}@{self.address}" if self.user else self.address)
        return " ".join(shlex.quote(p) for p in parts)


def endpoint(host: Host, settings: SSHSettings) -> Endpoint:
    """The inventory's user and port override `~/.ssh/config` only when they are set.

    The value types cannot tell "port = 22 written" from "port not written", so 22
    means "not set": config then decides, and its default is 22 anyway.
    """
    port = host.port if host.port != DEFAULT_PORT else (
        settings.port if settings.port != DEFAULT_PORT else None)
    return Endpoint(address=host.address, port=port, user=host.user or settings.user)


def known_hosts_path(settings: SSHSettings) -> Path:
    """The known_hosts file eltctl checks against and `--accept-new` writes to."""
    return (settings.known_hosts or DEFAULT_KNOWN_HOSTS).expanduser()


class SSHTransport:
    """One SSH connection to one host, reused for every command of a CLI command."""

    def __init__(self, host: Host, conn: "asyncssh.SSHClientConnection", *,
                 default_timeout: float | None = None, hops: tuple = ()) -> None:
        self.host = host
        self._conn = conn
        self._hops = hops  # the ProxyJump connections it runs through, first hop first
        self._default_timeout = default_timeout
        self._sessions = asyncio.Semaphore(MAX_SESSIONS)

    def local_address(self) -> str | None:
        """The address of this machine's end of the connection (what the host sees)."""
        sock = self._conn.get_extra_info("sockname")
        return sock[0] if sock else None

    async def remote_forward_refusal(self) -> str | None:
        """Whether the host's sshd forwards a Unix socket for this connection (OpenSSH's
        streamlocal forwarding, what the "ssh" store mode's forward needs): None when it
        does (a socket in ~/.eltctl is opened, closed and removed at once), else why not."""
        import secrets

        import asyncssh

        res = await self.run("umask 077 && mkdir -p ~/.eltctl && chmod 700 ~/.eltctl && cd ~/.eltctl && pwd",
                             timeout=30)
        where = res.stdout.strip().splitlines()
        if not res.ok or not where or not where[-1].startswith("/"):
            return f"cannot make ~/.eltctl there: {(res.stderr or res.stdout).strip()[-200:]}"
        path = f"{where[-1]}/.probe-{secrets.token_hex(4)}.sock"
        try:
            listener = await self._conn.forward_remote_path(path, "/nonexistent/eltctl-probe")
        except (asyncssh.Error, asyncssh.ChannelListenError, OSError) as exc:
            return str(exc) or type(exc).__name__
        listener.close()
        await self.run(f"rm -f {shlex.quote(path)}", timeout=30)
        return None

    async def open_stream(self, command: str) -> "SSHStream":
        """A channel of this connection running `command` with binary stdin and stdout."""
        import asyncssh

        wrapped = wrap_env(command, self.host.env)
        try:
            proc = await self._conn.create_process(wrapped.command, encoding=None)
            if wrapped.stdin_head:  # the host's env values, read before the command's own input
                proc.stdin.write(wrapped.stdin_head.encode())
        except (asyncssh.Error, OSError) as exc:
            raise HostError(self.host.name, f"could not start a copy: {exc}", kind=ErrorKind.UNREACHABLE) from exc
        return SSHStream(proc)

    async def run(self, command: str, *, timeout: float | None = None,
                  input: str | None = None) -> RunResult:
        import asyncssh

        timeout = self._default_timeout if timeout is None else timeout
        full = wrap_env(command, self.host.env)  # env values on stdin, never on the command line
        async with self._sessions:
            try:
                done = await self._run_once(full.command, full.input(input), timeout)
            except asyncssh.TimeoutError as exc:
                raise HostError(
                    self.host.name, f"command did not finish in {timeout:g} s",
                    kind=ErrorKind.TIMEOUT,
                    hint="the host may be overloaded; raise [ssh] command_timeout if it is just slow",
                ) from exc
            except asyncssh.ChannelOpenError as exc:
                raise HostError(self.host.name, f"could not start a command: {exc.reason}",
                                kind=ErrorKind.COMMAND) from exc
            except (asyncssh.Error, OSError) as exc:
                raise HostError(self.host.name, f"connection lost: {_describe(exc)}",
                                kind=ErrorKind.UNREACHABLE) from exc
        status = done.returncode if done.returncode is not None else -1
        return RunResult(exit_status=status, stdout=_text(done.stdout), stderr=_text(done.stderr))

    async def _run_once(self, command: str, input: str | None, timeout: float | None):
        """Run it, retrying only a refused session open (the command never started).

        sshd frees a finished session slightly after the client sees it end, so a new
        session opened right then can be refused (MaxSessions) though few are open.
        """
        import asyncssh

        # asyncssh sends end-of-input only after non-empty input: empty input (an empty
        # script for script_imports) would leave the command reading stdin until the timeout.
        stdin = {"stdin": asyncssh.DEVNULL} if input == "" else {"input": input}
        closed = getattr(self._conn, "is_closed", lambda: False)
        for delay in SESSION_RETRY_DELAYS:
            try:
                return await self._conn.run(command, **stdin, timeout=timeout,
                                            check=False, errors="replace")
            except asyncssh.ChannelOpenError:
                if closed():
                    raise  # the connection is gone: no session will open on it (not 1.6 s of retries)
                await asyncio.sleep(delay)
        return await self._conn.run(command, **stdin, timeout=timeout, check=False, errors="replace")

    async def close(self) -> None:
        for c in (self._conn, *reversed(self._hops)):
            c.close()
            try:
                await asyncio.wait_for(c.wait_closed(), timeout=5)
            except (asyncio.TimeoutError, OSError):
                pass  # closing is best effort; the socket is gone either way


class SSHStream:
    """The `ByteStream` of one SSH channel (an asyncssh client process, bytes mode)."""

    def __init__(self, proc: "asyncssh.SSHClientProcess") -> None:
        self._p = proc

    async def write(self, data: bytes) -> None:
        self._p.stdin.write(data)
        await self._p.stdin.drain()

    async def close_stdin(self) -> None:
        self._p.stdin.write_eof()

    async def read(self, n: int) -> bytes:
        return await self._p.stdout.read(n)

    async def wait(self) -> tuple[int, str]:
        err = await self._p.stderr.read()
        done = await self._p.wait()
        status = done.exit_status if done.exit_status is not None else -1
        return status, _text(err)

    def kill(self) -> None:
        self._p.close()


def _text(data: object) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return str(data)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens on that port)"
    if isinstance(exc, socket.gaierror):
        return f"the name does not resolve ({exc.strerror or exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[0].lower() + exc.strerror[1:]
    text = str(exc).strip()
    return text or type(exc).__name__


def _client_options(settings: SSHSettings) -> dict:
    """Keyword arguments for asyncssh.connect shared by every host.

    `config` is left at its default, so asyncssh reads `~/.ssh/config` itself
    (Host, Match, Include, ProxyJump, IdentityFile...), except what would weaken it:
    `known_hosts` is always given (None or config's `none` would switch verification
    off) and agent forwarding is always off.
    """
    import asyncssh

    opts: dict = {
        "connect_timeout": settings.connect_timeout,
        "login_timeout": settings.connect_timeout,
        "keepalive_interval": KEEPALIVE_INTERVAL,
        "keepalive_count_max": 3,
    }
    # Always an explicit known_hosts: the inventory's file, else ~/.ssh/known_hosts. Left
    # to ~/.ssh/config, `UserKnownHostsFile none` would switch checking off. A file that
    # does not exist yet means "nothing is trusted yet", not "trust everything": hand
    # asyncssh an empty list of known hosts.
    kh = known_hosts_path(settings)
    opts["known_hosts"] = str(kh) if kh.is_file() else asyncssh.import_known_hosts("")
    # Never forward the agent to the hosts, whatever ~/.ssh/config says (ForwardAgent):
    # a job runs for days on machines other people use.
    opts["agent_forwarding"] = False
    if settings.identity_file is not None:
        from asyncssh.public_key import load_default_keypairs

        # The identity file first, then the default keys; the agent is used as well
        # (asyncssh keeps it when client_keys is given).
        opts["client_keys"] = (
            list(asyncssh.load_keypairs([str(Path(settings.identity_file).expanduser())]))
            + list(load_default_keypairs()))
    return opts


def jump_hops(ep: Endpoint) -> list[Endpoint]:
    """The ProxyJump hops `~/.ssh/config` gives this host, first hop first (none: []).

    eltctl opens the hops itself, with the same host-key checks, keys and options as
    the host: asyncssh would open them with the config alone (no inventory known_hosts
    or identity, and `UserKnownHostsFile none` honoured)."""
    import asyncssh

    try:
        o = asyncssh.SSHClientConnectionOptions(
            host=ep.address, port=ep.port or (), username=ep.user or (), config=(), known_hosts=None,
            client_keys=None, agent_path=None)
    except (OSError, ValueError, asyncssh.Error):
        return []
    spec = o.tunnel
    if not isinstance(spec, str) or not spec.strip() or spec.strip().lower() == "none":
        return []
    hops = []
    for part in spec.split(","):
        user, _, hostport = part.strip().rpartition("@")
        addr, port = hostport, None
        if hostport.startswith("[") and "]" in hostport:  # [v6addr]:port
            addr, _, rest = hostport[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else None
        elif hostport.count(":") == 1:
            addr, p = hostport.split(":")
            port = int(p)
        hops.append(Endpoint(address=addr, port=port, user=user or None))
    return hops


async def connect(host: Host, settings: SSHSettings) -> SSHTransport:
    """Open and authenticate one connection, or raise a `HostError` saying why not."""
    ep = endpoint(host, settings)
    hops: list = []
    try:
        for hop in jump_hops(ep):
            hops.append(await _open(host, hop, settings, tunnel=hops[-1] if hops else None,
                                    via=f" (the ProxyJump hop {hop.address} of ~/.ssh/config)"))
        conn = await _open(host, ep, settings, tunnel=hops[-1] if hops else (), via="")
    except BaseException:
        for c in reversed(hops):
            c.close()
        raise
    return SSHTransport(host, conn, default_timeout=settings.command_timeout, hops=tuple(hops))


async def _open(host: Host, ep: Endpoint, settings: SSHSettings, *, tunnel, via: str):
    """One authenticated asyncssh connection to `ep` (the host, or a hop on the way: `via`
    says which in errors). tunnel: the previous hop, None (ignore config's ProxyJump:
    connect() opens the hops) or () (the host without hops)."""
    import asyncssh

    try:
        kwargs = _client_options(settings)
    except (OSError, asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as exc:
        raise HostError(
            host.name, f"cannot load [ssh] identity_file {settings.identity_file}: {_describe(exc)}",
            kind=ErrorKind.AUTH,
            hint="check the path in the inventory; a passphrase-protected key must be loaded into "
                 "ssh-agent (ssh-add) instead (cron runs have no agent: `eltctl cron` needs a key without "
                 "a passphrase)",
        ) from exc
    if ep.port is not None:
        kwargs["port"] = ep.port
    if ep.user is not None:
        kwargs["username"] = ep.user
    kwargs["tunnel"] = tunnel
    try:
        # connect_timeout covers TCP, the SSH handshake and authentication; the outer
        # wait_for is a backstop for a peer that stalls somewhere asyncssh does not time.
        return await asyncio.wait_for(asyncssh.connect(ep.address, **kwargs),
                                      timeout=settings.connect_timeout + 5)
    except asyncssh.HostKeyNotVerifiable as exc:
        err = await _host_key_error(host, ep, settings)
        if via:
            err = HostError(host.name, f"{err.message.removeprefix(host.name + ': ')}{via}", kind=err.kind,
                            hint=err.hint)
        raise err from exc
    except asyncssh.PermissionDenied as exc:
        raise HostError(
            host.name, f"authentication failed for {ep.user or 'the default user'}{via}: {_describe(exc)}",
            kind=ErrorKind.AUTH,
            hint=(f"install your public key on the host (ssh-copy-id"
                  f"{' -p ' + str(ep.port) if ep.port else ''} {ep.user + '@' if ep.user else ''}{ep.address}), "
                  "load it into ssh-agent, or set [ssh] identity_file in the inventory"),
        ) from exc
    except asyncio.TimeoutError as exc:
        raise HostError(
            host.name, f"no SSH answer from {ep.address}:{ep.effective_port}{via} within "
            f"{settings.connect_timeout:g} s",
            kind=ErrorKind.TIMEOUT,
            hint=f"check that sshd runs there and answers: {ep.ssh_command()} true",
        ) from exc
    except (socket.gaierror, ConnectionRefusedError, OSError, asyncssh.Error) as exc:
        raise HostError(
            host.name, f"cannot reach {ep.address}:{ep.effective_port}{via}: {_describe(exc)}",
            kind=ErrorKind.UNREACHABLE,
            hint=f"check the address and port in the inventory and that sshd runs: {ep.ssh_command()} true",
        ) from exc


def _recorded_keys(path: Path, ep: Endpoint) -> bool:
    """Whether known_hosts holds any key (or CA) for this host, i.e. a key CHANGED."""
    import asyncssh

    if not path.is_file():
        return False
    try:
        known = asyncssh.read_known_hosts(str(path))
    except (OSError, ValueError, asyncssh.Error):
        return False
    port = ep.port if ep.port and ep.port != DEFAULT_PORT else None
    addr = ep.address
    match = known.match(ep.address, addr, port)
    trusted_host_keys, trusted_ca_keys = match[0], match[1]
    return bool(trusted_host_keys or trusted_ca_keys)


async def fetch_host_key(host: Host, settings: SSHSettings) -> "asyncssh.SSHKey":
    """The key the server presents now, unverified (for fingerprints and --accept-new)."""
    import asyncssh

    ep = endpoint(host, settings)
    try:
        # No port given: ~/.ssh/config (or 22) decides, as for the connection itself.
        port = {"port": ep.port} if ep.port is not None else {}
        key = await asyncio.wait_for(asyncssh.get_server_host_key(ep.address, **port),
                                     timeout=settings.connect_timeout + 5)
    except asyncio.TimeoutError as exc:
        raise HostError(host.name, f"no SSH answer from {ep.address}:{ep.effective_port}",
                        kind=ErrorKind.TIMEOUT) from exc
    except (OSError, asyncssh.Error) as exc:
        raise HostError(host.name, f"cannot fetch the host key: {_describe(exc)}",
                        kind=ErrorKind.UNREACHABLE) from exc
    if key is None:
        raise HostError(host.name, "the server presented no host key", kind=ErrorKind.HOST_KEY_UNKNOWN)
    return key


async def _host_key_error(host: Host, ep: Endpoint, settings: SSHSettings) -> HostError:
    path = known_hosts_path(settings)
    try:
        fingerprint = (await fetch_host_key(host, settings)).get_fingerprint("sha256")
    except HostError:
        fingerprint = "unknown"
    if _recorded_keys(path, ep):
        return HostError(
            host.name,
            f"the host key CHANGED: {ep.known_hosts_name} now presents {fingerprint}, "
            f"which does not match {path}",
            kind=ErrorKind.HOST_KEY_CHANGED,
            hint=(f"if the change is expected (reinstalled host), remove the old entry with "
                  f"`ssh-keygen -R '{ep.known_hosts_name}' -f {path}` and run "
                  "`eltctl doctor --accept-new`; otherwise someone may be intercepting the connection"),
        )
    return HostError(
        host.name,
        f"unknown host key for {ep.known_hosts_name} (fingerprint {fingerprint}); it is not in {path}",
        kind=ErrorKind.HOST_KEY_UNKNOWN,
        hint=(f"run `eltctl doctor --accept-new` to record it, or add it with "
              f"`ssh-keyscan -p {ep.effective_port} {ep.address} >> {path}` after checking the fingerprint"),
    )


@dataclass(frozen=True)
class AcceptedKey:
    host: str
    fingerprint: str
    known_hosts: Path
    line: str


async def accept_new_host_key(host: Host, settings: SSHSettings) -> AcceptedKey:
    """Record the host's key in known_hosts, only if it has no key recorded yet.

    Trust on first use, made explicit: the caller prints the fingerprint. A host whose
    recorded key differs raises HostError(kind=host-key-changed) and nothing is written.
    """
    ep = endpoint(host, settings)
    path = known_hosts_path(settings)
    if _recorded_keys(path, ep):
        raise await _host_key_error(host, ep, settings)
    key = await fetch_host_key(host, settings)
    public = key.export_public_key("openssh").decode().split()
    line = f"{ep.known_hosts_name} {public[0]} {public[1]}"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    needs_newline = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with path.open("a", encoding="utf-8") as f:
        f.write(("\n" if needs_newline else "") + line + "\n")
    return AcceptedKey(host=host.name, fingerprint=key.get_fingerprint("sha256"),
                       known_hosts=path, line=line)

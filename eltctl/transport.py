"""Running commands on hosts: the `Transport` seam, the local transport and the `Fleet`.

A `Transport` runs shell commands on one host. There are two: `LocalTransport`
(`address = "local"`, a subprocess of `/bin/sh`) and `SSHTransport` (`eltctl.ssh`,
asyncssh). Later layers add file transfer and detached launches to the same seam.

A `Fleet` talks to many hosts at once within one CLI command: it opens at most one
connection per host, lazily, with at most `max_parallel` connecting at a time, and
closes them all on exit. `Fleet.each` runs a coroutine on every host concurrently and
returns one `Outcome` per host; an unreachable, slow or failing host becomes its own
outcome and never aborts the others.

    async with Fleet(inventory) as fleet:
        outcomes = await fleet.each(None, lambda host, t: t.run("uptime"))
"""

from __future__ import annotations

import asyncio
import enum
import os
import shlex
import signal
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Iterable, Mapping, Protocol, TypeVar, runtime_checkable

from eltctl.errors import HostError
from eltctl.inventory import Host, Inventory, SSHSettings

T = TypeVar("T")


class ErrorKind(str, enum.Enum):
    """Why a host could not be used; `HostError.kind` holds one of these."""

    UNREACHABLE = "unreachable"  # refused, no route, DNS, connection lost
    TIMEOUT = "timeout"  # no answer in time (connect or command)
    AUTH = "auth"  # reached, but no key was accepted
    HOST_KEY_UNKNOWN = "host-key-unknown"  # reached, key not in known_hosts
    HOST_KEY_CHANGED = "host-key-changed"  # reached, key differs from known_hosts
    COMMAND = "command"  # connected, but a command could not be run
    INTERNAL = "internal"  # a bug in eltctl while handling this host

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class RunResult:
    """What one command left behind. A non-zero exit is a result, not an exception."""

    exit_status: int  # negative: killed by that signal
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


@runtime_checkable
class Transport(Protocol):
    """Runs commands on one host.

    `run` returns a RunResult for any exit status and raises `HostError` only when the
    command could not be run or did not finish (kind `timeout`) within `timeout`
    seconds (None: the transport's default).
    """

    host: Host

    async def run(self, command: str, *, timeout: float | None = None,
                  input: str | None = None) -> RunResult: ...

    async def close(self) -> None: ...


def wrap_env(command: str, env: Iterable[tuple[str, str]]) -> str:
    """The command with the host's extra environment, for any login shell.

    `env K=V sh -c CMD` works whatever shell the account has and does not depend on
    sshd's AcceptEnv.
    """
    pairs = [f"{k}={v}" for k, v in env]
    if not pairs:
        return command
    return "env " + " ".join(shlex.quote(p) for p in pairs) + " /bin/sh -c " + shlex.quote(command)


class LocalTransport:
    """`address = "local"`: commands run as subprocesses of `/bin/sh` on this machine."""

    def __init__(self, host: Host, *, default_timeout: float | None = None,
                 base_env: Mapping[str, str] | None = None) -> None:
        self.host = host
        self._default_timeout = default_timeout
        # The environment eltctl itself runs with, plus the host's `env`; read once here
        # because a local shell inherits it anyway.
        self._env = {**(os.environ if base_env is None else base_env), **dict(host.env)}

    async def run(self, command: str, *, timeout: float | None = None,
                  input: str | None = None) -> RunResult:
        timeout = self._default_timeout if timeout is None else timeout
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", command,
                stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=self._env, start_new_session=True)  # own group: a timeout kills it all
        except OSError as exc:
            raise HostError(self.host.name, f"cannot start /bin/sh: {exc}", kind=ErrorKind.COMMAND) from exc
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(input.encode() if input is not None else None), timeout=timeout)
        except asyncio.TimeoutError as exc:
            _kill_group(proc.pid)
            await proc.wait()
            raise HostError(self.host.name, f"command did not finish in {timeout:g} s",
                            kind=ErrorKind.TIMEOUT) from exc
        except BaseException:
            _kill_group(proc.pid)
            raise
        return RunResult(exit_status=proc.returncode if proc.returncode is not None else -1,
                         stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"))

    async def close(self) -> None:
        return None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """One host's result of `Fleet.each`: a value, or the error that stopped it."""

    host: Host
    value: T | None = None
    error: HostError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


Connector = Callable[[Host], Awaitable[Transport]]


class Fleet:
    """The hosts of one CLI command and their connections (an async context manager).

    Nothing is opened by the constructor; `transport(host)` connects on first use and
    every later use in the same `async with` gets the same connection. A failed
    connection is remembered too, so a dead host costs its timeout once per command
    (`forget(name)` clears it, e.g. after a host key was recorded).
    """

    def __init__(self, hosts: Inventory | Iterable[Host], *, ssh: SSHSettings | None = None,
                 max_parallel: int | None = None, connector: Connector | None = None) -> None:
        if isinstance(hosts, Inventory):
            ssh = ssh or hosts.ssh
            hosts = hosts.hosts
        self.hosts: tuple[Host, ...] = tuple(hosts)
        self.ssh = ssh or SSHSettings()
        self.max_parallel = max(1, max_parallel or self.ssh.max_parallel)
        self._connector = connector or self._default_connect
        self._connecting: asyncio.Semaphore | None = None  # made in the running loop
        self._conns: dict[str, asyncio.Future[Transport]] = {}

    async def __aenter__(self) -> "Fleet":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _default_connect(self, host: Host) -> Transport:
        if host.is_local:
            return LocalTransport(host, default_timeout=self.ssh.command_timeout)
        from eltctl import ssh

        return await ssh.connect(host, self.ssh)

    async def _open(self, host: Host) -> Transport:
        if self._connecting is None:
            self._connecting = asyncio.Semaphore(self.max_parallel)
        async with self._connecting:
            return await self._connector(host)

    async def transport(self, host: Host) -> Transport:
        """The host's connection, opened now if this is the first use; or HostError."""
        fut = self._conns.get(host.name)
        if fut is None:
            fut = asyncio.ensure_future(self._open(host))
            self._conns[host.name] = fut
        return await asyncio.shield(fut)

    async def forget(self, name: str) -> None:
        """Close and drop a host's connection (or remembered failure)."""
        fut = self._conns.pop(name, None)
        if fut is not None:
            await _close_future(fut)

    async def each(self, hosts: Iterable[Host] | None,
                   fn: Callable[[Host, Transport], Awaitable[T]], *,
                   timeout: float | None = None) -> dict[str, Outcome[T]]:
        """Run `fn(host, transport)` on every host at once; one Outcome per host name.

        `timeout` bounds each host's whole turn (connecting included). Every exception a
        host raises becomes its outcome: HostError as is, anything else as a HostError
        of kind `internal` chained to the original, so one host's bug is visible but
        does not abort the batch.
        """
        targets = self.hosts if hosts is None else tuple(hosts)

        async def turn(host: Host) -> T:
            return await fn(host, await self.transport(host))

        async def bounded(host: Host) -> T:
            if timeout is None:
                return await turn(host)
            try:
                return await asyncio.wait_for(turn(host), timeout)
            except asyncio.TimeoutError as exc:
                raise HostError(host.name, f"no result within {timeout:g} s",
                                kind=ErrorKind.TIMEOUT) from exc

        async def one(host: Host) -> Outcome[T]:
            try:
                return Outcome(host, value=await bounded(host))
            except HostError as exc:
                return Outcome(host, error=exc)
            except Exception as exc:  # noqa: BLE001 - one host's bug must not abort the batch
                err = HostError(host.name, f"internal error: {type(exc).__name__}: {exc}",
                                kind=ErrorKind.INTERNAL)
                err.__cause__ = exc
                return Outcome(host, error=err)

        results = await asyncio.gather(*(one(h) for h in targets))
        return {o.host.name: o for o in results}

    async def close(self) -> None:
        conns, self._conns = self._conns, {}
        await asyncio.gather(*(_close_future(f) for f in conns.values()))


async def _close_future(fut: "asyncio.Future[Transport]") -> None:
    if not fut.done():
        fut.cancel()
        try:
            await fut
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing, the error was reported
            return
        return
    if fut.cancelled() or fut.exception() is not None:
        return
    await fut.result().close()

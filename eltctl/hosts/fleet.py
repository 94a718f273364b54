"""The `Fleet`: the hosts of one CLI command (or of the controller) and their connections.

A `Fleet` talks to many hosts at once: it opens at most one connection per host,
lazily, with at most `max_parallel` connecting at a time, and closes them all on
exit. `Fleet.each` runs a coroutine on every host concurrently and returns one
`Outcome` per host; an unreachable, slow or failing host becomes its own outcome and
never aborts the others.

    async with Fleet(inventory) as fleet:
        outcomes = await fleet.each(None, lambda host, t: t.run("uptime"))

`open_transport` is the one place that picks the implementation for a host (local or
SSH); the mirror uses it too for its own host.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Iterable, TypeVar

from eltctl.errors import HostError
from eltctl.hosts.local import LocalTransport
from eltctl.hosts.transport import ErrorKind, Transport
from eltctl.inventory import Host, Inventory, SSHSettings

T = TypeVar("T")


async def open_transport(host: Host, settings: SSHSettings) -> Transport:
    """A transport to `host`: local for `address = "local"`, else an SSH connection."""
    if host.is_local:
        return LocalTransport(host, default_timeout=settings.command_timeout)
    from eltctl.hosts import ssh  # asyncssh is imported only when a remote host is used

    return await ssh.connect(host, settings)


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
        return await open_transport(host, self.ssh)

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

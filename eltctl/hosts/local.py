"""`LocalTransport`: the `Transport` of a host whose `address` is "local".

Commands run as subprocesses of `/bin/sh` on this machine, each in its own process
group, so that a timeout or a kill ends everything the command started.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Mapping

from eltctl.errors import HostError
from eltctl.hosts.transport import PRIVATE, ErrorKind, RunResult
from eltctl.inventory import Host


class LocalTransport:
    """`address = "local"`: commands run as subprocesses of `/bin/sh` on this machine."""

    def __init__(self, host: Host, *, default_timeout: float | None = None,
                 base_env: Mapping[str, str] | None = None) -> None:
        self.host = host
        self._default_timeout = default_timeout
        # The environment eltctl itself runs with, plus the host's `env`; read once here
        # because a local shell inherits it anyway. It goes in the exec environment, never
        # on a command line: /proc/<pid>/environ is readable by the account alone, cmdline
        # by every account (eltctl.hosts.transport `wrap_env` does the same over SSH).
        self._env = {**(os.environ if base_env is None else base_env), **dict(host.env)}

    async def run(self, command: str, *, timeout: float | None = None,
                  input: str | None = None) -> RunResult:
        timeout = self._default_timeout if timeout is None else timeout
        proc = await self._spawn(command, stdin=asyncio.subprocess.PIPE if input is not None
                                 else asyncio.subprocess.DEVNULL)
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

    async def open_stream(self, command: str) -> "LocalStream":
        return LocalStream(await self._spawn(command, stdin=asyncio.subprocess.PIPE))

    def local_address(self) -> str | None:
        return None

    async def close(self) -> None:
        return None

    async def _spawn(self, command: str, *, stdin: int) -> asyncio.subprocess.Process:
        try:
            return await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", PRIVATE + command, stdin=stdin,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=self._env, start_new_session=True)  # own group: a timeout kills it all
        except OSError as exc:
            raise HostError(self.host.name, f"cannot start /bin/sh: {exc}", kind=ErrorKind.COMMAND) from exc


class LocalStream:
    """The `ByteStream` of a local subprocess."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._p = proc

    async def write(self, data: bytes) -> None:
        assert self._p.stdin is not None
        self._p.stdin.write(data)
        await self._p.stdin.drain()

    async def close_stdin(self) -> None:
        assert self._p.stdin is not None
        self._p.stdin.close()

    async def read(self, n: int) -> bytes:
        assert self._p.stdout is not None
        return await self._p.stdout.read(n)

    async def wait(self) -> tuple[int, str]:
        assert self._p.stderr is not None
        err = await self._p.stderr.read()
        return await self._p.wait(), err.decode("utf-8", "replace")

    def kill(self) -> None:
        if self._p.returncode is None:
            _kill_group(self._p.pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone

"""The `Transport` contract: running commands on one host. No implementation lives here.

A `Transport` runs shell commands on one host. Two implement it, beside this file:
`LocalTransport` (`eltctl.hosts.local`, `address = "local"`, a subprocess of `/bin/sh`)
and `SSHTransport` (`eltctl.hosts.ssh`, asyncssh). Callers get one from a `Fleet`
(`eltctl.hosts.fleet`) and use only what this module names, so the contract never
imports an implementation back.

Two ways to run a command:

- `run`: text in, text out, the whole output at the end (`RunResult`);
- `open_stream`: binary stdin and stdout as a `ByteStream`, for data that must flow
  while the command runs (the mirror relays a `tar` stream from one host to another
  through the control machine).
"""

from __future__ import annotations

import enum
import shlex
from dataclasses import dataclass
from typing import Iterable, Protocol, runtime_checkable

from eltctl.inventory import Host


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


class ByteStream(Protocol):
    """A running command with binary stdin and stdout (`Transport.open_stream`).

    Write to its stdin, then `close_stdin` (end of file); read its stdout in chunks
    until `read` returns b""; `wait` for its exit status and stderr. `kill` ends it
    at once (safe to call at any time, also after it ended). The transport's errors
    while writing or reading (a connection that went away) are raised as they come:
    the caller kills the stream and reports.
    """

    async def write(self, data: bytes) -> None:
        """Send `data` to the command's stdin, waiting while the pipe is full."""

    async def close_stdin(self) -> None:
        """Signal end of input."""

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes of stdout; b"" once it is exhausted."""

    async def wait(self) -> tuple[int, str]:
        """(exit status, stderr text) once the command ended; -1 when it left no status."""

    def kill(self) -> None:
        """End the command now."""


@runtime_checkable
class Transport(Protocol):
    """Runs commands on one host.

    `run` returns a RunResult for any exit status and raises `HostError` only when the
    command could not be run or did not finish (kind `timeout`) within `timeout`
    seconds (None: the transport's default). `open_stream` starts a command whose
    stdin and stdout are bytes, or raises `HostError` when it cannot be started.
    """

    host: Host

    async def run(self, command: str, *, timeout: float | None = None,
                  input: str | None = None) -> RunResult: ...

    async def open_stream(self, command: str) -> ByteStream: ...

    def local_address(self) -> str | None:
        """The address this machine uses on its connection to the host (None: no network)."""

    async def close(self) -> None: ...


# Every command eltctl runs on a host starts with this: what it creates there (the job's
# directories, daemon.json with the job's env, logs, checkpoints, mirror copies) is
# readable by the account alone, whatever the account's own umask.
PRIVATE = "umask 077; "


@dataclass(frozen=True)
class Wrapped:
    """A command for the host's login shell, and what must precede the caller's input on
    its stdin (the host's `env` values: `wrap_env`)."""

    command: str
    stdin_head: str = ""

    def input(self, input: str | None) -> str | None:
        """The whole stdin to send: the head, then the caller's input (None: nothing)."""
        if not self.stdin_head:
            return input
        return self.stdin_head + (input or "")


def wrap_env(command: str, env: Iterable[tuple[str, str]]) -> Wrapped:
    """The command with the host's extra environment and umask 077, for any login shell.

    The values travel on the command's stdin, one line each, ahead of the caller's own
    input; the command line names only the variables. A command line is world-readable
    (`ps`, /proc/<pid>/cmdline), and the inventory's `env` may hold a token. `/bin/sh`
    reads each line with its `read` builtin (which takes a pipe's bytes one at a time,
    so the caller's input stays whole) and decodes it with the `printf` builtin: no
    process is started with a value in its arguments. sshd's own environment passing
    (SetEnv/AcceptEnv) is not used: sshd accepts only LANG and LC_* by default.
    """
    command = PRIVATE + command
    pairs = list(env)
    if not pairs:
        return Wrapped(command)
    load = "".join(f'IFS= read -r {k} || {{ echo "eltctl: the value of {k} did not arrive on stdin" >&2; '
                   f"exit 125; }}; {k}=$(printf '%bx' \"${k}\"); export {k}=\"${{{k}%x}}\"; "
                   for k, _ in pairs)
    head = "".join(encode_env_value(v) for _, v in pairs)
    return Wrapped("/bin/sh -c " + shlex.quote(load + command), head)


def encode_env_value(value: str) -> str:
    """One stdin line that `printf '%b'` turns back into `value`: the only escapes are a
    backslash's and a newline's (octal), so no other `%b` escape can appear. The `x`
    the loader appends after decoding keeps trailing newlines, which `$(...)` strips."""
    return value.replace("\\", "\\0134").replace("\n", "\\012") + "\n"

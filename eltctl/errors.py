"""The project's one error hierarchy.

Library code raises these; only the CLI edge turns them into a message and an
exit code (see README, "Exit codes"). Anything else is a bug and shows a traceback.
"""

from __future__ import annotations


class EltctlError(Exception):
    """Base of every error eltctl reports to a user as a message."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class UsageError(EltctlError):
    """Bad command-line usage."""

    exit_code = 2


class ConfigError(EltctlError):
    """The inventory (hosts.toml) is missing, unreadable or invalid."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None,
                 line: int | None = None, hint: str | None = None) -> None:
        where = path or "<inventory>"
        if line is not None:
            where += f":{line}"
        if key:
            where += f": {key}"
        super().__init__(f"{where}: {message}", hint=hint)
        self.path = path
        self.key = key
        self.line = line


class HostError(EltctlError):
    """One host could not be used (unreachable, auth failed, bad host key...).

    Fan-out code never lets this escape for a single host: it becomes that host's
    outcome. It is raised only where one specific host was required.
    """

    exit_code = 3

    def __init__(self, host: str, message: str, *, kind: str = "error", hint: str | None = None) -> None:
        super().__init__(f"{host}: {message}", hint=hint)
        self.host = host
        self.kind = kind  # e.g. "unreachable", "auth", "host-key", "timeout", "command"

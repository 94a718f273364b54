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
        self.problems: tuple[ConfigError, ...] = (self,)  # every problem found, this one first

    @classmethod
    def several(cls, problems: list[ConfigError]) -> ConfigError:
        """One error that reports every problem a check found, each on its own line.

        Fixing a file one error per run is tedious; the parser checks everything in
        one pass and hands all its findings to the user at once.
        """
        if not problems:
            raise ValueError("no problems to report")
        if len(problems) == 1:
            return problems[0]
        first = problems[0]
        lines = [f"{first.path or '<inventory>'}: {len(problems)} problems"]
        for p in problems:
            lines.append(f"  {p.message}")
            if p.hint:
                lines.append(f"    hint: {p.hint}")
        err = cls.__new__(cls)
        EltctlError.__init__(err, "\n".join(lines))
        err.path, err.key, err.line = first.path, first.key, first.line
        err.problems = tuple(problems)
        return err


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

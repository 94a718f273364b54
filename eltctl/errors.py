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


class UnknownHostError(UsageError):
    """Host names that are not in the inventory. Every command that takes a host name
    says so the same way (this message, exit status 2), with the names closest to each
    one ("did you mean") and the inventory's hosts."""

    def __init__(self, unknown: list[str], known: list[str], inventory: str) -> None:
        import difflib

        quoted = ", ".join(repr(n) for n in unknown)
        message = f"no host {quoted} in {inventory}" if len(unknown) == 1 else f"no hosts {quoted} in {inventory}"
        close: list[str] = []
        for name in unknown:  # the closest names (ties all), if close at all
            scores = {k: difflib.SequenceMatcher(None, name.lower(), k.lower()).ratio() for k in known}
            best = max(scores.values(), default=0.0)
            close += [k for k, r in scores.items() if r >= 0.6 and r == best and k not in close]
        close.sort(key=known.index)
        hosts = f"hosts: {', '.join(known)}" if known else f"{inventory} has no hosts"
        hint = f"did you mean {' or '.join(close)}? ({hosts})" if close else hosts
        super().__init__(message, hint=hint)
        self.unknown = tuple(unknown)


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

"""Reading hosts.toml's tables: where each key is written, and typed getters that
report a problem (with the key's path, line and fix) instead of raising, so that
`parse.py` finds every problem of a file in one pass."""

from __future__ import annotations

import difflib
import json
import re
import shlex
from pathlib import Path
from typing import Any, Protocol, Sequence

from eltctl.durations import FORMS as DURATION_FORMS
from eltctl.durations import parse_duration
from eltctl_runtime.claims import ENV as CLAIMS_ENV  # a host's GPU claims directory: settable per host

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# "0" in the job's or a host's env: every worker starts as its own process, not forked from the daemon's
# fork server (eltctl_runtime.daemon.forkserver.ENV_SWITCH; tests/inventory checks they agree)
FORK_SERVER_ENV = "ELTCTL_FORK_SERVER"


class Reporter(Protocol):
    """What a `Table` reports to (parse.Checker): every problem of the file, in one list."""

    def report(self, key: str, message: str, *, label: str = "") -> None: ...
    def resolve(self, value: str) -> Path: ...


def toml_error(message: str, text: str) -> tuple[str, int | None]:
    """tomllib puts the position at the end of its message; move it into `path:line:`."""
    m = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
    if m:
        return f"{message[: m.start()]} (column {m.group(2)})", int(m.group(1))
    m = re.search(r"\s*\(at end of document\)$", message)
    if m:
        return f"{message[: m.start()]} (at the end of the file)", text.count("\n") + 1
    return message, None


class KeyLines:
    """Where each key path is written in the text: `"hosts[3].port"` -> 27.

    tomllib gives values but no positions. This scan knows enough TOML (headers,
    array-of-tables, dotted and quoted keys, multi-line strings) to place the keys of
    a file that already parsed; a key it cannot place falls back to the line of its
    table, and to no line at all. It is only ever used for messages.
    """

    _BARE = r"[A-Za-z0-9_-]+"
    _QUOTED = r'"(?:[^"\\]|\\.)*"|\'[^\']*\''
    _KEY = rf"(?:{_BARE}|{_QUOTED})"
    _DOTTED = rf"{_KEY}(?:\s*\.\s*{_KEY})*"
    _AOT = re.compile(rf"\s*\[\[\s*({_DOTTED})\s*\]\]")
    _TABLE = re.compile(rf"\s*\[\s*({_DOTTED})\s*\]")
    _KV = re.compile(rf"\s*({_DOTTED})\s*=")
    _ONE = re.compile(_KEY)

    def __init__(self, lines: dict[str, int]) -> None:
        self.lines = lines

    @classmethod
    def scan(cls, text: str) -> "KeyLines":
        lines: dict[str, int] = {}
        arrays: dict[tuple[str, ...], int] = {}  # array-of-tables path -> last index
        prefix: tuple[str, ...] = ()
        in_string: str | None = None  # the delimiter of an open multi-line string
        for number, line in enumerate(text.splitlines(), start=1):
            if in_string:
                if line.count(in_string) % 2 == 1:
                    in_string = None
                continue
            if m := cls._AOT.match(line):
                prefix = cls._split(m.group(1))
                arrays[prefix] = arrays.get(prefix, -1) + 1
                for sub in [a for a in arrays if len(a) > len(prefix) and a[: len(prefix)] == prefix]:
                    del arrays[sub]  # a new element starts its own nested arrays
                cls._record(lines, cls._render(prefix, arrays), number)
            elif m := cls._TABLE.match(line):
                prefix = cls._split(m.group(1))
                cls._record(lines, cls._render(prefix, arrays), number)
            elif m := cls._KV.match(line):
                cls._record(lines, cls._render(prefix + cls._split(m.group(1)), arrays), number)
            for delim in ('"""', "'''"):
                if line.count(delim) % 2 == 1:
                    in_string = delim
                    break
        return cls(lines)

    @classmethod
    def _split(cls, dotted: str) -> tuple[str, ...]:
        parts = []
        for m in cls._ONE.finditer(dotted):
            key = m.group(0)
            if key.startswith('"'):
                try:
                    key = json.loads(key)  # TOML basic strings escape as JSON does, mostly
                except ValueError:
                    key = key[1:-1]
            elif key.startswith("'"):
                key = key[1:-1]
            parts.append(key)
        return tuple(parts)

    @staticmethod
    def _render(keys: tuple[str, ...], arrays: dict[tuple[str, ...], int]) -> list[str]:
        """Every prefix of `keys` as a key path, array elements indexed: hosts[2].env."""
        out, text = [], ""
        for i, key in enumerate(keys):
            text = f"{text}.{key}" if text else key
            if keys[: i + 1] in arrays:
                text += f"[{arrays[keys[: i + 1]]}]"
            out.append(text)
        return out

    @staticmethod
    def _record(lines: dict[str, int], paths: list[str], number: int) -> None:
        for p in paths:
            lines.setdefault(p, number)

    def line_of(self, key: str) -> int | None:
        """The line of `key`, else of the nearest enclosing table that is written down."""
        while key:
            if key in self.lines:
                return self.lines[key]
            cut = max(key.rfind("."), key.rfind("["))
            key = key[:cut] if cut > 0 else ""
        return None


class Bad:
    """Marks a value that failed its check (already reported)."""


BAD = Bad()
ABSENT = object()


def kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return "a date/time"


def show(value: Any) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value)
    elif isinstance(value, dict):
        text = "{...}"
    else:
        text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def got(value: Any) -> str:
    return f"got {kind_of(value)} ({show(value)})"


class Table:
    """One TOML table being checked: typed getters that report, never raise."""

    def __init__(self, checker: Reporter, data: dict[str, Any], path: str, *,
                 label: str = "", accepted: Sequence[str], where: str) -> None:
        self.checker = checker
        self.data = data
        self.path = path
        self.label = label  # e.g. ' (host "gpu4")', added after every key path
        self.failed: set[str] = set()
        for key in data:
            if key not in accepted:
                self._unknown(key, accepted, where)

    def key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> Bad:
        self.failed.add(key)
        self.checker.report(self.key(key), message, label=self.label)
        return BAD

    def _unknown(self, key: str, accepted: Sequence[str], where: str) -> None:
        noun = "key" if self.path else "section"
        close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
        if close:
            self.fail(key, f"unknown {noun}; did you mean {close[0]}?")
        else:
            self.fail(key, f"unknown {noun}; {where} accepts: {', '.join(accepted)}")

    def raw(self, key: str, *, required: str | None = None) -> Any:
        """The value, or ABSENT; `required` is the example the message offers."""
        if key in self.data:
            return self.data[key]
        if required is not None:
            self.fail(key, f"missing; add {key} = {required}")
            return BAD
        return ABSENT

    def string(self, key: str, default: Any = None, *, required: str | None = None,
               pattern: re.Pattern[str] | None = None, pattern_says: str = "") -> Any:
        value = self.raw(key, required=required)
        if value is ABSENT:
            return default
        if value is BAD:
            return BAD
        if not isinstance(value, str):
            return self.fail(key, f"must be a string, {got(value)}; write {key} = \"...\"")
        if not value.strip():
            return self.fail(key, "must not be empty")
        if pattern is not None and not pattern.fullmatch(value):
            return self.fail(key, f"{show(value)} {pattern_says}")
        return value

    def integer(self, key: str, default: Any, *, lo: int | None = None, hi: int | None = None,
                meaning: str = "") -> Any:
        value = self.raw(key)
        if value is ABSENT:
            return default
        want = range_text(lo, hi)
        if isinstance(value, bool) or not isinstance(value, int):
            fix = ""
            if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
                fix = f"; remove the quotes: {key} = {value.strip()}"
            elif isinstance(value, float) and value.is_integer():
                fix = f"; write {key} = {int(value)}"
            return self.fail(key, f"must be an integer{want}{meaning}, {got(value)}{fix}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            return self.fail(key, f"must be{want}{meaning}, got {value}")
        return value

    def boolean(self, key: str, default: bool) -> Any:
        value = self.raw(key)
        if value is ABSENT:
            return default
        if not isinstance(value, bool):
            fix = ""
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                fix = f"; remove the quotes: {key} = {value.strip().lower()}"
            return self.fail(key, f"must be true or false, {got(value)}{fix}")
        return value

    def duration(self, key: str, default: float, *, positive: bool) -> Any:
        value = self.raw(key)
        if value is ABSENT:
            return default
        if isinstance(value, (dict, list)) or isinstance(value, bool):
            return self.fail(key, f"must be a duration like {DURATION_FORMS}, {got(value)}")
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            return self.fail(key, str(exc))
        if positive and seconds <= 0:
            return self.fail(key, f"must be longer than 0 s, got {show(value)}")
        return seconds

    def path_value(self, key: str, default: Any = None) -> Any:
        value = self.string(key)
        if value is None or value is BAD:
            return default if value is None else BAD
        return self.checker.resolve(value)

    def choice(self, key: str, default: Any, options: Sequence[str],
               aliases: dict[str, str] | None = None) -> Any:
        value = self.raw(key)
        if value is ABSENT:
            return default
        listed = ", ".join(json.dumps(o) for o in options)
        if not isinstance(value, str) or value not in options:
            hint = ""
            if isinstance(value, str):
                close = difflib.get_close_matches(value.lower(), options, n=1, cutoff=0.5)
                if value.lower() in options:
                    close = [value.lower()]
                elif aliases and value.lower() in aliases:
                    close = [aliases[value.lower()]]
                if close:
                    hint = f"; did you mean {json.dumps(close[0])}?"
            return self.fail(key, f"must be one of {listed}, {got(value)}{hint}")
        return value

    def names(self, key: str, default: Any, options: Sequence[str], *, noun: str) -> Any:
        """A list of names from `options` (`[notify] events`, `owner_signals`), in its
        order without repeats; [] is none. `noun` says what one name is ("event kind")."""
        value = self.raw(key)
        if value is ABSENT:
            return default
        listed = ", ".join(json.dumps(o) for o in options)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            fix = f"; write {key} = [{show(value)}]" if isinstance(value, str) else ""
            return self.fail(key, f"must be a list of {noun}s ({listed}; [] for none), {got(value)}{fix}")
        bad = [v for v in value if v not in options]
        if bad:
            return self.fail(key, f"names unknown {noun}(s) {', '.join(show(b) for b in bad)}; choose from {listed}")
        return tuple(dict.fromkeys(value))

    def patterns(self, key: str) -> Any:
        """A list of gitignore patterns (`[job] exclude`, `include`: eltctl/hosts/ignore.py)."""
        from eltctl.hosts.ignore import check_pattern

        value = self.raw(key)
        if value is ABSENT:
            return ()
        if isinstance(value, str):
            return self.fail(key, f"must be a list of patterns, {got(value)}; write {key} = [{show(value)}]")
        if not isinstance(value, list):
            return self.fail(key, f"must be a list of patterns, {got(value)}; write {key} = [\"data/\", \"*.bin\"]")
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, str):
                self.fail(f"{key}[{i}]", f"must be a string (a pattern such as \"data/\"), {got(item)}")
                continue
            problem = check_pattern(item)
            if problem is not None:
                self.fail(f"{key}[{i}]", problem)
                continue
            out.append(item)
        return BAD if len(out) < len(value) else tuple(out)

    def env(self, key: str) -> Any:
        value = self.raw(key)
        if value is ABSENT:
            return ()
        if not isinstance(value, dict):
            return self.fail(key, f"must be a table of strings, {got(value)}; "
                                  f"write {key} = {{ NAME = \"value\" }}")
        pairs = []
        for name, item in value.items():
            sub = f"{key}.{name}"
            if not _ENV_NAME.fullmatch(name):
                self.fail(sub, "is not a valid environment variable name (letters, digits, _; "
                               "not starting with a digit)")
            elif ((name.startswith("ELTCTL_") or name == "CUDA_VISIBLE_DEVICES")
                  and not (name == CLAIMS_ENV and self.path.startswith("hosts"))  # a host's own: its GPU claims
                  and name != FORK_SERVER_ENV):
                # eltctl sets these per worker; an override would break GPU assignment
                # or the worker's link to its job.
                self.fail(sub, "is set by eltctl for each worker and cannot be overridden"
                               + ("; choose GPUs with gpus = [...] in [[hosts]]"
                                  if name == "CUDA_VISIBLE_DEVICES" else ""))
            elif not isinstance(item, str):
                self.fail(sub, f"must be a string, {got(item)}; environment values are "
                               f"text: write {name} = \"{show(item).strip(chr(34))}\"")
            else:
                pairs.append((name, item))
        return tuple(pairs)

    def command(self, key: str, example: str, *, required: bool = False) -> Any:
        """A command line, run without a shell: a string (split as a shell would) or a
        non-empty list of strings (`[job] command`, `[notify] command`); None when absent
        and not `required`. `example` is the fix the messages offer (`write key = ...`)."""
        value = self.raw(key, required=example if required else None)
        if value is ABSENT:
            return None
        if value is BAD:
            return BAD
        if isinstance(value, str):
            try:
                argv = shlex.split(value)
            except ValueError as exc:
                return self.fail(key, f"cannot be split into arguments ({exc}); "
                                      "check its quotes, or write it as a list")
            return tuple(argv) if argv else self.fail(key, f"must not be empty; write {key} = {example}")
        if isinstance(value, list) and value:
            bad = [i for i, a in enumerate(value) if not isinstance(a, str)]
            for i in bad:
                self.fail(f"{key}[{i}]", f"must be a string, {got(value[i])}; quote it")
            return BAD if bad else tuple(value)
        wanted = "a non-empty list" if isinstance(value, list) else "a list"
        return self.fail(key, f"must be a string or {wanted} of strings, {got(value)}; write {key} = {example}")


def raw_host_name(item: dict[str, Any]) -> str | None:
    """The name a [[hosts]] entry asks for: its `name`, else its address."""
    for key in ("name", "address"):
        value = item.get(key)
        if isinstance(value, str) and value:
            return value
        if key in item:
            return None
    return None


def range_text(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" from {lo} to {hi}"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""

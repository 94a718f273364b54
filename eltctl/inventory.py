"""The inventory: hosts.toml parsed once into typed, frozen values.

Everything else in eltctl takes an `Inventory` (or a part of it) as an argument;
nothing deeper reads the file or the environment.

`load_inventory(path)` reads the file; `parse_inventory(text, path)` checks every
key in one pass and raises one `ConfigError` that lists every problem found, each
named by its TOML key path (`hosts[3].port (host "gpu4")`), with the line where the
key (or its table) is written and what to write instead. The documented example of
every key is hosts.example.toml (the starter that `eltctl init` writes).
"""

from __future__ import annotations

import difflib
import enum
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from eltctl.durations import FORMS as DURATION_FORMS
from eltctl.durations import parse_duration
from eltctl.errors import ConfigError

LOCAL = "local"  # `address = "local"`: run on this machine, no SSH


class DeviceKind(str, enum.Enum):
    AUTO = "auto"  # CUDA where the host has free GPUs, CPU workers (slots) elsewhere
    CUDA = "cuda"
    CPU = "cpu"  # one CPU worker per free GPU slot (how GPU hosts are simulated in tests)


@dataclass(frozen=True)
class JobSpec:
    name: str
    command: tuple[str, ...]  # argv run by each worker (a string is split with shlex)
    workdir: Path  # the job's code directory on the control machine
    min_workers: int = 1
    max_workers: int | None = None  # None: as many as are free
    device: DeviceKind = DeviceKind.AUTO
    env: tuple[tuple[str, str], ...] = ()  # extra environment for every worker
    shared_filesystem: bool = False  # workdir is the same path on every host: no code sync


@dataclass(frozen=True)
class SSHSettings:
    user: str | None = None  # default user for hosts (None: ~/.ssh/config or local user)
    port: int = 22
    identity_file: Path | None = None
    known_hosts: Path | None = None  # None: ~/.ssh/known_hosts (asyncssh's default)
    connect_timeout: float = 10.0  # seconds
    command_timeout: float = 30.0  # seconds, per remote command unless a caller says otherwise
    max_parallel: int = 64  # connections opened at once


@dataclass(frozen=True)
class Policy:
    idle_for: float = 600.0  # seconds a GPU must look free before it is used
    memory_threshold_mib: int = 500  # a GPU using more memory than this (not ours) is busy
    utilization_threshold: int = 10  # percent; a GPU busier than this (not ours) is busy
    cooldown: float = 300.0  # seconds before a host that was left is used again
    probe_interval: float = 30.0  # seconds between probes of a host by the controller
    nvidia_smi_timeout: float = 10.0  # seconds; a slower nvidia-smi makes the host unhealthy
    watch_interval: float = 1.0  # seconds between a host daemon's looks at its GPUs
    bench_after: int = 3  # failures of a host's daemon or workers in a row before it is benched
    hang_timeout: float = 10.0  # seconds of silence after which a worker counts as hung


@dataclass(frozen=True)
class ControllerSettings:
    address: str | None = None  # the address workers reach the store at (None: worked out)


@dataclass(frozen=True)
class Storage:
    mirror: str | None = None  # a shared directory or ssh://[user@]host[:port]/path
    keep: int = 3  # mirrored checkpoints kept


@dataclass(frozen=True)
class Host:
    name: str
    address: str  # hostname, IP, or "local"
    port: int = 22
    user: str | None = None
    python: str = "python3"  # interpreter with torch on that host
    gpus: tuple[int, ...] | None = None  # None: all GPUs the host has
    slots: int = 1  # CPU workers on a host without GPUs
    env: tuple[tuple[str, str], ...] = ()  # extra environment for commands on this host

    @property
    def is_local(self) -> bool:
        return self.address == LOCAL


@dataclass(frozen=True)
class Inventory:
    path: Path  # the file it was read from
    job: JobSpec
    ssh: SSHSettings
    policy: Policy
    storage: Storage
    hosts: tuple[Host, ...] = field(default_factory=tuple)
    controller: ControllerSettings = field(default_factory=ControllerSettings)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)


# --------------------------------------------------------------------------- parsing

NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")  # host and job names end up in file names
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SSH_URL = re.compile(r"ssh://(?:[^@/\s]+@)?[^:/\s]+(?::\d+)?/\S*")

# The accepted keys, per table, in the order hosts.example.toml documents them.
TOP_KEYS = ("job", "ssh", "policy", "storage", "controller", "hosts")
JOB_KEYS = ("name", "command", "workdir", "min_workers", "max_workers", "device", "env",
            "shared_filesystem")
SSH_KEYS = ("user", "port", "identity_file", "known_hosts", "connect_timeout",
            "command_timeout", "max_parallel")
POLICY_KEYS = ("idle_for", "memory_threshold_mib", "utilization_threshold", "cooldown",
               "probe_interval", "nvidia_smi_timeout", "watch_interval", "bench_after", "hang_timeout")
STORAGE_KEYS = ("mirror", "keep")
CONTROLLER_KEYS = ("address",)
HOST_KEYS = ("name", "address", "port", "user", "python", "gpus", "slots", "env")

DEFAULT_INVENTORY_NAME = "hosts.toml"


def load_inventory(path: Path | str, *, origin: str | None = None) -> Inventory:
    """Read and parse the inventory at `path`; every problem is a `ConfigError` (exit 2).

    `origin` says where the path came from (e.g. "$ELTCTL_INVENTORY") for the
    message when the file is missing.
    """
    path = Path(path)
    shown = str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        named = f" (named by {origin})" if origin else ""
        init = "eltctl init" if shown == DEFAULT_INVENTORY_NAME else f"eltctl init {shlex.quote(shown)}"
        raise ConfigError(
            f"no such inventory file{named}",
            path=shown,
            hint=f"write a commented starter with `{init}` and edit it, or choose another "
                 "file with `eltctl -i PATH ...` or ELTCTL_INVENTORY=PATH",
        ) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not an inventory file", path=shown,
                          hint=f"name the file itself, e.g. -i {shlex.quote(str(path / DEFAULT_INVENTORY_NAME))}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the inventory: {exc.strerror or exc}", path=shown) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError("not UTF-8 text (TOML files must be UTF-8)", path=shown, line=line) from None
    return parse_inventory(text, path)


def parse_inventory(text: str, path: Path | str) -> Inventory:
    """Parse inventory `text` read from `path` (used for messages and relative paths)."""
    path = Path(path)
    shown = str(path)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message, line = _toml_error(str(exc), text)
        raise ConfigError(f"invalid TOML: {message}", path=shown, line=line) from None
    checker = _Checker(shown, KeyLines.scan(text), Path(os.path.abspath(path)).parent)
    inventory = checker.inventory(raw)
    if checker.problems:
        # In file order, as an editor shows them; problems without a line come last.
        ordered = sorted(checker.problems, key=lambda p: p.line if p.line is not None else 1 << 30)
        raise ConfigError.several(ordered)
    assert inventory is not None
    return inventory


def _toml_error(message: str, text: str) -> tuple[str, int | None]:
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


class _Bad:
    """Marks a value that failed its check (already reported)."""


_BAD = _Bad()
_ABSENT = object()


def _kind(value: Any) -> str:
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


def _show(value: Any) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value)
    elif isinstance(value, dict):
        text = "{...}"
    else:
        text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _got(value: Any) -> str:
    return f"got {_kind(value)} ({_show(value)})"


class _Table:
    """One TOML table being checked: typed getters that report, never raise."""

    def __init__(self, checker: "_Checker", data: dict[str, Any], path: str, *,
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

    def fail(self, key: str, message: str) -> _Bad:
        self.failed.add(key)
        self.checker.report(self.key(key), message, label=self.label)
        return _BAD

    def _unknown(self, key: str, accepted: Sequence[str], where: str) -> None:
        noun = "key" if self.path else "section"
        close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
        if close:
            self.fail(key, f"unknown {noun}; did you mean {close[0]}?")
        else:
            self.fail(key, f"unknown {noun}; {where} accepts: {', '.join(accepted)}")

    def raw(self, key: str, *, required: str | None = None) -> Any:
        """The value, or _ABSENT; `required` is the example the message offers."""
        if key in self.data:
            return self.data[key]
        if required is not None:
            self.fail(key, f"missing; add {key} = {required}")
            return _BAD
        return _ABSENT

    def string(self, key: str, default: Any = None, *, required: str | None = None,
               pattern: re.Pattern[str] | None = None, pattern_says: str = "") -> Any:
        value = self.raw(key, required=required)
        if value is _ABSENT:
            return default
        if value is _BAD:
            return _BAD
        if not isinstance(value, str):
            return self.fail(key, f"must be a string, {_got(value)}; write {key} = \"...\"")
        if not value.strip():
            return self.fail(key, "must not be empty")
        if pattern is not None and not pattern.fullmatch(value):
            return self.fail(key, f"{_show(value)} {pattern_says}")
        return value

    def integer(self, key: str, default: Any, *, lo: int | None = None, hi: int | None = None,
                meaning: str = "") -> Any:
        value = self.raw(key)
        if value is _ABSENT:
            return default
        want = _range_text(lo, hi)
        if isinstance(value, bool) or not isinstance(value, int):
            fix = ""
            if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
                fix = f"; remove the quotes: {key} = {value.strip()}"
            elif isinstance(value, float) and value.is_integer():
                fix = f"; write {key} = {int(value)}"
            return self.fail(key, f"must be an integer{want}{meaning}, {_got(value)}{fix}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            return self.fail(key, f"must be{want}{meaning}, got {value}")
        return value

    def boolean(self, key: str, default: bool) -> Any:
        value = self.raw(key)
        if value is _ABSENT:
            return default
        if not isinstance(value, bool):
            fix = ""
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                fix = f"; remove the quotes: {key} = {value.strip().lower()}"
            return self.fail(key, f"must be true or false, {_got(value)}{fix}")
        return value

    def duration(self, key: str, default: float, *, positive: bool) -> Any:
        value = self.raw(key)
        if value is _ABSENT:
            return default
        if isinstance(value, (dict, list)) or isinstance(value, bool):
            return self.fail(key, f"must be a duration like {DURATION_FORMS}, {_got(value)}")
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            return self.fail(key, str(exc))
        if positive and seconds <= 0:
            return self.fail(key, f"must be longer than 0 s, got {_show(value)}")
        return seconds

    def path_value(self, key: str, default: Any = None) -> Any:
        value = self.string(key)
        if value is None or value is _BAD:
            return default if value is None else _BAD
        return self.checker.resolve(value)

    def choice(self, key: str, default: Any, options: Sequence[str],
               aliases: dict[str, str] | None = None) -> Any:
        value = self.raw(key)
        if value is _ABSENT:
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
            return self.fail(key, f"must be one of {listed}, {_got(value)}{hint}")
        return value

    def env(self, key: str) -> Any:
        value = self.raw(key)
        if value is _ABSENT:
            return ()
        if not isinstance(value, dict):
            return self.fail(key, f"must be a table of strings, {_got(value)}; "
                                  f"write {key} = {{ NAME = \"value\" }}")
        pairs = []
        for name, item in value.items():
            sub = f"{key}.{name}"
            if not _ENV_NAME.fullmatch(name):
                self.fail(sub, "is not a valid environment variable name (letters, digits, _; "
                               "not starting with a digit)")
            elif name.startswith("ELTCTL_") or name == "CUDA_VISIBLE_DEVICES":
                # eltctl sets these per worker; an override would break GPU assignment
                # or the worker's link to its job.
                self.fail(sub, "is set by eltctl for each worker and cannot be overridden"
                               + ("; choose GPUs with gpus = [...] in [[hosts]]"
                                  if name == "CUDA_VISIBLE_DEVICES" else ""))
            elif not isinstance(item, str):
                self.fail(sub, f"must be a string, {_got(item)}; environment values are "
                               f"text: write {name} = \"{_show(item).strip(chr(34))}\"")
            else:
                pairs.append((name, item))
        return tuple(pairs)


def _raw_host_name(item: dict[str, Any]) -> str | None:
    """The name a [[hosts]] entry asks for: its `name`, else its address."""
    for key in ("name", "address"):
        value = item.get(key)
        if isinstance(value, str) and value:
            return value
        if key in item:
            return None
    return None


def _range_text(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" from {lo} to {hi}"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


class _Checker:
    """One pass over the parsed TOML: build the value types, collect every problem."""

    def __init__(self, shown: str, lines: KeyLines, base: Path) -> None:
        self.shown = shown
        self.lines = lines
        self.base = base  # relative paths in the file are relative to the file
        self.problems: list[ConfigError] = []

    def report(self, key: str, message: str, *, label: str = "") -> None:
        self.problems.append(ConfigError(message, path=self.shown, key=key + label,
                                         line=self.lines.line_of(key)))

    def resolve(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.base / p

    def table(self, raw: dict[str, Any], key: str, accepted: Sequence[str]) -> _Table | None:
        """The [key] section to check (empty when absent), or None when it is not a table."""
        value = raw.get(key, {})
        if not isinstance(value, dict):
            self.report(key, f"must be a table, {_got(value)}; write it as a [{key}] section")
            return None
        return _Table(self, value, key, accepted=accepted, where=f"[{key}]")

    def inventory(self, raw: dict[str, Any]) -> Inventory | None:
        _Table(self, raw, "", accepted=TOP_KEYS, where="an inventory")
        job: JobSpec | None = None
        if "job" not in raw:  # one problem, not one per missing key
            self.report("job", 'missing the [job] section; add [job] with name = "..." and '
                               'command = "..."')
        elif (t := self.table(raw, "job", JOB_KEYS)) is not None:
            job = self.job(t)
        # A section of the wrong type was reported; its defaults keep the checks going.
        ssh = self.ssh(self.table(raw, "ssh", SSH_KEYS) or self.empty("ssh"))
        policy = self.policy(self.table(raw, "policy", POLICY_KEYS) or self.empty("policy"))
        storage = self.storage(self.table(raw, "storage", STORAGE_KEYS) or self.empty("storage"))
        controller = self.controller(self.table(raw, "controller", CONTROLLER_KEYS)
                                     or self.empty("controller"))
        hosts = self.hosts(raw.get("hosts", _ABSENT), ssh)
        if self.problems or job is None:
            return None
        return Inventory(path=Path(os.path.abspath(self.shown)), job=job, ssh=ssh,
                         policy=policy, storage=storage, hosts=hosts, controller=controller)

    def empty(self, key: str) -> _Table:
        return _Table(self, {}, key, accepted=(), where=f"[{key}]")

    def job(self, t: _Table) -> JobSpec | None:
        name = t.string("name", required='"my-job"', pattern=NAME_PATTERN,
                        pattern_says="is not a valid job name: use letters, digits, '.', '_' "
                                     "and '-' only (it names files and directories)")
        command = self.command(t)
        workdir = t.path_value("workdir", self.base)
        min_workers = t.integer("min_workers", 1, lo=1)
        max_workers = t.integer("max_workers", None, lo=1, meaning=" (or leave it out: as many as are free)")
        if (isinstance(min_workers, int) and isinstance(max_workers, int)
                and max_workers < min_workers):
            t.fail("max_workers", f"must be >= job.min_workers ({min_workers}), got "
                                  f"{max_workers}; raise it or lower min_workers")
        device = t.choice("device", DeviceKind.AUTO.value, [d.value for d in DeviceKind],
                          aliases={"gpu": "cuda", "gpus": "cuda", "nvidia": "cuda"})
        env = t.env("env")
        shared = t.boolean("shared_filesystem", False)
        if self.problems:
            return None
        return JobSpec(name=name, command=command, workdir=workdir, min_workers=min_workers,
                       max_workers=max_workers, device=DeviceKind(device), env=env,
                       shared_filesystem=shared)

    def command(self, t: _Table) -> Any:
        value = t.raw("command", required='["python", "train.py"]')
        if value is _BAD:
            return _BAD
        if isinstance(value, str):
            try:
                argv = shlex.split(value)
            except ValueError as exc:
                return t.fail("command", f"cannot be split into arguments ({exc}); "
                                         "check its quotes, or write it as a list")
            if not argv:
                return t.fail("command", 'must not be empty; write command = ["python", "train.py"]')
            return tuple(argv)
        if isinstance(value, list):
            if not value:
                return t.fail("command", 'must not be empty; write command = ["python", "train.py"]')
            bad = [i for i, a in enumerate(value) if not isinstance(a, str)]
            for i in bad:
                t.fail(f"command[{i}]", f"must be a string, {_got(value[i])}; quote it")
            return _BAD if bad else tuple(value)
        return t.fail("command", f'must be a string or a list of strings, {_got(value)}; '
                                 'write command = ["python", "train.py"]')

    def ssh(self, t: _Table) -> SSHSettings:
        d = SSHSettings()
        values = dict(
            user=t.string("user", d.user),
            port=t.integer("port", d.port, lo=1, hi=65535),
            identity_file=t.path_value("identity_file"),
            known_hosts=t.path_value("known_hosts"),
            connect_timeout=t.duration("connect_timeout", d.connect_timeout, positive=True),
            command_timeout=t.duration("command_timeout", d.command_timeout, positive=True),
            max_parallel=t.integer("max_parallel", d.max_parallel, lo=1),
        )
        return SSHSettings(**{k: (getattr(d, k) if v is _BAD else v) for k, v in values.items()})

    def policy(self, t: _Table) -> Policy:
        d = Policy()
        values = dict(
            idle_for=t.duration("idle_for", d.idle_for, positive=False),
            memory_threshold_mib=t.integer("memory_threshold_mib", d.memory_threshold_mib, lo=0,
                                           meaning=" (MiB)"),
            utilization_threshold=t.integer("utilization_threshold", d.utilization_threshold,
                                            lo=0, hi=100, meaning=" (percent)"),
            cooldown=t.duration("cooldown", d.cooldown, positive=False),
            probe_interval=t.duration("probe_interval", d.probe_interval, positive=True),
            nvidia_smi_timeout=t.duration("nvidia_smi_timeout", d.nvidia_smi_timeout, positive=True),
            watch_interval=t.duration("watch_interval", d.watch_interval, positive=True),
            bench_after=t.integer("bench_after", d.bench_after, lo=1,
                                  meaning=" (failures in a row before a host is benched)"),
            hang_timeout=t.duration("hang_timeout", d.hang_timeout, positive=True),
        )
        if isinstance(values["hang_timeout"], float) and values["hang_timeout"] > 30:
            # The runtime caps it (runtime/config.py MAX_HANG_TIMEOUT_S): a longer
            # silence would stall every survivor of a crash for that long.
            values["hang_timeout"] = t.fail("hang_timeout", f"must be at most 30s, got "
                                                            f"{_show(t.data['hang_timeout'])}")
        return Policy(**{k: (getattr(d, k) if v is _BAD else v) for k, v in values.items()})

    def controller(self, t: _Table) -> ControllerSettings:
        address = t.string("address")
        if isinstance(address, str) and any(c.isspace() for c in address):
            address = t.fail("address", f"{_show(address)} contains whitespace; write one IP "
                                        "address of this machine that every host can reach")
        return ControllerSettings(address=None if address is _BAD else address)

    def storage(self, t: _Table) -> Storage:
        d = Storage()
        mirror = t.string("mirror")
        if isinstance(mirror, str):
            if mirror.startswith("ssh://"):
                if not _SSH_URL.fullmatch(mirror):
                    mirror = t.fail("mirror", f"{_show(mirror)} is not an ssh:// address; write "
                                              "ssh://[user@]host[:port]/path")
            elif "://" in mirror:
                mirror = t.fail("mirror", f"{_show(mirror)}: only a directory or "
                                          "ssh://[user@]host[:port]/path is supported")
            else:
                mirror = str(self.resolve(mirror))
        keep = t.integer("keep", d.keep, lo=1)
        return Storage(mirror=None if mirror is _BAD else mirror,
                       keep=d.keep if keep is _BAD else keep)

    def hosts(self, value: Any, ssh: SSHSettings) -> tuple[Host, ...]:
        if value is _ABSENT or value == []:
            self.report("hosts", "no hosts; add at least one [[hosts]] section with name and address")
            return ()
        if isinstance(value, dict):
            self.report("hosts", "must be an array of tables: write [[hosts]] (two brackets) "
                                 "before each host")
            return ()
        if not isinstance(value, list) or not value:
            self.report("hosts", f"must be one [[hosts]] section per host, {_got(value)}")
            return ()
        hosts: list[Host] = []
        first_seen: dict[str, tuple[str, int | None]] = {}  # host name -> (key path, line) of its first entry
        for i, item in enumerate(value):
            key = f"hosts[{i}]"
            if not isinstance(item, dict):
                self.report(key, f"must be a table (a [[hosts]] section), {_got(item)}")
                continue
            host = self.host(item, key, ssh)
            # Duplicates are checked on the raw name, so a host with another problem
            # still counts: both mistakes are reported in one run.
            name = _raw_host_name(item)
            if name is not None and name in first_seen:
                where, line = first_seen[name]
                at = f", line {line}" if line else ""
                named = "name" in item
                self.report(f"{key}.name" if named else key,
                            f"duplicate host name {json.dumps(name)} (also {where}{at}); give each "
                            f"host a unique name" + ("" if named else " with name = \"...\""),
                            label=f' (host "{name}")')
                continue
            if name is not None:
                source = "name" if "name" in item else "address"
                first_seen[name] = (key, self.lines.line_of(f"{key}.{source}"))
            if host is not None:
                hosts.append(host)
        return tuple(hosts)

    def host(self, item: dict[str, Any], key: str, ssh: SSHSettings) -> Host | None:
        explicit = item.get("name")
        address = item.get("address")
        label_name = explicit if isinstance(explicit, str) and explicit else (
            address if isinstance(address, str) and address else None)
        label = f' (host "{label_name}")' if label_name else ""
        before = len(self.problems)
        t = _Table(self, item, key, label=label, accepted=HOST_KEYS, where="[[hosts]]")
        address = t.string("address", required='"hostname or IP" (or "local" for this machine)')
        if isinstance(address, str) and any(c.isspace() for c in address):
            address = t.fail("address", f"{_show(address)} contains whitespace; write one hostname or IP")
        name_rule = ("is not usable as a host name: use letters, digits, '.', '_' and '-' "
                     "only (it names files)")
        name = t.string("name", None, pattern=NAME_PATTERN, pattern_says=name_rule)
        if name is None and isinstance(address, str):
            name = address  # a host without a name is called by its address
            if not NAME_PATTERN.fullmatch(name):
                t.fail("name", f"missing, and the address {_show(address)} is not usable as a "
                               "host name; add name = \"...\" (letters, digits, '.', '_', '-')")
        port = t.integer("port", ssh.port, lo=1, hi=65535)
        user = t.string("user", ssh.user)
        python = t.string("python", "python3")
        gpus = self.gpus(t)
        slots = t.integer("slots", 1, lo=1, meaning=" (CPU workers on this host)")
        env = t.env("env")
        if len(self.problems) > before:
            return None
        return Host(name=name, address=address, port=port, user=user, python=python,
                    gpus=gpus, slots=slots, env=env)

    def gpus(self, t: _Table) -> Any:
        value = t.raw("gpus")
        if value is _ABSENT or value == "all":
            return None
        fix = 'write gpus = "all" or a list of indices such as gpus = [0, 1]'
        if isinstance(value, str):
            return t.fail("gpus", f'must be "all" or a list of GPU indices, got {_show(value)}; {fix}')
        if not isinstance(value, list):
            return t.fail("gpus", f"must be \"all\" or a list of GPU indices, {_got(value)}; {fix}")
        if not value:
            return t.fail("gpus", f"must list at least one GPU index; {fix}")
        ok = True
        for i, g in enumerate(value):
            if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                t.fail(f"gpus[{i}]", f"must be a GPU index (an integer >= 0), got {_show(g)}")
                ok = False
        if ok and len(set(value)) != len(value):
            dup = sorted({g for g in value if value.count(g) > 1})
            return t.fail("gpus", f"lists GPU {', '.join(map(str, dup))} more than once")
        return tuple(value) if ok else _BAD

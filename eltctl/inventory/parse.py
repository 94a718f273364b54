"""Parsing and checking hosts.toml into an `Inventory` (see the package docstring)."""


from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from eltctl.errors import ConfigError
from eltctl.inventory import courtesy
from eltctl.inventory import hours as schedules
from eltctl.inventory.notify import NOTIFY_KEYS, notify_settings
from eltctl.inventory.owner import OWNER_KEYS, owner_policy, owner_values
from eltctl.inventory.tables import ABSENT, BAD, KeyLines, Table, got, raw_host_name, show, toml_error
from eltctl.inventory.types import (
    ControllerSettings,
    DeviceKind,
    Host,
    Inventory,
    JobMode,
    JobSpec,
    Policy,
    SSHSettings,
    Storage,
    StragglerPolicy,
)
from eltctl_runtime.restart.progress import PatternError, compile_progress
from eltctl_runtime.protocol import NAME_RULE

INTERFACE_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@-]{0,14}")  # Linux: at most 15 characters
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")  # = protocol.valid_name: names end up in file names
_SSH_URL = re.compile(r"ssh://(?:[^@/\s]+@)?[^:/\s]+(?::\d+)?/\S*")

# The accepted keys, per table, in the order hosts.example.toml documents them.
TOP_KEYS = ("job", "ssh", "policy", "storage", "controller", "notify", "hosts")
JOB_KEYS = ("name", "command", "workdir", "min_workers", "max_workers", "device", "env",
            "shared_filesystem", "mode", "stop_grace", "progress", "max_restarts", "restart_window",
            "priority", "exclude", "include")
SSH_KEYS = ("user", "port", "identity_file", "known_hosts", "connect_timeout",
            "command_timeout", "max_parallel")
POLICY_KEYS = ("idle_for", "cpu_idle_for", "memory_threshold_mib", "utilization_threshold", "cooldown",
               "probe_interval", "nvidia_smi_timeout", "watch_interval", "bench_after", "hang_timeout",
               "drop_stragglers", "straggler_gain_percent", "straggler_for", "usage_half_life", "fairshare_slack", "fairshare_hold",
               *schedules.SCHEDULE_KEYS,
               *OWNER_KEYS)
STORAGE_KEYS = ("mirror", "keep", "trust_unsigned")
CONTROLLER_KEYS = ("address", "store", "metrics_file")
STORE_MODES = ("ssh", "direct")
HOST_KEYS = ("name", "address", "port", "user", "python", "gpus", "slots", "max_micro_batch", "data_interface", "env",
             *schedules.HOST_SCHEDULE_KEYS, *OWNER_KEYS)
POLICY_KEYS += courtesy.KEYS
HOST_KEYS += courtesy.KEYS

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
        message, line = toml_error(str(exc), text)
        raise ConfigError(f"invalid TOML: {message}", path=shown, line=line) from None
    checker = Checker(shown, KeyLines.scan(text), Path(os.path.abspath(path)).parent)
    inventory = checker.inventory(raw)
    if checker.problems:
        # In file order, as an editor shows them; problems without a line come last.
        ordered = sorted(checker.problems, key=lambda p: p.line if p.line is not None else 1 << 30)
        raise ConfigError.several(ordered)
    assert inventory is not None
    return inventory


class Checker:
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

    def table(self, raw: dict[str, Any], key: str, accepted: Sequence[str]) -> Table | None:
        """The [key] section to check (empty when absent), or None when it is not a table."""
        value = raw.get(key, {})
        if not isinstance(value, dict):
            self.report(key, f"must be a table, {got(value)}; write it as a [{key}] section")
            return None
        return Table(self, value, key, accepted=accepted, where=f"[{key}]")

    def inventory(self, raw: dict[str, Any]) -> Inventory | None:
        Table(self, raw, "", accepted=TOP_KEYS, where="an inventory")
        job: JobSpec | None = None
        if "job" not in raw:  # one problem, not one per missing key
            self.report("job", 'missing the [job] section; add [job] with name = "..." and '
                               'command = "..."')
        elif (t := self.table(raw, "job", JOB_KEYS)) is not None:
            job = self.job(t)
        # A section of the wrong type was reported; its defaults keep the checks going.
        ssh = self.ssh(self.table(raw, "ssh", SSH_KEYS) or self.empty("ssh"))
        policy_table = self.table(raw, "policy", POLICY_KEYS) or self.empty("policy")
        policy = self.policy(policy_table)
        stragglers = self.stragglers(policy_table)
        policy_courtesy = courtesy.parse_policy(policy_table)
        schedule = schedules.policy_schedule(policy_table)
        owner = owner_policy(policy_table)
        storage = self.storage(self.table(raw, "storage", STORAGE_KEYS) or self.empty("storage"))
        controller = self.controller(self.table(raw, "controller", CONTROLLER_KEYS)
                                     or self.empty("controller"))
        notify = notify_settings(self.table(raw, "notify", NOTIFY_KEYS) or self.empty("notify"))
        hosts = self.hosts(raw.get("hosts", ABSENT), ssh)
        if self.problems or job is None:
            return None
        return Inventory(path=Path(os.path.abspath(self.shown)), job=job, ssh=ssh,
                         policy=policy, storage=storage, hosts=hosts, controller=controller,
                         stragglers=stragglers, courtesy=policy_courtesy, schedule=schedule, owner=owner,
                         notify=notify)

    def empty(self, key: str) -> Table:
        return Table(self, {}, key, accepted=(), where=f"[{key}]")

    def job(self, t: Table) -> JobSpec | None:
        name = t.string("name", required='"my-job"', pattern=NAME_PATTERN,
                        pattern_says=f"is not a valid job name: use {NAME_RULE} (it names files and "
                                     "directories)")
        command = t.command("command", '["python", "train.py"]', required=True)
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
        mode = t.choice("mode", JobMode.ELASTIC.value, [m.value for m in JobMode],
                        aliases={"torchrun": "restart"})
        stop_grace = t.duration("stop_grace", JobSpec.stop_grace, positive=True)
        progress = t.string("progress")
        if isinstance(progress, str):
            try:
                compile_progress(progress)
            except PatternError as exc:
                t.fail("progress", str(exc))
        max_restarts = t.integer("max_restarts", JobSpec.max_restarts, lo=0, meaning=" (0: never stop)")
        restart_window = t.duration("restart_window", JobSpec.restart_window, positive=True)
        priority = t.integer("priority", JobSpec.priority, meaning=" (higher is served first; default 0)")
        exclude, include = t.patterns("exclude"), t.patterns("include")
        if self.problems:
            return None
        return JobSpec(name=name, command=command, workdir=workdir, min_workers=min_workers,
                       max_workers=max_workers, device=DeviceKind(device), env=env,
                       shared_filesystem=shared, mode=JobMode(mode), stop_grace=stop_grace,
                       progress=progress, max_restarts=max_restarts, restart_window=restart_window,
                       priority=priority, exclude=exclude, include=include)

    def ssh(self, t: Table) -> SSHSettings:
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
        return SSHSettings(**{k: (getattr(d, k) if v is BAD else v) for k, v in values.items()})

    def policy(self, t: Table) -> Policy:
        d = Policy()
        values = dict(
            idle_for=t.duration("idle_for", d.idle_for, positive=False),
            cpu_idle_for=t.duration("cpu_idle_for", d.cpu_idle_for, positive=False),
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
            usage_half_life=t.duration("usage_half_life", d.usage_half_life, positive=True),
            fairshare_slack=t.integer("fairshare_slack", d.fairshare_slack, lo=0,
                                      meaning=" (GPUs held beyond the fair share before any is released)"),
            fairshare_hold=t.duration("fairshare_hold", d.fairshare_hold, positive=False),
        )
        if isinstance(values["hang_timeout"], float) and values["hang_timeout"] > 30:
            # The runtime caps it (runtime/member/config.py MAX_HANG_TIMEOUT_S): a longer
            # silence would stall every survivor of a crash for that long.
            values["hang_timeout"] = t.fail("hang_timeout", f"must be at most 30s, got "
                                                            f"{show(t.data['hang_timeout'])}")
        return Policy(**{k: (getattr(d, k) if v is BAD else v) for k, v in values.items()})

    def stragglers(self, t: Table) -> StragglerPolicy:
        d = StragglerPolicy()
        values = dict(
            drop_stragglers=t.boolean("drop_stragglers", d.drop_stragglers),
            straggler_gain_percent=t.integer("straggler_gain_percent", d.straggler_gain_percent, lo=1,
                                             meaning=" (percent faster without a worker before it is dropped)"),
            straggler_for=t.duration("straggler_for", d.straggler_for, positive=False),
        )
        return StragglerPolicy(**{k: (getattr(d, k) if v is BAD else v) for k, v in values.items()})

    def controller(self, t: Table) -> ControllerSettings:
        address = t.string("address")
        if isinstance(address, str) and any(c.isspace() for c in address):
            address = t.fail("address", f"{show(address)} contains whitespace; write one IP "
                                        "address of this machine that every host can reach")
        store = t.choice("store", "ssh", STORE_MODES)
        metrics_file = t.path_value("metrics_file")
        return ControllerSettings(address=None if address is BAD else address,
                                  store=store if isinstance(store, str) else "ssh",
                                  metrics_file=None if metrics_file is BAD else metrics_file)

    def storage(self, t: Table) -> Storage:
        d = Storage()
        mirror = t.string("mirror")
        if isinstance(mirror, str):
            if mirror.startswith("ssh://"):
                if not _SSH_URL.fullmatch(mirror):
                    mirror = t.fail("mirror", f"{show(mirror)} is not an ssh:// address; write "
                                              "ssh://[user@]host[:port]/path")
            elif "://" in mirror:
                mirror = t.fail("mirror", f"{show(mirror)}: only a directory or "
                                          "ssh://[user@]host[:port]/path is supported")
            else:
                mirror = str(self.resolve(mirror))
        keep = t.integer("keep", d.keep, lo=1)
        trust = t.boolean("trust_unsigned", d.trust_unsigned)
        return Storage(mirror=None if mirror is BAD else mirror,
                       keep=d.keep if keep is BAD else keep,
                       trust_unsigned=d.trust_unsigned if trust is BAD else trust)

    def hosts(self, value: Any, ssh: SSHSettings) -> tuple[Host, ...]:
        if value is ABSENT or value == []:
            self.report("hosts", "no hosts; add at least one [[hosts]] section with name and address")
            return ()
        if isinstance(value, dict):
            self.report("hosts", "must be an array of tables: write [[hosts]] (two brackets) "
                                 "before each host")
            return ()
        if not isinstance(value, list) or not value:
            self.report("hosts", f"must be one [[hosts]] section per host, {got(value)}")
            return ()
        hosts: list[Host] = []
        first_seen: dict[str, tuple[str, int | None]] = {}  # host name -> (key path, line) of its first entry
        for i, item in enumerate(value):
            key = f"hosts[{i}]"
            if not isinstance(item, dict):
                self.report(key, f"must be a table (a [[hosts]] section), {got(item)}")
                continue
            host = self.host(item, key, ssh)
            # Duplicates are checked on the raw name, so a host with another problem
            # still counts: both mistakes are reported in one run.
            name = raw_host_name(item)
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
        t = Table(self, item, key, label=label, accepted=HOST_KEYS, where="[[hosts]]")
        address = t.string("address", required='"hostname or IP" (or "local" for this machine)')
        if isinstance(address, str) and any(c.isspace() for c in address):
            address = t.fail("address", f"{show(address)} contains whitespace; write one hostname or IP")
        name_rule = f"is not usable as a host name: use {NAME_RULE} (it names files)"
        name = t.string("name", None, pattern=NAME_PATTERN, pattern_says=name_rule)
        if name is None and isinstance(address, str):
            name = address  # a host without a name is called by its address
            if not NAME_PATTERN.fullmatch(name):
                t.fail("name", f"missing, and the address {show(address)} is not usable as a "
                               f"host name; add name = \"...\" ({NAME_RULE})")
        port = t.integer("port", ssh.port, lo=1, hi=65535)
        user = t.string("user", ssh.user)
        python = t.string("python", "python3")
        gpus = self.gpus(t)
        slots = t.integer("slots", 1, lo=1, meaning=" (CPU workers on this host)")
        max_micro = t.integer("max_micro_batch", None, lo=1,
                              meaning=" (samples a worker on this host computes at once; leave it out: no limit)")
        data_interface = t.string("data_interface", None, pattern=INTERFACE_PATTERN,
                                  pattern_says='is not a network interface name (e.g. "eth1", "ib0")')
        env = t.env("env")
        host_courtesy = courtesy.parse_host(t)
        schedule = schedules.host_schedule(t)
        owner = owner_values(t)
        if len(self.problems) > before:
            return None
        return Host(name=name, address=address, port=port, user=user, python=python,
                    gpus=gpus, slots=slots, max_micro_batch=max_micro, data_interface=data_interface, env=env, courtesy=host_courtesy,
                    schedule=schedule, owner=owner)

    def gpus(self, t: Table) -> Any:
        value = t.raw("gpus")
        if value is ABSENT or value == "all":
            return None
        fix = 'write gpus = "all" or a list of indices such as gpus = [0, 1]'
        if isinstance(value, str):
            return t.fail("gpus", f'must be "all" or a list of GPU indices, got {show(value)}; {fix}')
        if not isinstance(value, list):
            return t.fail("gpus", f"must be \"all\" or a list of GPU indices, {got(value)}; {fix}")
        if not value:
            return t.fail("gpus", f"must list at least one GPU index; {fix}")
        ok = True
        for i, g in enumerate(value):
            if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                t.fail(f"gpus[{i}]", f"must be a GPU index (an integer >= 0), got {show(g)}")
                ok = False
        if ok and len(set(value)) != len(value):
            dup = sorted({g for g in value if value.count(g) > 1})
            return t.fail("gpus", f"lists GPU {', '.join(map(str, dup))} more than once")
        return tuple(value) if ok else BAD

"""The inventory's values: frozen dataclasses made once by `parse.py`, passed down everywhere."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from eltctl_runtime.owner import OwnerPolicy

from eltctl.inventory.courtesy import Courtesy, Overrides
from eltctl.inventory.hours import HostSchedule, Schedule
from eltctl.inventory.notify import NotifySettings

LOCAL = "local"  # `address = "local"`: run on this machine, no SSH


class DeviceKind(str, enum.Enum):
    AUTO = "auto"  # CUDA where the host has free GPUs, CPU workers (slots) elsewhere
    CUDA = "cuda"
    CPU = "cpu"  # one CPU worker per free GPU slot (how GPU hosts are simulated in tests)


class JobMode(str, enum.Enum):
    ELASTIC = "elastic"  # the script uses eltctl_runtime.ElasticJob: resized live
    RESTART = "restart"  # an unmodified torchrun script: restarted on every membership change


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
    mode: JobMode = JobMode.ELASTIC
    stop_grace: float = 30.0  # restart mode: seconds the script has to save after SIGTERM
    # restart mode: a regex (named groups step, loss, ...) or a name in eltctl_runtime.restart.progress.PATTERNS,
    # matched against rank 0's output for the script's step; None: report() calls only
    progress: str | None = None
    max_restarts: int = 5  # restart mode: failures of the script within restart_window that stop the job (0: never)
    restart_window: float = 600.0  # seconds
    priority: int = 0  # fair share between jobs: a higher priority's demand is served first (docs/fairshare.md)
    # what of workdir does not go to the hosts, and what goes whatever the rules say: gitignore
    # patterns (eltctl/hosts/ignore.py), after the built-in rules, .gitignore and .eltctlignore
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] = ()


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
    # seconds a CPU slot (a host without GPUs) must look free first: no owner process can
    # be seen on a CPU slot, so by default it is used at once (owner_signals watch the owner)
    cpu_idle_for: float = 0.0
    # fair share between jobs sharing hosts (controller/fairshare.py, docs/fairshare.md)
    usage_half_life: float = 86400.0  # seconds: a user's recent usage halves every this long
    fairshare_slack: int = 0  # GPUs a job may hold beyond its fair share before it releases any
    fairshare_hold: float = 600.0  # seconds: a GPU taken less than this long ago is not released


@dataclass(frozen=True)
class StragglerPolicy:
    """[policy]'s straggler keys (the runtime's balance.py predicts the job's speed
    without each worker; controller/policy.py `track_stragglers` acts on it)."""

    drop_stragglers: bool = True  # drop a worker the job is measurably faster without
    straggler_gain_percent: int = 10  # "measurably": predicted at least this much faster without it
    straggler_for: float = 60.0  # seconds that must hold in a row before it is dropped


@dataclass(frozen=True)
class ControllerSettings:
    address: str | None = None  # the address workers reach the store at in "direct" mode (None: worked out)
    # "ssh": the store on 127.0.0.1, forwarded to each host over its SSH connection;
    # "direct": bound to `address` (exposes the store to the network; the secret covers it)
    store: str = "ssh"
    # the Prometheus text file rewritten with status.json (for node_exporter's textfile collector)
    metrics_file: Path | None = None


@dataclass(frozen=True)
class Storage:
    mirror: str | None = None  # a shared directory or ssh://[user@]host[:port]/path
    keep: int = 3  # mirrored checkpoints kept
    # restore mirrored checkpoints whose manifest MAC is missing or fails (eltctl/mirror/signing.py)
    trust_unsigned: bool = False


@dataclass(frozen=True)
class Host:
    name: str
    address: str  # hostname, IP, or "local"
    port: int = 22
    user: str | None = None
    python: str = "python3"  # interpreter with torch on that host
    gpus: tuple[int, ...] | None = None  # None: all GPUs the host has
    slots: int = 1  # CPU workers on a host without GPUs
    max_micro_batch: int | None = None  # samples a worker here computes at once; None: no limit
    data_interface: str | None = None  # the interface gloo and NCCL use; None: the SSH address's
    env: tuple[tuple[str, str], ...] = ()  # extra environment for commands on this host
    courtesy: Overrides = ()  # the courtesy keys this host sets (courtesy.for_host merges them)
    schedule: HostSchedule = field(default_factory=HostSchedule)  # enabled, hours, quotas (inventory/hours.py)
    owner: tuple[tuple[str, Any], ...] = ()  # its owner_* keys over [policy]'s (inventory/owner.py)

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
    stragglers: StragglerPolicy = field(default_factory=StragglerPolicy)  # read from [policy]
    courtesy: Courtesy = field(default_factory=Courtesy)  # read from [policy]; per host: courtesy.for_host
    schedule: Schedule = field(default_factory=Schedule)  # [policy]'s hours and quotas (inventory/hours.py)
    owner: OwnerPolicy = field(default_factory=OwnerPolicy)  # [policy]'s owner_* keys (inventory/owner.py)
    notify: NotifySettings = field(default_factory=NotifySettings)  # [notify] (inventory/notify.py)

    def owner_policy(self, host: Host) -> OwnerPolicy:
        """The owner signals watched on `host`: [policy]'s owner_* keys with its own over them."""
        return replace(self.owner, **dict(host.owner)) if host.owner else self.owner

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def hosts_named(self, names: Iterable[str]) -> tuple[Host, ...]:
        """The hosts of these names, in the order given (each once); `UnknownHostError`
        (exit status 2, with a did-you-mean) naming every name that is not one."""
        from eltctl.errors import UnknownHostError

        by_name = {h.name: h for h in self.hosts}
        wanted = list(dict.fromkeys(names))
        unknown = [n for n in wanted if n not in by_name]
        if unknown:
            raise UnknownHostError(unknown, list(by_name), str(self.path))
        return tuple(by_name[n] for n in wanted)

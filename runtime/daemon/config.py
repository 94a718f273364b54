"""The host daemon's configuration and its workers' environment.

`daemon.json` (written by the controller; `DaemonConfig.from_json`)::

    {
      "job": "mnist", "host": "ws1",          # names; the host name is the inventory's
      "store": "unix:/home/u/.eltctl/jobs/j/h/store.sock",  # the job's store (or tcp:host:port)
      "job_dir": "/home/u/.eltctl/jobs/mnist/ws1",
      "code_dir": "/home/u/.eltctl/jobs/mnist/ws1/code",   # the workers' cwd
      "python": "/usr/bin/python3",           # replaces "python"/"python3" as command[0]
      "command": ["python", "train.py", "--epochs", "3"],
      "env": {"NCCL_DEBUG": "WARN"},          # extra worker environment
      "device": "cuda",                       # or "cpu" (also: simulated GPU hosts)
      "gpus": [0, 1],                         # GPU indices the job may use; null: CPU slots
      "follow_gpus": true,  # optional: `gpus` is what the probe saw, not the inventory's list: the
                            # daemon's GPU slots then follow what its nvidia-smi lists (logic.py
                            # `followed_slots`); absent or false: `gpus` is fixed for its life
      "slots": 1,                             # CPU workers when gpus is null and device is cpu
      "max_micro_batch": null,                # optional: a worker's largest micro-batch here
      "checkpoint_dir": "/shared/ckpt/mnist", # or null
      "hang_timeout": 10, "min_workers": 1, "max_workers": null,
      "watch_interval": 1.0, "nvidia_smi_timeout": 10,
      "leave_timeout": 120, "stop_timeout": 300,    # optional: graces before SIGKILL
      "evict_grace": 2,     # optional: how long a worker that left for a GPU's owner may linger
      "mode": "elastic",    # optional: or "restart" (an unmodified torchrun script)
      "stop_grace": 30,     # optional, restart mode: seconds the script has to save after SIGTERM
      "progress": null,     # optional, restart mode: regex or name (progress.PATTERNS) for rank 0's output
      "max_restarts": 5, "restart_window": 600,   # optional, restart mode: the script's failures that stop the job
      "courtesy": {"nice": 10, "ionice": "best-effort", "cpu_threads": null, "memory_limit_mib": null}
                            # optional: the workers' priority and limits (courtesy.py); absent: none
      "owner": {"signals": ["login", "keyboard", "load"], "idle_to_start": 900, ...}
                            # optional: owner signals beyond the GPU (eltctl_runtime.owner.OwnerPolicy;
                            # absent or null: none watched)
      "claims_dir": null,   # optional: the host's GPU claims directory (runtime/claims.py); null:
                            # $ELTCTL_CLAIMS_DIR of the daemon's environment, else /tmp/eltctl-gpus
      "data_interface": null,   # optional: the interface gloo and NCCL use here (the inventory's host
                                # key); null: the one holding the host's address (module docstring)
      "config": "3f9a0c2b7d1e4a55",   # optional: the controller's digest of the job's code, settings and
                                # this host's entry as shipped with this daemon; it is published in
                                # the daemon's state and its crash events, so the controller tells a
                                # daemon (and a failure) from before a fix; absent: ""
      "secret_file": "/home/u/.eltctl/jobs/mnist/ws1/secret"
                            # optional: the job's secret (an absolute path to a 0600 file, runtime/auth.py);
                            # the daemon signs and checks every store value with it and its workers get
                            # ELTCTL_SECRET_FILE; absent or null: unsigned
    }

In restart mode each slot runs the supervisor (runtime/restart/supervisor.py) in place of
the command: `<python> -m eltctl_runtime.restart --stop-grace S --script-dir
<job_dir>/script-checkpoints --max-restarts N --restart-window S [--progress P]
-- <command>`; it runs the command itself with
torchrun's environment. `leave_timeout` and `stop_timeout` are raised to at
least `stop_grace` + 60 s so the daemon never kills a supervisor that is still
waiting for its script to save.

The worker environment: the daemon's own (inherited), then `env`, then the
runtime's contract (runtime/member/config.py): ELTCTL_STORE, ELTCTL_JOB,
ELTCTL_WORKER_ID=`<host>/<slot>/<incarnation>` (never reused: the incarnation
counts up from the daemon's start time in ms, logic.first_incarnation),
ELTCTL_DEVICE, ELTCTL_LOCAL_GPU (0: the one visible GPU), ELTCTL_CHECKPOINT_DIR,
ELTCTL_HANG_TIMEOUT, ELTCTL_MIN_WORKERS, ELTCTL_MAX_WORKERS, ELTCTL_MAX_MICRO_BATCH
(when max_micro_batch is set), ELTCTL_SECRET_FILE (when secret_file is set), for a GPU slot
CUDA_VISIBLE_DEVICES=<index> (also with device cpu: the GPU simulator sees a
worker by it), and with courtesy.cpu_threads OMP_NUM_THREADS, MKL_NUM_THREADS,
OPENBLAS_NUM_THREADS and ELTCTL_CPU_THREADS (over the job's own env).

The data plane (runtime/netif.py): the daemon names the interface holding its
workers' bind address (ELTCTL_BIND_ADDRESS from its SSH connection, else its address
towards the store; a loopback address is `lo`) as GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME; with `data_interface`, that interface, and its address as
ELTCTL_BIND_ADDRESS. The job's `env` (and the daemon's own environment, for the two
*_SOCKET_IFNAME) wins over both. An interface the host lacks fails `load`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from .. import netif
from ..store.auth import ENV_RUN_FILE, ENV_SECRET_FILE, RUN_FILE_NAME, SecretError, read_secret
from ..owner import OwnerPolicy
from ..protocol import NAME_RULE, valid_name
from .courtesy import Courtesy, thread_env
from ..store.server import parse_spec


MODES = ("elastic", "restart")
RESTART_MODULE = "eltctl_runtime.restart"
SCRIPT_CHECKPOINTS_DIR = "script-checkpoints"  # under job_dir: the scripts' own checkpoints (restart mode)
# How much longer than stop_grace the daemon waits for a supervisor to leave or stop.
STOP_GRACE_MARGIN_S = 60.0


class DaemonConfigError(ValueError):
    """daemon.json is missing, unreadable or malformed."""


@dataclass(frozen=True)
class DaemonConfig:
    job: str
    host: str
    store: str  # the job's store: unix:/path, tcp:host:port or host:port (eltctl_runtime.store.server)
    job_dir: Path
    code_dir: Path
    command: tuple[str, ...]
    python: str = "python3"
    env: Mapping[str, str] = field(default_factory=dict)
    device: str = "cpu"  # "cpu" | "cuda"
    gpus: tuple[int, ...] | None = None
    follow_gpus: bool = False  # the GPU slots follow nvidia-smi's list (module docstring)
    slots: int = 1
    max_micro_batch: int | None = None
    checkpoint_dir: Path | None = None
    hang_timeout: float = 10.0
    min_workers: int = 1
    max_workers: int | None = None
    watch_interval: float = 1.0
    nvidia_smi_timeout: float = 10.0
    leave_timeout: float = 120.0
    stop_timeout: float = 300.0
    evict_grace: float = 2.0
    mode: str = "elastic"
    stop_grace: float = 30.0
    progress: str | None = None
    max_restarts: int = 5
    restart_window: float = 600.0
    courtesy: Courtesy = field(default_factory=Courtesy)
    owner: OwnerPolicy = field(default_factory=OwnerPolicy)
    claims_dir: str | None = None  # None: $ELTCTL_CLAIMS_DIR, else claims.DEFAULT_DIR (runtime/claims.py)
    data_interface: str | None = None  # the interface gloo and NCCL use here; None: netif's rule
    secret_file: Path | None = None  # the job's secret on this host (0600); None: unsigned
    config: str = ""  # the controller's digest of what this daemon was started with ("": unknown)
    secret: bytes | None = field(default=None, repr=False)  # read from secret_file by `load`

    @property
    def run_file(self) -> Path:
        """The store's run id on this host (`<job_dir>/run`, beside the secret; auth.py):
        the controller writes it before the host can reach a new store keeper. Read at
        every connect (the daemon's link, the workers through ELTCTL_RUN_FILE)."""
        return self.job_dir / RUN_FILE_NAME

    @property
    def gpu_host(self) -> bool:
        """Slots are GPU indices (a real or simulated GPU host)."""
        return self.gpus is not None or self.device == "cuda"

    @property
    def valid_slots(self) -> frozenset[int] | None:
        """The slots it has at its start (None: any GPU); with `follow_gpus` the daemon's
        GPU slots then follow nvidia-smi (service.py `_observe_gpus`)."""
        if self.gpus is not None:
            return frozenset(self.gpus)
        return None if self.device == "cuda" else frozenset(range(self.slots))

    @property
    def script_argv(self) -> tuple[str, ...]:
        """The job's command: `python` or `python3` as the first word means this host's interpreter."""
        first, *rest = self.command
        return (self.python, *rest) if first in ("python", "python3") else self.command

    @property
    def argv(self) -> tuple[str, ...]:
        """What the daemon starts per slot: the command, or in restart mode the
        supervisor that runs it (see the module docstring)."""
        if self.mode == "restart":
            return (self.python, "-m", RESTART_MODULE, "--stop-grace", f"{self.stop_grace:g}", "--script-dir",
                    str(self.job_dir / SCRIPT_CHECKPOINTS_DIR), "--max-restarts", str(self.max_restarts),
                    "--restart-window", f"{self.restart_window:g}",
                    *(("--progress", self.progress) if self.progress else ()), "--", *self.script_argv)
        return self.script_argv

    @classmethod
    def load(cls, path: Path) -> "DaemonConfig":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise DaemonConfigError(f"cannot read the daemon configuration {path}: {e.strerror}") from None
        cfg = cls.from_json(text, source=str(path))
        if cfg.data_interface is not None:
            try:
                netif.choose(netif.addresses(), address="", interface=cfg.data_interface)
            except netif.DataInterfaceError as e:
                raise DaemonConfigError(f"host {cfg.host}: {e}") from None
        return replace(cfg, secret=cfg.read_secret(str(path)))

    def read_secret(self, source: str = "daemon.json") -> bytes | None:
        """The job's secret from `secret_file` (None when there is none)."""
        if self.secret_file is None:
            return None
        try:
            return read_secret(self.secret_file)
        except SecretError as e:
            raise DaemonConfigError(f"{source}: 'secret_file': {e}. `eltctl up` writes it (0600, 64 hex digits); "
                                    f"run `eltctl up` again to deliver it") from None

    @classmethod
    def from_json(cls, text: str, source: str = "daemon.json") -> "DaemonConfig":
        try:
            d = json.loads(text)
        except ValueError as e:
            raise DaemonConfigError(f"{source} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise DaemonConfigError(f"{source} must hold a JSON object")

        def need(key: str, kind: type | tuple = str) -> Any:
            if key not in d or d[key] is None:
                raise DaemonConfigError(f"{source}: the key {key!r} is required")
            if not isinstance(d[key], kind):
                raise DaemonConfigError(f"{source}: {key!r} has the wrong type ({type(d[key]).__name__})")
            return d[key]

        def number(key: str, default: float, positive: bool = True) -> float:
            value = d.get(key, default)
            if value is None:
                value = default
            if not isinstance(value, (int, float)) or isinstance(value, bool) or (positive and value <= 0):
                raise DaemonConfigError(f"{source}: {key!r} must be a positive number, not {value!r}")
            return float(value)

        command = need("command", list)
        if not command or not all(isinstance(a, str) for a in command):
            raise DaemonConfigError(f"{source}: 'command' must be a non-empty list of strings")
        store = need("store")
        try:
            parse_spec(store)
        except ValueError:
            raise DaemonConfigError(f"{source}: 'store' must be unix:/path, tcp:host:port or host:port, "
                                    f"not {store!r}") from None
        env = d.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise DaemonConfigError(f"{source}: 'env' must map names to strings")
        device = d.get("device", "cpu")
        if device not in ("cpu", "cuda"):
            raise DaemonConfigError(f"{source}: 'device' must be 'cpu' or 'cuda', not {device!r}")
        gpus = d.get("gpus")
        if gpus is not None and (not isinstance(gpus, list)
                                 or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0
                                            for g in gpus)):
            raise DaemonConfigError(f"{source}: 'gpus' must be null or a list of GPU indices")
        follow_gpus = d.get("follow_gpus") or False
        if not isinstance(follow_gpus, bool):
            raise DaemonConfigError(f"{source}: 'follow_gpus' must be true or false, not {follow_gpus!r}")
        slots = d.get("slots", 1)
        if not isinstance(slots, int) or slots < 1:
            raise DaemonConfigError(f"{source}: 'slots' must be a positive integer")
        min_workers = d.get("min_workers", 1) or 1
        max_workers = d.get("max_workers")
        if not isinstance(min_workers, int) or (max_workers is not None and not isinstance(max_workers, int)):
            raise DaemonConfigError(f"{source}: 'min_workers' and 'max_workers' must be integers (or null)")
        max_micro = d.get("max_micro_batch")
        if max_micro is not None and (not isinstance(max_micro, int) or isinstance(max_micro, bool) or max_micro < 1):
            raise DaemonConfigError(f"{source}: 'max_micro_batch' must be null or a positive integer")
        ckpt = d.get("checkpoint_dir")
        for key in ("job", "host"):
            if not valid_name(need(key)):
                raise DaemonConfigError(f"{source}: {key!r} is not a valid name ({d[key]!r}): use {NAME_RULE}")
        mode = d.get("mode") or "elastic"
        if mode not in MODES:
            raise DaemonConfigError(f"{source}: 'mode' must be 'elastic' or 'restart', not {mode!r}")
        stop_grace = number("stop_grace", 30.0)
        progress = d.get("progress")
        if progress is not None and (not isinstance(progress, str) or not progress):
            raise DaemonConfigError(f"{source}: 'progress' must be null or a non-empty string")
        max_restarts = d.get("max_restarts", 5)
        if max_restarts is None:
            max_restarts = 5
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise DaemonConfigError(f"{source}: 'max_restarts' must be an integer >= 0, not {max_restarts!r}")
        restart_window = number("restart_window", 600.0)
        try:
            owner = OwnerPolicy.from_dict(d.get("owner"), source=f"{source}: 'owner'")
        except ValueError as e:
            raise DaemonConfigError(str(e)) from None
        claims_dir = d.get("claims_dir")
        if claims_dir is not None and (not isinstance(claims_dir, str) or not claims_dir):
            raise DaemonConfigError(f"{source}: 'claims_dir' must be null or a directory path")
        secret_file = d.get("secret_file")
        if secret_file is not None and (not isinstance(secret_file, str) or not secret_file.startswith("/")):
            raise DaemonConfigError(f"{source}: 'secret_file' must be null or an absolute path, not {secret_file!r}")
        data_interface = d.get("data_interface")
        if data_interface is not None and (not isinstance(data_interface, str) or not data_interface):
            raise DaemonConfigError(f"{source}: 'data_interface' must be null or an interface name")
        config = d.get("config") or ""
        if not isinstance(config, str):
            raise DaemonConfigError(f"{source}: 'config' must be a string (the controller's digest), not {config!r}")
        floor = stop_grace + STOP_GRACE_MARGIN_S if mode == "restart" else 0.0
        try:
            courtesy = Courtesy.from_json(d.get("courtesy"), source)
        except ValueError as e:
            raise DaemonConfigError(str(e)) from None
        return cls(
            job=need("job"), host=need("host"), store=store, job_dir=Path(need("job_dir")).expanduser(),
            code_dir=Path(need("code_dir")).expanduser(), command=tuple(command),
            python=d.get("python") or "python3", env=dict(env), device=device,
            gpus=tuple(gpus) if gpus is not None else None, follow_gpus=follow_gpus and gpus is not None,
            slots=slots, max_micro_batch=max_micro,
            checkpoint_dir=Path(ckpt).expanduser() if ckpt else None,
            hang_timeout=number("hang_timeout", 10.0), min_workers=min_workers, max_workers=max_workers,
            watch_interval=number("watch_interval", 1.0), nvidia_smi_timeout=number("nvidia_smi_timeout", 10.0),
            leave_timeout=max(floor, number("leave_timeout", 120.0)),
            stop_timeout=max(floor, number("stop_timeout", 300.0)),
            evict_grace=number("evict_grace", 2.0), mode=mode, stop_grace=stop_grace, progress=progress,
            max_restarts=max_restarts, restart_window=restart_window, courtesy=courtesy,
            owner=owner, claims_dir=claims_dir, data_interface=data_interface, secret_file=Path(secret_file) if secret_file else None,
            config=config,
        )


def worker_env(cfg: DaemonConfig, base: Mapping[str, str], slot: int, worker_id: str) -> dict[str, str]:
    """The environment of the worker `worker_id` on `slot` (see the module docstring)."""
    env = dict(base)
    env.update(cfg.env)
    env.update({
        "ELTCTL_STORE": cfg.store, "ELTCTL_JOB": cfg.job, "ELTCTL_WORKER_ID": worker_id,
        "ELTCTL_DEVICE": cfg.device, "ELTCTL_LOCAL_GPU": "0", "ELTCTL_HANG_TIMEOUT": f"{cfg.hang_timeout:g}",
        "ELTCTL_MIN_WORKERS": str(cfg.min_workers),
    })
    if cfg.max_workers is not None:
        env["ELTCTL_MAX_WORKERS"] = str(cfg.max_workers)
    else:
        env.pop("ELTCTL_MAX_WORKERS", None)
    if cfg.checkpoint_dir is not None:
        env["ELTCTL_CHECKPOINT_DIR"] = str(cfg.checkpoint_dir)
    if cfg.max_micro_batch is not None:
        env["ELTCTL_MAX_MICRO_BATCH"] = str(cfg.max_micro_batch)
    else:
        env.pop("ELTCTL_MAX_MICRO_BATCH", None)
    if cfg.secret_file is not None:
        env[ENV_SECRET_FILE] = str(cfg.secret_file)
        env[ENV_RUN_FILE] = str(cfg.run_file)
    else:
        env.pop(ENV_SECRET_FILE, None)
        env.pop(ENV_RUN_FILE, None)
    if cfg.gpu_host:
        env["CUDA_VISIBLE_DEVICES"] = str(slot)
    env.update(thread_env(cfg.courtesy))
    return env


def data_plane(cfg: DaemonConfig, base: Mapping[str, str]) -> tuple[netif.DataPlane, dict[str, str]]:
    """This host's data plane (runtime/netif.py) and the variables it adds to the workers'
    environment (`base`: the daemon's own; the job's env wins over them in worker_env)."""
    # the workers' bind address: the job's env (the controller puts a local host's there), the daemon's own
    address = (cfg.env.get(netif.BIND_ADDRESS_ENV) or base.get(netif.BIND_ADDRESS_ENV) or "").strip()
    if not address:
        # as the workers' own rule (collectives.bind_address, config.py): towards the store;
        # a Unix socket's store (this machine's) says nothing about the network: loopback
        where = parse_spec(cfg.store)
        address = netif.local_address_towards(where.host, where.port) if where.host else "127.0.0.1"
    plane = netif.choose(netif.addresses(), address=address, interface=cfg.data_interface)
    keep = {k: v for k, v in base.items() if k in (netif.GLOO_IFNAME, netif.NCCL_IFNAME)}
    keep.update(cfg.env)
    return plane, netif.plane_env(plane, keep)

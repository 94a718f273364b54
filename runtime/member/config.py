"""The runtime's environment contract, parsed once at the edge.

Whoever launches a worker (the host daemon in production, the test launcher in
tests) describes the job through environment variables. `RuntimeConfig.from_env`
reads them once into a frozen value that is passed down; nothing deeper in the
runtime reads `os.environ`. See runtime/README.md for the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Mapping

from ..store.auth import ENV_RUN_FILE, ENV_SECRET_FILE, SecretError, read_run_id, read_secret
from ..store.server import parse_spec


class Device(str, Enum):
    CPU = "cpu"
    CUDA = "cuda"


MAX_HANG_TIMEOUT_S = 30.0
DEFAULT_HANG_TIMEOUT_S = 10.0
DEFAULT_STORE_LOSS_TIMEOUT_S = 120.0  # store/loss.py: away this long, the workers checkpoint and exit


class ConfigError(ValueError):
    """An environment variable of the contract is missing or malformed."""


@dataclass(frozen=True)
class RuntimeConfig:
    store_host: str
    store_port: int
    job: str
    worker_id: str
    device: Device = Device.CPU
    local_gpu: int = 0
    checkpoint_dir: Path | None = None
    audit_path: Path | None = None
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    max_workers: int | None = None
    min_workers: int = 1
    max_micro_batch: int | None = None  # this host's limit: larger shares run as micro-batches
    # The job's secret (ELTCTL_SECRET_FILE, read once here): every store value is signed
    # and checked with it (auth.py). None: unsigned (a job run without eltctl's controller).
    secret: bytes | None = field(default=None, repr=False)
    store_loss_timeout_s: float = DEFAULT_STORE_LOSS_TIMEOUT_S
    store: str = ""  # ELTCTL_STORE as given (eltctl_runtime.store.server's grammar); "": store_host:store_port

    @property
    def store_spec(self) -> str:
        """The address `storeclient.connect` takes."""
        return self.store or f"{self.store_host}:{self.store_port}"
    # The store's run id file (ELTCTL_RUN_FILE; auth.py): read at every (re)connect, since a
    # restarted store keeper has a new run id. None: run id "".
    run_file: Path | None = None

    def run_id(self) -> str:
        """The store's run id now ("" without a run file). Raises SecretError when the
        file is unusable."""
        return read_run_id(self.run_file)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "RuntimeConfig":
        env = os.environ if env is None else env

        def need(name: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                raise ConfigError(f"{name} is not set; the launcher must set it (see runtime/README.md)")
            return value

        store = need("ELTCTL_STORE")
        try:
            where = parse_spec(store)
        except ValueError:
            raise ConfigError(f"ELTCTL_STORE={store!r} is not unix:/path, tcp:host:port or host:port") from None
        try:
            device = Device(env.get("ELTCTL_DEVICE", "cpu").strip() or "cpu")
        except ValueError:
            raise ConfigError(f"ELTCTL_DEVICE={env.get('ELTCTL_DEVICE')!r}: use 'cpu' or 'cuda'") from None

        def number(name: str, default: float | None, kind=float):
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                return kind(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a number") from None

        hang = number("ELTCTL_HANG_TIMEOUT", DEFAULT_HANG_TIMEOUT_S)
        if not 0 < hang <= MAX_HANG_TIMEOUT_S:
            raise ConfigError(f"ELTCTL_HANG_TIMEOUT={hang} must be in (0, {MAX_HANG_TIMEOUT_S:g}] seconds")
        max_workers = number("ELTCTL_MAX_WORKERS", None, int)
        min_workers = number("ELTCTL_MIN_WORKERS", 1, int)
        if min_workers < 1 or (max_workers is not None and max_workers < min_workers):
            raise ConfigError(f"need 1 <= ELTCTL_MIN_WORKERS ({min_workers}) <= ELTCTL_MAX_WORKERS ({max_workers})")
        max_micro = number("ELTCTL_MAX_MICRO_BATCH", None, int)
        if max_micro is not None and max_micro < 1:
            raise ConfigError(f"ELTCTL_MAX_MICRO_BATCH={max_micro} must be at least 1 (or unset: no limit)")
        secret = None
        secret_file = env.get(ENV_SECRET_FILE, "").strip()
        if secret_file:
            try:
                secret = read_secret(Path(secret_file))
            except SecretError as e:
                raise ConfigError(f"{ENV_SECRET_FILE}={secret_file}: {e}. The file must hold the job's secret "
                                  f"(64 hex digits, mode 0600, owned by this user), as `eltctl up` writes it; "
                                  f"unset {ENV_SECRET_FILE} to run unsigned") from None
        run_file = env.get(ENV_RUN_FILE, "").strip()
        if run_file:
            try:
                read_run_id(Path(run_file))
            except SecretError as e:
                raise ConfigError(f"{ENV_RUN_FILE}={run_file}: {e}") from None
        store_loss = number("ELTCTL_STORE_LOSS_TIMEOUT", DEFAULT_STORE_LOSS_TIMEOUT_S)
        if not store_loss > 0:
            raise ConfigError(f"ELTCTL_STORE_LOSS_TIMEOUT={store_loss} must be a positive number of seconds")
        ckpt = env.get("ELTCTL_CHECKPOINT_DIR", "").strip()
        audit = env.get("ELTCTL_AUDIT", "").strip()
        return cls(
            # a Unix socket says nothing about the network: gloo binds at ELTCTL_BIND_ADDRESS
            store_host=where.host or "127.0.0.1",
            store_port=where.port,
            job=need("ELTCTL_JOB"),
            worker_id=need("ELTCTL_WORKER_ID"),
            device=device,
            local_gpu=number("ELTCTL_LOCAL_GPU", 0, int),
            checkpoint_dir=Path(ckpt) if ckpt else None,
            audit_path=Path(audit) if audit else None,
            hang_timeout_s=hang,
            max_workers=max_workers,
            min_workers=min_workers,
            max_micro_batch=max_micro,
            secret=secret,
            store_loss_timeout_s=store_loss,
            store=str(where),
            run_file=Path(run_file) if run_file else None,
        )

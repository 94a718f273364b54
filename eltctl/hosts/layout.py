"""Where eltctl keeps things on a host: the one place that spells the directory layout.

    ~/.eltctl/
      runtime/<hash>/eltctl_runtime/...   the shipped runtime (hash of its files)
      jobs/<job>/<host>/                  one job on one inventory host (`job_dir`)
        daemon.json                       the daemon's configuration (written by the controller)
        secret                            the job's secret (mode 0600, written by the controller over SSH)
        run                               the store keeper's run id (mode 0600, written by the keeper over SSH)
        store.address                     the direct mode's store address (0600, written with `run`; read
                                          by the daemon and workers when they reconnect: a keeper
                                          restarted on a new port)
        store.sock                        the job's store: the keeper's SSH forward of its Unix socket
        daemon.pid                        flocked by the daemon for its life
        daemon.log                        the daemon's log
        daemon.memory.json                the daemon's memory across restarts
        workers/<slot>.pid, <slot>.log    each worker's pid and log
        code/                             the job's code, synced (unless shared_filesystem)
        checkpoints/step-NNNNNNNN/        checkpoints committed by rank 0 on this host
        script-checkpoints/<slot>/        restart mode: the script's own checkpoint directory

The file names under `job_dir` are the ones runtime/daemon/ writes; the runtime is
given `job_dir` itself in daemon.json. Several inventory hosts may share a machine
(and a HOME): the `<host>` level keeps them apart.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from eltctl_runtime.store.auth import RUN_FILE_NAME, SECRET_FILE_NAME

STATE_DIR = ".eltctl"  # under the account's HOME
JOBS_DIR = f"{STATE_DIR}/jobs"
RUNTIME_DIR = f"{STATE_DIR}/runtime"

# Names under a job's directory.
DAEMON_JSON = "daemon.json"
SECRET_FILE = SECRET_FILE_NAME  # the job's secret, 0600
RUN_FILE = RUN_FILE_NAME  # the store keeper's run id, 0600 (written before the store is reachable here)
# the direct mode's store address, 0600 (beside `run`, written before it); the runtime reads it by the
# same name (eltctl_runtime.store.loss.STORE_ADDRESS_FILE; not one of the runtime modules the control side imports)
STORE_ADDRESS = "store.address"
STORE_SOCKET = "store.sock"  # the store, forwarded over SSH from the keeper (a Unix socket)
DAEMON_PID = "daemon.pid"
DAEMON_LOG = "daemon.log"
DAEMON_MEMORY = "daemon.memory.json"
WORKERS_DIR = "workers"
CODE_DIR = "code"
CHECKPOINTS_DIR = "checkpoints"


def worker_log(slot: int | str) -> str:
    """A worker's log, relative to the job's directory (`workers/0.log`)."""
    return f"{WORKERS_DIR}/{slot}.log"


def worker_pid(slot: int | str) -> str:
    """A worker's pid file, relative to the job's directory (`workers/0.pid`)."""
    return f"{WORKERS_DIR}/{slot}.pid"


def job_root_in(home: Path, job: str) -> Path:
    """A job's directories of every inventory host sharing a HOME seen from this machine."""
    return home / JOBS_DIR / job


def job_dir_in(home: Path, job: str, host: str) -> Path:
    """A job's directory under a HOME seen from this machine (a local or simulated host)."""
    return job_root_in(home, job) / host


def shell_job_dir(job: str, host: str) -> str:
    """A job's directory as the host's shell writes it (`$HOME/...`, quoted)."""
    return f"$HOME/{JOBS_DIR}/{shlex.quote(job)}/{shlex.quote(host)}"


@dataclass(frozen=True)
class HostPaths:
    """Where a job lives on one host (absolute: the host's HOME is asked once)."""

    home: str
    job: str
    host: str

    @property
    def job_dir(self) -> str:
        return f"{self.home}/{JOBS_DIR}/{self.job}/{self.host}"

    @property
    def code_dir(self) -> str:
        return f"{self.job_dir}/{CODE_DIR}"

    @property
    def daemon_json(self) -> str:
        return f"{self.job_dir}/{DAEMON_JSON}"

    @property
    def secret_file(self) -> str:
        return f"{self.job_dir}/{SECRET_FILE}"

    @property
    def run_file(self) -> str:
        return f"{self.job_dir}/{RUN_FILE}"

    @property
    def store_address(self) -> str:
        return f"{self.job_dir}/{STORE_ADDRESS}"

    @property
    def store_socket(self) -> str:
        return f"{self.job_dir}/{STORE_SOCKET}"

    @property
    def daemon_pid(self) -> str:
        return f"{self.job_dir}/{DAEMON_PID}"

    @property
    def daemon_log(self) -> str:
        return f"{self.job_dir}/{DAEMON_LOG}"

    @property
    def workers_dir(self) -> str:
        return f"{self.job_dir}/{WORKERS_DIR}"

    @property
    def checkpoint_dir(self) -> str:
        return f"{self.job_dir}/{CHECKPOINTS_DIR}"

    def runtime_dir(self, digest: str) -> str:
        return f"{self.home}/{RUNTIME_DIR}/{digest}"


def checkpoint_host(path: str, job: str) -> str | None:
    """The host a runtime checkpoint path belongs to, from the layout
    (`.../.eltctl/jobs/<job>/<host>/checkpoints/step-N`); None if it is not one."""
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts) - 3):
        if parts[i] == "jobs" and parts[i + 1] == job and parts[i + 3] == CHECKPOINTS_DIR:
            return parts[i + 2]
    return None

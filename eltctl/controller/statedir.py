"""The job's state directory on the control machine, and the files in it.

`${XDG_STATE_HOME:-~/.local/state}/eltctl/<job>/` holds what the controller keeps
between runs and what the commands read (docs/control-plane.md, "Files"):

    controller.lock   flock'ed by the live controller for its whole life
    controller.json   {pid, started, inventory, store: {address, port, socket, pid}, socket}
    control.sock      the command socket
    store.sock        the job's store (the store keeper's Unix socket; the "ssh" store mode)
    run               the store keeper's run id (mode 0600), new at every keeper start
    storekeeper.json  the live keeper's pid and address; storestats.json: its store's refusals
    status.json       the status document, rewritten about once a second
    hosts.json        the controller's memory about hosts (removed, benched, ...) and the last checkpoint seen
    usage.db          the usage ledger (SQLite, eltctl/ledger): written by the controller only
    notify.json       the notifications' deliveries (eltctl/notify/delivery.py)
    secret            the job's secret (32 random bytes, hex; mode 0600): made at the first
                      `up`, kept while the job lives (`job_secret`), sent to the hosts over SSH
    controller.log, storekeeper.log
    cron.lock, cron.log  `up --unattended`'s run lock and log (eltctl/cron.py)

Everything written here is written atomically (a temporary file renamed into
place), so a reader never sees half a document, whatever dies when. This module
imports nothing heavy: the CLI commands use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from eltctl_runtime.store.auth import RUN_FILE_NAME, SECRET_FILE_NAME, new_secret, read_secret, write_secret
from eltctl_runtime.files import try_flock
from eltctl_runtime.pids import pid_alive


SOCKET_NAME = "control.sock"


def control_id(environ: Mapping[str, str] | None = None) -> str:
    """This control machine's identity, which marks the job's daemons and workers on the
    hosts (ELTCTL_CONTROL, and the job directory's `owner` file): the machine id, else
    the host name. ELTCTL_CONTROL_ID overrides it (tests; containers sharing an id)."""
    env = os.environ if environ is None else environ
    forced = env.get("ELTCTL_CONTROL_ID", "").strip()
    if forced:
        return forced
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    import socket

    return socket.gethostname()

def state_root(environ: Mapping[str, str] | None = None) -> Path:
    """`$XDG_STATE_HOME/eltctl`, or `~/.local/state/eltctl` (the XDG default)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME", "").strip()
    # The XDG spec says a relative value is invalid and must be ignored.
    root = Path(base) if base and os.path.isabs(base) else Path(env.get("HOME") or Path.home()) / ".local" / "state"
    return root / "eltctl"


@dataclass(frozen=True)
class StateDir:
    """The paths of one job's state directory. Creating one touches nothing on disk."""

    path: Path

    @classmethod
    def for_job(cls, job: str, environ: Mapping[str, str] | None = None) -> "StateDir":
        return cls(state_root(environ) / job)

    @property
    def lock(self) -> Path:
        return self.path / "controller.lock"

    @property
    def controller_json(self) -> Path:
        return self.path / "controller.json"

    @property
    def socket(self) -> Path:
        return self.path / SOCKET_NAME

    @property
    def status_json(self) -> Path:
        return self.path / "status.json"

    @property
    def hosts_json(self) -> Path:
        return self.path / "hosts.json"

    @property
    def usage_db(self) -> Path:
        return self.path / "usage.db"

    @property
    def notify_json(self) -> Path:
        return self.path / "notify.json"

    @property
    def secret(self) -> Path:
        return self.path / SECRET_FILE_NAME

    @property
    def run_file(self) -> Path:
        return self.path / RUN_FILE_NAME

    @property
    def store_socket(self) -> Path:
        return self.path / "store.sock"

    @property
    def store_stats(self) -> Path:
        return self.path / "storestats.json"

    @property
    def controller_log(self) -> Path:
        return self.path / "controller.log"

    @property
    def storekeeper_log(self) -> Path:
        return self.path / "storekeeper.log"

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)


def job_secret(state: StateDir) -> bytes:
    """The job's secret: the one in the state directory, or a new one written there
    (mode 0600) at the job's first `up`. Every later `up` (cron runs it again and again)
    reuses it, so a running job keeps its secret. A file others can read is refused
    (auth.SecretError says how to fix it): whoever reads it can sign."""
    existing = existing_secret(state)
    if existing is not None:
        return existing
    secret = new_secret()
    state.create()
    write_secret(state.secret, secret)
    return secret


def existing_secret(state: StateDir) -> bytes | None:
    """The job's secret when the state directory holds one (None: no job was started
    from this control machine, or the state directory is gone)."""
    if not (state.secret.exists() or state.secret.is_symlink()):
        return None
    return read_secret(state.secret)


class ControllerLock:
    """The flock that makes a controller the only one of its job.

    The lock is held by an open file descriptor, so it goes away with the process
    however it dies: a stale lock file never blocks the next controller.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock without waiting; False when another process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = try_flock(self.path, write_pid=True)
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def lock_holder(path: Path) -> int | None:
    """The pid written in the lock file when that process is alive, else None.

    Only a hint for messages: testing the flock itself would briefly take it and
    could make a starting controller believe another one runs.
    """
    try:
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


@dataclass(frozen=True)
class RecordedJob:
    """A job this machine's state directory knows: its name, the inventory its controller
    was started from (controller.json), and whether that controller is alive."""

    name: str
    inventory: Path
    running: bool


def recorded_jobs(environ: Mapping[str, str] | None = None) -> list[RecordedJob]:
    """Every job under the state root whose controller.json names its inventory, by name.

    Only what this account wrote is believed: a state directory or controller.json owned
    by another uid is passed over (the commands would otherwise run on an inventory
    someone else chose)."""
    import json

    root = state_root(environ)
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    uid = os.getuid()
    jobs = []
    for entry in entries:
        state = StateDir(entry)
        try:
            if entry.is_symlink() or not entry.is_dir() or entry.stat().st_uid != uid:
                continue
            st = os.lstat(state.controller_json)
            if st.st_uid != uid or not (st.st_mode & 0o170000) == 0o100000:  # a regular file of ours
                continue
            doc = json.loads(state.controller_json.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        inventory = doc.get("inventory") if isinstance(doc, dict) else None
        if isinstance(inventory, str) and os.path.isabs(inventory):
            jobs.append(RecordedJob(entry.name, Path(inventory), lock_holder(state.lock) is not None))
    return jobs

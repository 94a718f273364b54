"""The demo's view of processes on this machine: pid files, liveness, waiting for an exit."""

from __future__ import annotations

import time
from pathlib import Path

from eltctl.demo.setup import DemoSetup


def read_pid_file(path: Path) -> int | None:
    """The pid in a daemon or worker pid file (a number, or JSON with "pid"), else None."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text.startswith("{"):
        import json

        try:
            value = json.loads(text).get("pid")
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, int) else None
    head = text.split()[0] if text else ""
    return int(head) if head.isdigit() else None


def pid_alive(pid: int | None) -> bool:
    """Alive and not a zombie."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def worker_pid(setup: DemoSetup, host: str, slot: int) -> int | None:
    """The live worker of `slot` on `host`, from the daemon's pid file."""
    pid = read_pid_file(setup.host_dir(host) / "workers" / f"{slot}.pid")
    return pid if pid_alive(pid) else None


class PidWatch:
    """Notes when a process exits, watching it from a thread (10 ms polls), so a live
    view can go on refreshing meanwhile. `start()` begins; `exited_at` is the
    time.time() it was first seen gone, None until then."""

    def __init__(self, pid: int, timeout: float) -> None:
        self.pid = pid
        self.timeout = timeout
        self.exited_at: float | None = None
        self._thread = None

    def start(self) -> "PidWatch":
        import threading

        def watch() -> None:
            self.exited_at = wait_pid_exit(self.pid, self.timeout)

        self._thread = threading.Thread(target=watch, name=f"pid-watch-{self.pid}", daemon=True)
        self._thread.start()
        return self

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()


def wait_pid_exit(pid: int, timeout: float, *, poll: float = 0.01) -> float | None:
    """time.time() when `pid` was first seen gone (or a zombie), or None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return time.time()
        time.sleep(poll)
    return None

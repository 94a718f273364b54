"""The demo's view of processes on this machine: pid files, liveness, waiting for an exit."""

from __future__ import annotations

import time

from eltctl.demo.setup import DemoSetup
from eltctl.hosts import layout
from eltctl_runtime.pids import pid_alive, read_pid_file

__all__ = ["PidWatch", "pid_alive", "read_pid_file", "wait_pid_exit", "worker_pid"]


def worker_pid(setup: DemoSetup, host: str, slot: int) -> int | None:
    """The live worker of `slot` on `host`, from the daemon's pid file."""
    pid = read_pid_file(setup.host_dir(host) / layout.worker_pid(slot))
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

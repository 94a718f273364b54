"""eltctl's own commands run against the demo's inventory, and `sweep`, which ends
every process the demo started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eltctl.demo.pids import pid_alive
from eltctl.demo.setup import MARKER_ENV, DemoSetup


@dataclass
class EltctlRunner:
    """Runs `eltctl -i <demo inventory> ...` with the demo's private state directory."""

    setup: DemoSetup
    python: str = sys.executable
    log_dir: Path | None = None

    def argv(self, *args: str) -> list[str]:
        return [self.python, "-m", "eltctl", "-i", str(self.setup.inventory), *args]

    def start(self, *args: str, log_name: str) -> subprocess.Popen:
        """Start a command in the background; its output goes to `<log_dir>/<log_name>`."""
        log_dir = self.log_dir or self.setup.root
        out = open(log_dir / log_name, "ab")
        try:
            # Its own session: the user's Ctrl-C reaches the demo, which then cleans up
            # in order, instead of reaching every child at once.
            return subprocess.Popen(self.argv(*args), env=self.setup.environ(),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            out.close()

    def run(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), env=self.setup.environ(), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout, start_new_session=True)


def _marked(root: Path) -> tuple[list[int], bool]:
    """(this user's processes whose environment carries the demo's marker, whether some
    process showed an empty environment: one caught between its exec and the new
    program's setup reads as empty; kernel threads and zombies, always empty, do not count)."""
    marker = f"{MARKER_ENV}={root}".encode()
    prefixes = (f"ELTSIM_STATE={root}/".encode(), f"XDG_STATE_HOME={root}/".encode())
    me, uid = os.getpid(), os.getuid()
    found, pending = [], False
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                raw = f.read()
            if not raw:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                # state, ppid: zombies and kernel threads (children of kthreadd, pid 2) are not starting
                pending = pending or not (fields[0] in (b"Z", b"X") or fields[1] in (b"0", b"2") or entry == "2")
                continue
        except (OSError, IndexError):
            continue
        if any(item == marker or item.startswith(prefixes) for item in raw.split(b"\0")):
            found.append(int(entry))
    return found, pending


def sweep(root: Path, *, grace_s: float = 3.0) -> list[int]:
    """End every process of this user whose environment carries the demo's marker.

    The marker reaches the controller, the store keeper, the daemons and the
    workers through the environment they inherit, and the owner directly; also
    matched: the hosts' ELTSIM_STATE (under `root`) and the private XDG_STATE_HOME.
    SIGTERM, then SIGKILL after `grace_s`. Returns the pids it signalled.
    """
    found: list[int] = []
    for _ in range(10):  # again while new ones turn up or one is mid-exec (its environment not there yet)
        pids, pending = _marked(root)
        new = [p for p in pids if p not in found]
        found += new
        if not new and not pending:
            break
        time.sleep(0.05)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        alive = [p for p in found if pid_alive(p)]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in alive if pid_alive(p)]
    return found

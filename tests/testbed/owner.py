"""Owner stand-ins for a simulated host: its own utmp, its own tty and input device files,
and real busy processes "on" it.

The test bed's hosts share one machine, so each gets its own files, named through the
environment of its sessions (pass `OwnerStandIn.env()` to `Testbed.add_host(env=...)`):
eltctl_runtime.owner reads utmp from `$ELTCTL_UTMP` and tty/input files under
`$ELTCTL_DEV_ROOT` instead of /var/run/utmp and /dev. What is written is real: glibc's
x86_64 `struct utmp` records (384 bytes, USER_PROCESS), and plain files whose atime is
set with os.utime, as the kernel sets a tty's atime on input (that is how `w` computes
idle times). For the load and memory signals, the sessions of a simulated host carry
ELTSIM_HOST, and the owner code then counts only processes whose environment holds the
same ELTSIM_HOST: `start_busy` starts a real process that spins a CPU with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from eltctl_runtime.owner import USER_PROCESS, UTMP_SIZE, pack_utmp, parse_utmp


class OwnerStandIn:
    """One simulated host's utmp, /dev and busy processes (files under `root`)."""

    __test__ = False

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.utmp = self.root / "utmp"
        self.dev = self.root / "dev"
        (self.dev / "pts").mkdir(parents=True, exist_ok=True)
        self.utmp.write_bytes(b"")
        self._busy: list[subprocess.Popen] = []

    def env(self) -> dict[str, str]:
        return {"ELTCTL_UTMP": str(self.utmp), "ELTCTL_DEV_ROOT": str(self.dev)}

    # -- logins ------------------------------------------------------------------
    def login(self, user: str, line: str = "pts/3", *, idle: float = 0.0, host: str = "10.1.2.3",
              pid: int | None = None) -> None:
        """A USER_PROCESS record for `user` on `line`, its tty last used `idle` seconds ago."""
        self.logout(line)
        with open(self.utmp, "ab") as f:
            f.write(pack_utmp(user, line, pid=pid or os.getpid(), host=host, login_time=time.time() - idle))
        tty = self.dev / line
        tty.parent.mkdir(parents=True, exist_ok=True)
        tty.touch()
        self.set_idle(line, idle)

    def set_idle(self, line: str, idle: float) -> None:
        """The tty's last input was `idle` seconds ago (its atime)."""
        t = time.time() - idle
        os.utime(self.dev / line, (t, t))

    def logout(self, line: str) -> None:
        """Remove `line`'s record (as login(1) marks it DEAD_PROCESS; removing it reads the same)."""
        data = self.utmp.read_bytes()
        keep = b"".join(data[i:i + UTMP_SIZE] for i in range(0, len(data) - UTMP_SIZE + 1, UTMP_SIZE)
                        if not (parse_utmp(data[i:i + UTMP_SIZE])[0][0] == USER_PROCESS
                                and parse_utmp(data[i:i + UTMP_SIZE])[0][2] == line))
        self.utmp.write_bytes(keep)

    # -- console -----------------------------------------------------------------
    def console_input(self, device: str = "input/event0", ago: float = 0.0) -> None:
        """Keyboard or console input `ago` seconds ago on `device` (under dev/)."""
        path = self.dev / device
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        t = time.time() - ago
        os.utime(path, (t, t))

    # -- load --------------------------------------------------------------------
    def start_busy(self, host: str, *, memory_mib: int = 0) -> int:
        """A real process on simulated host `host` (ELTSIM_HOST) spinning one CPU (and holding
        `memory_mib` MiB resident); returns its pid. `close()` stops it."""
        code = (f"b = bytearray({memory_mib} * 2**20)\n"
                "for i in range(0, len(b), 4096): b[i] = 1\n"
                "while True: pass\n")
        env = {"PATH": os.environ.get("PATH", ""), "ELTSIM_HOST": host}
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._busy.append(proc)
        return proc.pid

    def stop_busy(self) -> None:
        for proc in self._busy:
            proc.kill()
            proc.wait()
        self._busy.clear()

    def close(self) -> None:
        self.stop_busy()

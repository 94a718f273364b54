"""The simulated owner: a real process registered on one demo host's GPU."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

from eltctl.demo.setup import MARKER_ENV, DemoSetup


@dataclass
class Owner:
    """A simulated owner: a real process of this user, registered on one host's GPU.

    The stand-in nvidia-smi lists it on that GPU while it lives (as the driver would),
    so the host's daemon sees a process that is not the job's.
    """

    setup: DemoSetup
    host: str
    gpu: int
    memory_mib: int = 6000
    utilization: int = 90
    pid: int | None = None
    registered_at: float | None = None  # time.time() when nvidia-smi started to list it
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    def arrive(self) -> int:
        from eltctl.sim.gpustate import ForeignProcess, GpuState, process_starttime

        env = {"PATH": "/usr/bin:/bin", MARKER_ENV: str(self.setup.root)}
        self._proc = subprocess.Popen(["sleep", "86400"], env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        self.pid = self._proc.pid
        GpuState(self.setup.gpu_states[self.host], self.host).add_process(ForeignProcess(
            pid=self.pid, gpu=self.gpu, used_memory_mib=self.memory_mib,
            utilization=self.utilization, starttime=process_starttime(self.pid)))
        self.registered_at = time.time()
        return self.pid

    def leave(self) -> None:
        from eltctl.sim.gpustate import GpuState

        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
        if self.pid is not None:
            GpuState(self.setup.gpu_states[self.host], self.host).remove_process(self.pid)

"""The simulated GPUs' state file (eltctl/sim/gpustate.py) is readable by every account
of the host, as a driver's state is, after every change."""

from __future__ import annotations

import stat

from eltctl.sim.gpustate import ForeignProcess, GpuState


def test_the_state_file_stays_readable_by_other_accounts_after_a_change(tmp_path):
    state = GpuState(tmp_path / "gpus.json", "h1")
    state.initialize(2)
    state.add_process(ForeignProcess(pid=4242, gpu=1, used_memory_mib=100, utilization=5, starttime=None))
    assert stat.S_IMODE(state.path.stat().st_mode) == 0o644

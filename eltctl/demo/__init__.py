"""The demo scenario: the real system on this machine, without an SSH server.

`eltctl demo` writes a temporary inventory of a few hosts with `address = "local"`
(the local transport), each with simulated GPUs (`eltctl.sim`: a state file read
by a stand-in `nvidia-smi` put first on that host's PATH), and runs the real
`eltctl up` on the example training with CPU workers. After some steps a simulated
owner (a real process registered on one host's GPU) takes that GPU: the host's
daemon sees it and the job's worker there leaves; later the owner's process ends,
the GPU looks idle for `idle_for`, and the controller lets the job grow back. Then
`eltctl down`, and a summary: steps, each resize with its pause, final loss.

The parts are separate so tests and the owner-yield benchmark reuse them:
`setup.prepare` writes the files (no processes), `owner.Owner` is the simulated
owner, `pids` watches processes, `runner.EltctlRunner` runs eltctl's own commands
against the demo's inventory and private state directory, `summary` holds the pure
predicates on status documents and the closing summary, `runner.sweep` ends every
process the demo started (found by a marker in their environment) and
`scenario.run_demo` is the scenario with its live view.

Everything lives under one temporary directory (its own HOME for the hosts, its
own XDG_STATE_HOME for the controller); it is removed at the end, Ctrl-C included.
"""

from __future__ import annotations

from eltctl.demo.owner import Owner
from eltctl.demo.pids import PidWatch, pid_alive, read_pid_file, wait_pid_exit, worker_pid
from eltctl.demo.runner import EltctlRunner, sweep
from eltctl.demo.scenario import Narrator, Scenario, run_demo, torch_missing_reason
from eltctl.demo.setup import (
    MARKER_ENV,
    OWNER_USER_LABEL,
    DemoError,
    DemoHost,
    DemoPlan,
    DemoSetup,
    example_dir,
    prepare,
    training_command,
)
from eltctl.demo.summary import (
    RESIZE_KINDS,
    DemoSummary,
    Resize,
    events_since,
    has_yielded,
    is_training,
    render_summary,
    resizes,
    summarize,
    yield_figures,
)

__all__ = [
    "MARKER_ENV", "OWNER_USER_LABEL", "RESIZE_KINDS", "DemoError", "DemoHost", "DemoPlan", "DemoSetup",
    "DemoSummary", "EltctlRunner", "Narrator", "Owner", "PidWatch", "Resize", "Scenario", "events_since",
    "example_dir", "has_yielded", "is_training", "pid_alive", "prepare", "read_pid_file", "render_summary",
    "resizes", "run_demo", "summarize", "sweep", "torch_missing_reason", "training_command", "wait_pid_exit",
    "worker_pid", "yield_figures",
]

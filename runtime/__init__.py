"""eltctl's worker-side runtime: elastic data-parallel training in one process.

A training script wraps its model, optimizer and dataset in an `ElasticJob` and
writes an ordinary loop; workers can join and leave at step boundaries, crashes
and hangs shrink the job, and every sample of an epoch is used exactly once.
Needs only the standard library and torch. This folder, `runtime/`, installs as
the package `eltctl_runtime`. See README.md in this directory for the
environment contract, the store keys and the layout; the keys and documents
shared with the controller and the host daemon (`daemon/`) are in protocol.py.

Importing the package is light: the configuration, the wire protocol (store
keys, event kinds and the store helpers: protocol.py) and member/plan.py need
only the standard library; the training machinery
(`ElasticJob`, the sampler) imports torch on first use (PEP 562), so the host
daemon and the control plane start without it. `load_checkpoint` and
`export_checkpoint` (checkpoint/load.py) import torch only when called. Restart
mode's `report` and `checkpoint_saved` (progress.py) are standard library only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .member.config import ConfigError, Device, RuntimeConfig
from .member.plan import Plan, job_store
from .protocol import (
    Desired,
    EventKind,
    Keys,
    append_event,
    read_events,
    read_status,
    report_dead,
    request_leave,
    request_stop,
)

# name -> the submodule that defines it, imported on first access.
_LAZY = {
    "Commit": "train.job", "ElasticJob": "train.job", "ExcludedFromJob": "train.job", "DataLoadError": "train.pipeline",
    "SamplerState": "train.sampler", "epoch_order": "train.sampler", "share_bounds": "train.sampler",
    "load_checkpoint": "checkpoint.load", "export_checkpoint": "checkpoint.load", "OptimizerMismatch": "train.state",
    # restart mode's calls for a torchrun script (stdlib only: no torch)
    "report": "restart.progress", "checkpoint_saved": "restart.progress",
}

if TYPE_CHECKING:
    from .train.job import Commit, ElasticJob, ExcludedFromJob
    from .checkpoint.load import export_checkpoint, load_checkpoint
    from .train.pipeline import DataLoadError
    from .restart.progress import checkpoint_saved, report
    from .train.sampler import SamplerState, epoch_order, share_bounds
    from .train.state import OptimizerMismatch


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Commit", "ConfigError", "DataLoadError", "Desired", "Device", "ElasticJob", "EventKind", "ExcludedFromJob",
    "Keys", "OptimizerMismatch", "Plan", "RuntimeConfig", "SamplerState", "append_event", "checkpoint_saved", "epoch_order",
    "export_checkpoint", "job_store", "load_checkpoint", "read_events", "read_status", "report", "report_dead", "request_leave", "request_stop", "share_bounds",
]

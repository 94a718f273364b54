"""eltctl's worker-side runtime: elastic data-parallel training in one process.

A training script wraps its model, optimizer and dataset in an `ElasticJob` and
writes an ordinary loop; workers can join and leave at step boundaries, crashes
and hangs shrink the job, and every sample of an epoch is used exactly once.
Needs only the standard library and torch. See README.md in this directory for
the environment contract and the store keys.
"""

from .config import ConfigError, Device, RuntimeConfig
from .job import Commit, ElasticJob, ExcludedFromJob
from .membership import (
    EventKind,
    Keys,
    Plan,
    job_store,
    read_events,
    read_status,
    report_dead,
    request_leave,
    request_stop,
)
from .sampler import SamplerState, epoch_order, share_bounds

__all__ = [
    "Commit", "ConfigError", "Device", "ElasticJob", "EventKind", "ExcludedFromJob", "Keys", "Plan", "RuntimeConfig",
    "SamplerState", "epoch_order", "job_store", "read_events", "read_status", "report_dead", "request_leave",
    "request_stop", "share_bounds",
]

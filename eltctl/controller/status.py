"""The job's status as the controller tells it: its phase and the status document.

`next_phase` says which phase the job is in after a pass (pure); `status_document`
builds the document `eltctl status` shows and the controller writes to status.json
and answers on its socket (its shape: docs/control-plane.md); `write_status` writes it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from eltctl.controller import policy as pol
from eltctl.controller.observe import DaemonSeen
from eltctl_runtime.files import write_json_atomic
from eltctl.inventory import Inventory

log = logging.getLogger("eltctl.controller")

EVENTS_SHOWN = 20


class Phase:
    CONNECTING = "connecting"
    PROBING = "probing"
    SHIPPING = "shipping"
    STARTING = "starting"
    WAITING = "waiting"
    TRAINING = "training"
    STOPPING = "stopping"
    STOPPED = "stopped"


def next_phase(phase: str, message: str, *, now: float, inventory: Inventory,
               runtime_status: Mapping | None, views: Mapping[str, pol.HostView],
               records: Mapping[str, pol.HostRecord], decision: pol.Decision,
               starting_daemons: bool) -> tuple[str, str]:
    """The phase and message after a pass that acted on `decision`."""
    rs = runtime_status or {}
    running = sum(len(v.workers) for v in views.values())
    fresh = rs and now - float(rs.get("time", 0)) < max(30.0, 3 * inventory.policy.hang_timeout)
    desired = any(records.get(h.name, pol.HostRecord()).desired for h in inventory.hosts)
    if fresh and int(rs.get("world_size", 0)) > 0 and running:
        return Phase.TRAINING, ""
    if decision.waiting and not running:
        return Phase.WAITING, decision.message
    if decision.message and not running and not desired:
        return Phase.STARTING, decision.message
    if starting_daemons:
        return (Phase.SHIPPING if phase in (Phase.CONNECTING, Phase.PROBING) else phase), message
    if desired:
        return Phase.STARTING, "waiting for the first step" if running else "starting workers"
    return phase, message


def job_state(phase: str) -> str:
    """The job's state in the document: the phase as a person reads it."""
    return {Phase.TRAINING: "training", Phase.WAITING: "waiting", Phase.STOPPING: "stopping",
            Phase.STOPPED: "stopped"}.get(phase, "starting")


def host_entry(view: pol.HostView, record: pol.HostRecord, seen: DaemonSeen | None, now: float) -> dict:
    phase, reason = pol.host_state(view, record, now)
    gpus = [{"index": s.index, "state": "ours" if s.index in view.workers else s.use.value, "reason": s.reason}
            for s in view.slots]
    return {
        "name": view.name, "state": phase.value, "reason": reason, "workers": len(view.workers),
        "heartbeat_age_s": round(now - seen.changed, 2) if seen is not None else None,
        "benched_until": record.benched_until if record.benched_until > now else None,
        "cooldown_until": record.cooldown_until if record.cooldown_until > now else None,
        "failures": record.failures, "desired": list(record.desired), "gpus": gpus,
    }


def status_document(*, now: float, inventory: Inventory, phase: str, message: str,
                    runtime_status: Mapping | None, views: Mapping[str, pol.HostView],
                    records: Mapping[str, pol.HostRecord], seen: Mapping[str, DaemonSeen],
                    events: Iterable[dict], store_endpoint: str, mirror: dict | None) -> dict[str, Any]:
    """The status document (status.json): the job, rank 0's figures, each host, recent events."""
    rs = runtime_status or {}
    job = inventory.job
    ck = rs.get("checkpoint") if isinstance(rs.get("checkpoint"), dict) else None
    hosts = [host_entry(views[h.name], records.get(h.name, pol.HostRecord()), seen.get(h.name), now)
             for h in inventory.hosts]
    return {
        "job": job.name, "state": job_state(phase), "phase": phase, "message": message, "updated": now,
        "generation": rs.get("generation"), "world_size": int(rs.get("world_size") or 0),
        "members": rs.get("members", []),
        "min_workers": job.min_workers, "max_workers": job.max_workers,
        "step": rs.get("step"), "epoch": rs.get("epoch"), "samples_per_s": rs.get("samples_per_s"),
        "loss": rs.get("loss"),
        "checkpoint": ({"step": ck.get("step"), "time": ck.get("time"), "path": ck.get("path"),
                        "age_s": round(now - float(ck["time"]), 1) if ck.get("time") else None}
                       if ck else None),
        "runtime_status_age_s": round(now - float(rs["time"]), 2) if rs.get("time") else None,
        "controller": {"pid": os.getpid(), "alive": True},
        "store": store_endpoint,
        "hosts": hosts,
        "events": list(events)[-EVENTS_SHOWN:],
        "mirror": mirror,
    }


def write_status(path: Path, document: dict) -> None:
    """status.json, replaced whole (a reader never sees half a document)."""
    try:
        write_json_atomic(path, document, mkdir=True, sync=False)  # rewritten every second
    except OSError as exc:
        log.warning("Cannot write %s: %s", path, exc)

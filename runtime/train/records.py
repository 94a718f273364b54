"""What the job records of its training for eltctl: the status document's training
fields, the generation's event and the audit log.

Rank 0 writes the status (at most every `STATUS_EVERY_S` from its commits, and at
the job's end or pause) and each generation's event, through its session's
`Reporter` (member/report.py), which adds what every member's report has; this
module adds the training's own fields: the step, epoch and position, the samples
per second since the last status, the loss, each member's share and speed, the
progress towards the end, where the step's time goes (`NetworkFigures`: rank 0's
compute and network wait, smoothed, and the bytes it all-reduces per step) and,
sharded, the mode, replicas, optimizer-state bytes and steps redone. The audit log (`RuntimeConfig.audit_path`) is one JSON line per
committed step from every rank: which samples it took (tests check that every
sample is taken once per epoch across resizes).

`JobStatus` and `AuditLog` belong to one ElasticJob and read from it (`job`, not
imported here: job.py imports this module); the commit updates `JobStatus`'s
counters by attribute and calls the audit log only where one is open.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..member.plan import Plan
from ..member.report import generation_event
from ..protocol import EventKind

STATUS_EVERY_S = 1.0
NETWORK_ALPHA = 0.2  # the weight of each new step in NetworkFigures' moving averages


class NetworkFigures:
    """Where this rank's steps' time goes, smoothed (an exponentially weighted moving
    average, NETWORK_ALPHA): `compute_s`, from each batch handed to the script to the
    end of its backward (Shares.compute_s, summed over the micro-batches); `wait_s`,
    the time the gradient path's `finish` waited for the all-reduces after backward
    (gradients.StepTiming: what overlapping them with backward did not hide);
    `bytes_per_step`, the last step's bytes into all-reduces. `share` is
    wait / (compute + wait); `mode`, with local steps (local.py), `{"mode": "local",
    "sync_every": H}`, merged into the same `network`. Pure: the commit feeds it, the
    status reads `fields`."""

    __slots__ = ("compute_s", "wait_s", "bytes_per_step", "mode")

    def __init__(self) -> None:
        self.compute_s: float | None = None
        self.wait_s: float | None = None
        self.bytes_per_step: int | None = None
        self.mode: dict | None = None  # local steps (local.py): {"mode": "local", "sync_every": H}

    def observed(self, compute_s: float, timing: Any) -> None:
        """One committed step: its compute seconds and the path's StepTiming (None: the
        path does not measure, e.g. sharded; nothing is recorded)."""
        if timing is None:
            return
        if self.wait_s is None or self.compute_s is None:
            self.compute_s, self.wait_s = compute_s, timing.wait_s
        else:
            self.compute_s += NETWORK_ALPHA * (compute_s - self.compute_s)
            self.wait_s += NETWORK_ALPHA * (timing.wait_s - self.wait_s)
        self.bytes_per_step = timing.bytes

    def fields(self) -> dict:
        """The status document's `network` (protocol.NETWORK_FIELDS), or {} before a step."""
        if self.wait_s is None or self.compute_s is None:
            return {}
        step = self.compute_s + self.wait_s
        share = self.wait_s / step if step > 0 else 0.0
        return {"network": {"wait_s": round(self.wait_s, 6), "compute_s": round(self.compute_s, 6),
                            "share": round(min(1.0, max(0.0, share)), 4), "bytes_per_step": self.bytes_per_step,
                            **(self.mode or {})}}


class JobStatus:
    """The status document's training fields (module docstring). `samples_since`:
    (samples committed, monotonic time) since the last status; `last_loss`: the last
    committed step's global loss; `network`: where the steps' time goes. The commit
    updates all three."""

    __slots__ = ("samples_since", "last_loss", "network")

    def __init__(self, now: float) -> None:
        self.samples_since = (0, now)
        self.last_loss: float | None = None
        self.network = NetworkFigures()

    def write(self, job: Any, now: float, paused: bool = False) -> None:
        n, since = self.samples_since
        rate = n / (now - since) if now > since else 0.0
        self.samples_since = (0, now)
        job._session.report.status(now, step=job._step, epoch=job._sampler.epoch,
                                   position=job._sampler.position, samples_per_s=round(rate, 2),
                                   loss=self.last_loss, workers=workers_report(job), paused=paused,
                                   extra={**progress_fields(job), **self.network.fields(),
                                          **(shard_fields(job) if job._shard is not None else {})})


def progress_fields(job: Any) -> dict:
    """`eltctl status`'s progress: total_steps and samples (sampler.TrainingEnd.progress)."""
    return job._end.progress(job._sampler)


def shard_fields(job: Any) -> dict:
    """Sharded training in the status document and the events: the mode, the
    replicas, each rank's optimizer-state bytes (from the layout) and the steps
    redone after crashes that lost shards."""
    return {"shard": job._shard, "shard_replicas": job._grads.replicas,
            "optimizer_state_bytes": job._grads.state_bytes_per_rank(),
            "redone_steps": job._agreement.redone_steps or 0}


def workers_report(job: Any) -> dict | None:
    """Each member's share and speed as of the last commit (balance.worker_report)."""
    return job._shares.report(job._plan.members, job._sampler.global_batch)


def note_generation_event(job: Any, plan: Plan, restored: bool) -> dict:
    """The new generation's event, held in the pause (pause.py) until its first commit,
    which rank 0 writes: every generation's first commit is an event, the job's first
    start too. Counts the steps a restore redoes (StateAgreement.redo_from)."""
    a = job._agreement
    kind = EventKind.RESTORE if restored else plan.kind
    redo_from, a.redo_from = a.redo_from, None
    if redo_from is not None:
        a.redone_steps = (a.redone_steps or 0) + max(0, redo_from - job._step)
    ev = job._pause.event = generation_event(kind, plan, from_step=job._step,
                                             old_t=job._pause.old_t if a.has_state_before else None)
    if job._shard is not None:
        ev.update(shard_fields(job))
        if redo_from is not None:
            ev["redone_steps"] = max(0, redo_from - job._step)
    return ev


class AuditLog:
    """The audit file (module docstring), opened for appending; one line per commit."""

    __slots__ = ("fd",)

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def committed(self, job: Any) -> None:
        """The step `job` just committed: its samples on this rank and in the whole step."""
        line = json.dumps({"step": job._step, "epoch": job._sampler.epoch, "generation": job.generation,
                           "world_size": job.world_size, "rank": job._rank, "worker": job.worker_id,
                           "indices": job._flight.indices, "step_indices": job._flight.global_indices,
                           "split": job._shares.last_counts}) + "\n"
        os.write(self.fd, line.encode())

    def close(self) -> None:
        os.close(self.fd)

"""The executor's records of its worker processes (`Worker`), and where they come
from besides a start: adoption of the workers an earlier daemon of this job and host
left running (`adopt`), and, once one ended, the line of its log that says why (`cause`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Collection

from .. import files
from ..pids import read_pid_file
from . import procs
from .forkserver import Forked
from .history import process_start
from .logic import TAIL_BYTES, WorkerState, WorkerView, cause_line, incarnation_of

log = logging.getLogger("eltctl_runtime.daemon")


@dataclass
class Worker:
    """The executor's record of one worker process (mutable: it is bookkeeping)."""

    slot: int
    worker_id: str
    pid: int
    proc: subprocess.Popen | Forked | None  # Forked: by the fork server; None: adopted (no exit status)
    state: WorkerState
    since: float  # monotonic
    since_wall: float
    detail: str = ""
    gone_since: float | None = None  # monotonic: when an adopted worker was first seen gone
    log_offset: int = 0  # the size of its log when it started: its own output begins there
    start_wall: float = 0.0  # when its process started (wall clock): the usage ledger's start

    def view(self) -> WorkerView:
        return WorkerView(self.slot, self.worker_id, self.pid, self.state, self.since)

    def to_dict(self) -> dict:
        return {"slot": self.slot, "worker_id": self.worker_id, "pid": self.pid, "state": self.state.value,
                "since": round(self.since_wall, 3), "adopted": self.proc is None, "detail": self.detail,
                "start": round(self.start_wall or self.since_wall, 3)}


def adopt(workers_dir: Path, job: str, host: str, leaving: Collection[str]) -> tuple[dict[int, Worker], int]:
    """Take over the workers an earlier daemon of this job and host left running: the
    workers by slot, and the highest incarnation among them (0: none)."""
    workers: dict[int, Worker] = {}
    highest = 0
    for pid_file in sorted(workers_dir.glob("*.pid")):
        if not pid_file.stem.isdigit():
            continue
        slot = int(pid_file.stem)
        pid = read_pid_file(pid_file)
        wid = procs.worker_identity(pid, job) if pid else None
        if wid is None or not wid.startswith(f"{host}/{slot}/"):
            log.info("host %s: %s names no live worker of this job (pid %s); removing it", host,
                     pid_file.name, pid)
            files.remove(pid_file)
            continue
        state = WorkerState.LEAVING if wid in leaving else WorkerState.RUNNING
        workers[slot] = Worker(slot, wid, pid, None, state, time.monotonic(), time.time(),
                               detail="adopted", start_wall=process_start(pid) or time.time())
        highest = max(highest, incarnation_of(wid) or 0)
        log.info("host %s: adopted worker %s (pid %d) on slot %d, %s", host, wid, pid, slot,
                 state.value)
    # A daemon killed between starting a worker and writing its pid file leaves
    # a worker without one: find it by its environment.
    known = {w.pid for w in workers.values()}
    for pid, wid in procs.session_leaders_of(job, f"{host}/").items():
        parts = wid.split("/")
        if pid in known or len(parts) < 3 or not parts[-2].isdigit() or int(parts[-2]) in workers:
            continue
        slot = int(parts[-2])
        state = WorkerState.LEAVING if wid in leaving else WorkerState.RUNNING
        workers[slot] = Worker(slot, wid, pid, None, state, time.monotonic(), time.time(),
                               detail="adopted", start_wall=process_start(pid) or time.time())
        files.write_atomic(workers_dir / f"{slot}.pid", f"{pid}\n")
        highest = max(highest, incarnation_of(wid) or 0)
        log.info("host %s: adopted worker %s (pid %d) on slot %d, found without a pid file", host,
                 wid, pid, slot)
    return workers, highest


def cause(workers_dir: Path, w: Worker) -> str:
    """The line of its log (from where its own output began) that says why it ended."""
    path = workers_dir / f"{w.slot}.log"
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = w.log_offset if w.proc is not None and w.log_offset <= size else 0
            f.seek(max(start, size - TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return cause_line(text)

"""The job's status as a person sees it: where the status document comes from, and
how it is drawn.

The controller keeps the job's status document (docs/control-plane.md, "The status
document") in `status.json` in the job's state directory and answers it on its
command socket. `read_snapshot` asks the live controller first (the freshest
answer, and the proof that it is alive) and falls back to the file, which then
shows the last state the controller saw; `render_status` is a pure function of
that snapshot and a clock, so exact-output tests draw fixed documents.

The hosts table fits the console it is drawn on (`HostsView`): from WIDE_MIN_WIDTH
(120) columns on, every GPU with its full reason; narrower, one line per GPU in few
words (`gpu_brief`) and nothing wrapped. `render_host` draws one host's full entry
(`eltctl status HOST`); `failed_workers` says which of a host's workers failed
(`eltctl logs HOST --failed`).

The package: `snapshot` (where it comes from), `formatting` (values, styles, the view's
options), `job` (the job's facts), `workers` (each member's share and speed, once the
runtime reports them), `hosts` (the hosts table, wide or compact), `host`
(one host whole; failed workers), `events` (the events table); `render_status` below
puts them together. Nothing here imports torch or asyncssh: `eltctl status` must stay cheap.
"""

from __future__ import annotations

from typing import Any

from eltctl.statusview.events import describe_event, events_table, host_events
from eltctl.statusview.formatting import (
    EVENTS_SHOWN,
    ViewOptions,
    format_age,
    format_clock,
    format_pause,
    utc,
)
from eltctl.statusview.host import FAILED_WORKER_STATES, daemon_table, failed_workers, find_host, render_host
from eltctl.statusview.hosts import WIDE_MIN_WIDTH, HostsView, gpu_brief, host_notes, hosts_table, hosts_table_compact
from eltctl.statusview.job import fairshare_line, forged_line, job_summary, mirror_line, notify_line
from eltctl.statusview.workers import worker_note, workers_table
from eltctl.statusview.snapshot import (
    CONTROLLER_DOWN,
    SOCKET_FILE,
    SOCKET_TIMEOUT_S,
    STATUS_FILE,
    NoJobError,
    Snapshot,
    Source,
    job_state_dir,
    read_snapshot,
    read_status_file,
)

__all__ = [
    "CONTROLLER_DOWN", "EVENTS_SHOWN", "FAILED_WORKER_STATES", "SOCKET_FILE", "SOCKET_TIMEOUT_S", "STATUS_FILE",
    "WIDE_MIN_WIDTH", "HostsView", "NoJobError", "Snapshot", "Source", "ViewOptions", "daemon_table",
    "describe_event", "events_table", "failed_workers", "fairshare_line", "find_host", "forged_line", "format_age", "format_clock",
    "format_pause",
    "gpu_brief", "host_events", "host_notes", "hosts_table", "hosts_table_compact", "job_state_dir", "job_summary",
    "mirror_line", "notify_line", "read_snapshot", "read_status_file", "render_host", "render_status", "utc",
    "worker_note",
    "workers_table",
]


def render_status(snapshot: Snapshot, options: ViewOptions):
    """The whole view: the job, its workers' shares (when reported), its hosts, the
    recent events. A rich renderable."""
    from rich.console import Group

    parts: list[Any] = []
    if options.title:
        parts.append(options.title)
    parts.extend(options.extra)
    parts.append(job_summary(snapshot, options))
    workers = workers_table(snapshot.document)
    if workers is not None:
        parts.append(workers)
    parts.append(HostsView(snapshot.document, options))
    parts.append(events_table(snapshot.document, options))
    return Group(*parts)

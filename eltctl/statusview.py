"""The job's status as a person sees it: where the status document comes from, and
how it is drawn.

The controller keeps the job's status document (docs/control-plane.md, "The status
document") in `status.json` in the job's state directory and answers it on its
command socket. `read_snapshot` asks the live controller first (the freshest
answer, and the proof that it is alive) and falls back to the file, which then
shows the last state the controller saw; `render_status` is a pure function of
that snapshot and a clock, so exact-output tests draw fixed documents.

Nothing here imports torch or asyncssh: `eltctl status` must stay cheap.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone, tzinfo
from pathlib import Path
from typing import Any, Mapping

from eltctl.controller.statedir import SOCKET_NAME
from eltctl.errors import EltctlError

STATUS_FILE = "status.json"
SOCKET_FILE = SOCKET_NAME
SOCKET_TIMEOUT_S = 3.0  # the controller answers from memory; longer means it is wedged
EVENTS_SHOWN = 8

CONTROLLER_DOWN = "controller not running: `eltctl up` restarts it, workers keep training"


class Source(str, enum.Enum):
    """Where a snapshot's document came from."""

    CONTROLLER = "controller"  # answered by the live controller on control.sock
    FILE = "file"  # status.json: the controller is not answering, the document may be old


@dataclass(frozen=True)
class Snapshot:
    """One status document, where it came from and when it was read."""

    document: Mapping[str, Any]
    source: Source
    read_at: float  # time.time() when it was read
    why_file: str = ""  # why the controller was not asked or did not answer

    @property
    def controller_alive(self) -> bool:
        return self.source is Source.CONTROLLER

    def as_json(self) -> dict[str, Any]:
        """The document as `--json` prints it: the controller's own fields, with
        `controller.alive` saying what was observed now (a stale file says `true`)."""
        doc = dict(self.document)
        controller = dict(doc.get("controller") or {})
        controller["alive"] = self.controller_alive
        doc["controller"] = controller
        return doc


class NoJobError(EltctlError):
    """No status of this job exists on this machine (never started here, or `down` cleaned up)."""

    exit_code = 1


# --------------------------------------------------------------------------- where it comes from


def job_state_dir(job: str, environ: Mapping[str, str]) -> Path:
    """`${XDG_STATE_HOME:-~/.local/state}/eltctl/<job>/`: the controller's directory."""
    from eltctl.controller.statedir import StateDir  # light: the commands use it too

    return StateDir.for_job(job, environ).path


def read_status_file(state_dir: Path) -> dict[str, Any] | None:
    """status.json, or None when there is none (or it is not a JSON object)."""
    try:
        with open(state_dir / STATUS_FILE, encoding="utf-8") as f:
            doc = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return None  # written atomically, so unreadable means not ours or not yet
    return doc if isinstance(doc, dict) else None


def read_snapshot(job: str, state_dir: Path, *, clock=time.time,
                  timeout: float = SOCKET_TIMEOUT_S) -> Snapshot:
    """The freshest status of `job`: the live controller's answer, else status.json.

    Raises NoJobError when neither exists.
    """
    why = "no control.sock"
    if (state_dir / SOCKET_FILE).exists():
        try:
            from eltctl.controller.socket import request

            answer = request(state_dir / SOCKET_FILE, {"op": "status"}, timeout=timeout)
        except (OSError, ValueError) as exc:
            why = f"control.sock: {exc}"
        else:
            if answer.get("ok", True) is not False and "job" in answer:
                return Snapshot(answer, Source.CONTROLLER, clock())
            why = f"control.sock answered {json.dumps(answer)[:200]}"
    doc = read_status_file(state_dir)
    if doc is None:
        raise NoJobError(
            f"no status of job {job!r} on this machine (nothing in {state_dir})",
            hint="`eltctl up` starts the job; status reads the state the controller keeps here")
    return Snapshot(doc, Source.FILE, clock(), why_file=why)


# --------------------------------------------------------------------------- drawing

JOB_STATE_STYLE = {"starting": "cyan", "waiting": "yellow", "training": "bold green",
                   "stopping": "yellow", "stopped": "dim"}
HOST_STATE_STYLE = {"running": "green", "starting": "cyan", "idle": "white", "busy": "red",
                    "cooldown": "yellow", "benched": "magenta", "removed": "dim",
                    "unreachable": "red", "unhealthy": "yellow"}
GPU_STATE_STYLE = {"ours": "blue", "free": "green", "busy": "red"}
EVENT_STYLE = {"yield": "bold yellow", "crash": "bold red", "hang": "red", "join": "green",
               "leave": "cyan", "bench": "magenta", "stop": "dim", "remove": "dim", "add": "green"}


def format_age(seconds: float | None) -> str:
    """A short human duration: 0.4 s, 12 s, 3 min 05 s, 2 h 03 min."""
    if seconds is None:
        return "?"
    s = max(0.0, float(seconds))
    if s < 10:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        m, r = divmod(int(s), 60)
        return f"{m} min {r:02d} s"
    h, r = divmod(int(s) // 60, 60)
    return f"{h} h {r:02d} min"


def format_pause(seconds: float | None) -> str:
    """A pause of the job: milliseconds matter below a second."""
    if seconds is None:
        return ""
    s = float(seconds)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.2f} s"
    return format_age(s)


def format_clock(t: float | None, tz: tzinfo | None) -> str:
    if t is None:
        return "?"
    return datetime.fromtimestamp(float(t), tz).strftime("%H:%M:%S")


def _show(value: Any) -> str:
    """A field of the document as text; `-` where it is unknown (null or missing)."""
    return "-" if value is None else str(value)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class ViewOptions:
    """How to draw: the clock and the time zone are parameters so tests are exact."""

    now: float
    tz: tzinfo | None = None  # None: local time
    events: int = EVENTS_SHOWN
    title: str = ""  # e.g. the demo's narration above the job
    extra: tuple[str, ...] = field(default_factory=tuple)  # lines (rich markup) after the title


def render_status(snapshot: Snapshot, options: ViewOptions):
    """The whole view: the job, its hosts, the recent events. A rich renderable."""
    from rich.console import Group

    parts: list[Any] = []
    if options.title:
        parts.append(options.title)
    parts.extend(options.extra)
    parts.append(job_summary(snapshot, options))
    parts.append(hosts_table(snapshot.document, options))
    parts.append(events_table(snapshot.document, options))
    return Group(*parts)


def job_summary(snapshot: Snapshot, options: ViewOptions):
    """Two columns of facts about the job, and the controller line."""
    from rich.markup import escape
    from rich.table import Table

    doc = snapshot.document
    now = options.now
    updated = _num(doc.get("updated"))
    staleness = max(0.0, now - updated) if updated is not None else 0.0

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    state = str(doc.get("state", "?"))
    state_text = f"[{JOB_STATE_STYLE.get(state, 'white')}]{escape(state)}[/]"
    message = str(doc.get("message") or "")
    if message:
        state_text += f" [dim]({escape(message)})[/]"
    grid.add_row("job", f"[bold]{escape(str(doc.get('job', '?')))}[/] {state_text}")

    lo, hi = doc.get("min_workers"), doc.get("max_workers")
    bounds = f"min {_show(lo)}, max {hi if hi is not None else 'any'}"
    grid.add_row("workers", f"{_show(doc.get('world_size'))} ({bounds})"
                            f"   generation {_show(doc.get('generation'))}")

    progress = f"step {_show(doc.get('step'))}"
    if doc.get("epoch") is not None:
        progress += f"   epoch {doc.get('epoch')}"
    sps = _num(doc.get("samples_per_s"))
    if sps is not None:
        progress += f"   {sps:,.1f} samples/s"
    loss = _num(doc.get("loss"))
    if loss is not None:
        progress += f"   loss {loss:.4g}"
    grid.add_row("progress", progress)

    ckpt = doc.get("checkpoint")
    if isinstance(ckpt, dict) and ckpt.get("step") is not None:
        t = _num(ckpt.get("time"))
        age = now - t if t is not None else (
            _num(ckpt.get("age_s")) + staleness if _num(ckpt.get("age_s")) is not None else None)
        grid.add_row("checkpoint", f"step {ckpt.get('step')}, {format_age(age)} ago")
    else:
        grid.add_row("checkpoint", "[dim]none yet[/]")

    mirror = mirror_line(doc.get("mirror"), now, staleness)
    if mirror is not None:
        grid.add_row("mirror", mirror)

    controller = doc.get("controller") if isinstance(doc.get("controller"), dict) else {}
    pid = controller.get("pid")
    if snapshot.controller_alive:
        line = f"running (pid {pid})" if pid is not None else "running"
        line += f", status {format_age(staleness)} old"
    else:
        line = (f"[bold yellow]{escape(CONTROLLER_DOWN)}[/]\n"
                f"[dim]showing the last status it wrote, {format_age(staleness)} old[/]")
    grid.add_row("controller", line)
    return grid


def mirror_line(mirror: Any, now: float, staleness: float = 0.0) -> str | None:
    """The `mirror` row: target, newest mirrored step and its age, lag, last error
    (None when the job has no `[storage] mirror`)."""
    from rich.markup import escape

    if not isinstance(mirror, dict):
        return None
    line = escape(str(mirror.get("target", "?")))
    if mirror.get("step") is None:
        line += ": [dim]nothing mirrored yet[/]"
    else:
        t = _num(mirror.get("time"))
        age = now - t if t is not None else (
            _num(mirror.get("age_s")) + staleness if _num(mirror.get("age_s")) is not None else None)
        line += f": step {mirror.get('step')}, {format_age(age)} old"
    lag = mirror.get("lag_steps")
    if isinstance(lag, int):
        line += "   [green]up to date[/]" if lag == 0 else f"   [yellow]{lag} steps behind[/]"
    if mirror.get("last_error"):
        line += f"\n[red]last error: {escape(str(mirror['last_error']))}[/]"
    return line


def _gpu_lines(host: Mapping[str, Any]) -> str:
    from rich.markup import escape

    lines = []
    for gpu in host.get("gpus") or []:
        state = str(gpu.get("state", "?"))
        text = f"{gpu.get('index', '?')} [{GPU_STATE_STYLE.get(state, 'white')}]{escape(state)}[/]"
        if gpu.get("reason"):
            text += f" [dim]{escape(str(gpu['reason']))}[/]"
        lines.append(text)
    return "\n".join(lines) or "[dim]no GPUs (CPU slots)[/]"


def hosts_table(doc: Mapping[str, Any], options: ViewOptions):
    """One row per host: daemon state, heartbeat age, GPUs, and why it is not used."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    updated = _num(doc.get("updated"))
    staleness = max(0.0, options.now - updated) if updated is not None else 0.0
    table = Table(header_style="bold", expand=False, box=box.SIMPLE_HEAD)
    table.add_column("host", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("workers", justify="right", no_wrap=True)
    table.add_column("heartbeat", justify="right", no_wrap=True)
    table.add_column("GPUs", overflow="fold")
    table.add_column("note", overflow="fold", min_width=20)
    hosts = doc.get("hosts") or []
    for host in hosts:
        state = str(host.get("state", "?"))
        hb = _num(host.get("heartbeat_age_s"))
        heartbeat = format_age(hb + staleness) if hb is not None else "-"
        notes = []
        if host.get("reason"):
            notes.append(escape(str(host["reason"])))
        for key, what in (("benched_until", "benched"), ("cooldown_until", "cooling down")):
            until = _num(host.get(key))
            if until is not None and until > options.now:
                notes.append(f"{what} until {format_clock(until, options.tz)} "
                             f"(in {format_age(until - options.now)})")
        failures = host.get("failures")
        if isinstance(failures, int) and failures > 0:
            notes.append(f"{failures} failure(s) in a row")
        table.add_row(f"[bold]{escape(str(host.get('name', '?')))}[/]",
                      f"[{HOST_STATE_STYLE.get(state, 'white')}]{escape(state)}[/]",
                      str(host.get("workers", 0)), heartbeat, _gpu_lines(host), "\n".join(notes))
    if not hosts:
        table.add_row("[dim]no hosts[/]", "", "", "", "", "")
    return table


def describe_event(event: Mapping[str, Any]) -> tuple[str, str]:
    """(host, detail) of an event. The runtime's membership events name workers, not
    hosts (`joined`, `left`, `lost`: ids `<host>/<slot>/<n>`), so both are derived."""
    moved = {k: [str(w) for w in event.get(k) or []] for k in ("joined", "left", "lost")}
    host = str(event.get("host") or "")
    if not host:
        ids = [w for ws in moved.values() for w in ws] or [str(w) for w in event.get("workers") or []]
        host = ", ".join(dict.fromkeys(w.split("/", 1)[0] for w in ids))
    detail = str(event.get("detail") or "")
    if not detail:
        parts = [f"{k} {', '.join(ws)}" for k, ws in moved.items() if ws]
        if not parts and event.get("workers"):
            parts.append(", ".join(map(str, event["workers"])))
        if event.get("world_size") is not None:
            parts.append(f"now {event['world_size']} worker(s)")
        detail = "; ".join(parts)
    return host, detail


def events_table(doc: Mapping[str, Any], options: ViewOptions):
    """The last few events, oldest first, with the pause each cost the job."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    events = [e for e in (doc.get("events") or []) if isinstance(e, dict)]
    shown = events[-options.events:] if options.events > 0 else []
    table = Table(header_style="bold", expand=False, box=box.SIMPLE_HEAD,
                  title=f"recent events ({len(shown)} of {len(events)})", title_justify="left",
                  title_style="bold")
    table.add_column("time", no_wrap=True)
    table.add_column("event", no_wrap=True)
    table.add_column("host", no_wrap=True)
    table.add_column("pause", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for e in shown:
        kind = str(e.get("kind", "?"))
        host, detail = describe_event(e)
        table.add_row(format_clock(_num(e.get("time")), options.tz),
                      f"[{EVENT_STYLE.get(kind, 'white')}]{escape(kind)}[/]",
                      escape(host), format_pause(_num(e.get("pause_s"))), escape(detail))
    if not shown:
        table.add_row("[dim]none yet[/]", "", "", "", "")
    return table


def utc() -> tzinfo:
    return timezone.utc

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

Nothing here imports torch or asyncssh: `eltctl status` must stay cheap.
"""

from __future__ import annotations

import enum
import json
import re
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
    layout: str = "auto"  # "wide", "compact", or "auto": wide from WIDE_MIN_WIDTH columns on


def render_status(snapshot: Snapshot, options: ViewOptions):
    """The whole view: the job, its hosts, the recent events. A rich renderable."""
    from rich.console import Group

    parts: list[Any] = []
    if options.title:
        parts.append(options.title)
    parts.extend(options.extra)
    parts.append(job_summary(snapshot, options))
    parts.append(HostsView(snapshot.document, options))
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


_WORKER_ID = re.compile(r"\S+/\d+/(\d+)")
_PROCESS_USER = re.compile(r"pid \d+(?: [^()]*?)? \(([^()]+)\)")  # probe: "pid 999 python (alice)"
_USER_PID = re.compile(r"^([\w.@-]+) \(pid \d+\)")  # "alice (pid 999): ..."
_OURS_PID = re.compile(r"\bpid (\d+)")
_MIB_USED = re.compile(r"^(\d+)(?: of \d+)? MiB used")  # probe: busy by memory, no process listed
_UTIL = re.compile(r"^(\d+)% utilisation")


def gpu_brief(gpu: Mapping[str, Any]) -> str:
    """A GPU in a few words, for the compact layout: `0 ours w3`, `1 busy alice`, `2 free`.

    Who holds it, shortened: our worker's incarnation (`w<n>` of `<host>/<slot>/<n>`), a
    busy GPU's owners (the users the probe names), else the reason's first words (the
    full reason is in `eltctl status HOST`)."""
    state = str(gpu.get("state", "?"))
    reason = str(gpu.get("reason") or "")
    who = ""
    if state == "ours":
        m = _WORKER_ID.search(reason)
        pid = _OURS_PID.search(reason)
        who = f"w{m.group(1)}" if m else f"pid {pid.group(1)}" if pid else ""
    elif state == "busy":
        users = list(dict.fromkeys(_PROCESS_USER.findall(reason)))
        m = _USER_PID.match(reason)
        mem, util = _MIB_USED.search(reason), _UTIL.search(reason)
        who = (", ".join(users) if users else m.group(1) if m else f"{mem.group(1)} MiB" if mem
               else f"{util.group(1)}%" if util else reason)
    elif state != "free":
        who = reason
    return " ".join(f"{gpu.get('index', '?')} {state} {who}".split())  # one line, whatever the reason holds


def host_notes(host: Mapping[str, Any], options: ViewOptions, *, brief: bool = False) -> list[str]:
    """Why a host is as it is: its reason, benching or cooldown, failures in a row.
    `brief`: few words each (the compact layout), plain text."""
    notes = []
    if host.get("reason"):
        notes.append(str(host["reason"]))
    for key, what in (("benched_until", "benched"), ("cooldown_until", "cooling down")):
        until = _num(host.get(key))
        if until is not None and until > options.now:
            if brief:
                notes.append(f"{what} {format_age(until - options.now)}")
            else:
                notes.append(f"{what} until {format_clock(until, options.tz)} "
                             f"(in {format_age(until - options.now)})")
    failures = host.get("failures")
    if isinstance(failures, int) and failures > 0:
        notes.append(f"{failures} failure(s)" if brief else f"{failures} failure(s) in a row")
    return notes


def _heartbeat(host: Mapping[str, Any], staleness: float) -> str:
    hb = _num(host.get("heartbeat_age_s"))
    return format_age(hb + staleness) if hb is not None else "-"


def _staleness(doc: Mapping[str, Any], now: float) -> float:
    updated = _num(doc.get("updated"))
    return max(0.0, now - updated) if updated is not None else 0.0


WIDE_MIN_WIDTH = 120  # from this many columns on, the hosts table shows every GPU's full reason


class HostsView:
    """The hosts table, laid out for the console it is drawn on: wide (full reasons)
    from WIDE_MIN_WIDTH columns on, else compact (one line per GPU, nothing wraps)."""

    def __init__(self, doc: Mapping[str, Any], options: ViewOptions) -> None:
        self.doc, self.options = doc, options

    def wide(self, width: int) -> bool:
        if self.options.layout in ("wide", "compact"):
            return self.options.layout == "wide"
        return width >= WIDE_MIN_WIDTH

    def __rich_console__(self, console, options):
        if self.wide(options.max_width):
            yield hosts_table(self.doc, self.options)
        else:
            yield hosts_table_compact(self.doc, self.options, options.max_width)


def hosts_table(doc: Mapping[str, Any], options: ViewOptions):
    """One row per host: daemon state, heartbeat age, GPUs, and why it is not used."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    staleness = _staleness(doc, options.now)
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
        table.add_row(f"[bold]{escape(str(host.get('name', '?')))}[/]",
                      f"[{HOST_STATE_STYLE.get(state, 'white')}]{escape(state)}[/]",
                      str(host.get("workers", 0)), _heartbeat(host, staleness), _gpu_lines(host),
                      "\n".join(escape(n) for n in host_notes(host, options)))
    if not hosts:
        table.add_row("[dim]no hosts[/]", "", "", "", "", "")
    return table


COMPACT_HOST_WIDTH = 14  # a longer host name is cut with an ellipsis (in full: `status HOST`)
COMPACT_GPU_WIDTH = 16
NOTE_MIN = 20
NOTE_LINES = 3  # a host's note takes the lines of its GPUs, and at least this many


def hosts_table_compact(doc: Mapping[str, Any], options: ViewOptions, width: int = 80):
    """The hosts for a narrow terminal (`width` columns): one line per GPU (`0 ours w3`,
    `1 busy alice`), the host's note beside them (in the lines its GPUs take, at least NOTE_LINES); every column has a
    fixed width, and what does not fit is cut with an ellipsis, never wrapped.
    `eltctl status HOST` shows a host's full entry."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    staleness = _staleness(doc, options.now)
    hosts = [h for h in doc.get("hosts") or [] if isinstance(h, dict)]
    rows = []
    for host in hosts:
        state = str(host.get("state", "?"))
        gpus = []
        for gpu in host.get("gpus") or []:
            line = Text(gpu_brief(gpu))
            gstate = str(gpu.get("state", "?"))
            start = len(str(gpu.get("index", "?"))) + 1
            line.stylize(GPU_STATE_STYLE.get(gstate, "white"), start, start + len(gstate))
            gpus.append(line)
        rows.append((Text(str(host.get("name", "?")), style="bold"),
                     Text(state, style=HOST_STATE_STYLE.get(state, "white")),
                     Text(str(host.get("workers", 0))), Text(_heartbeat(host, staleness)),
                     gpus or [Text("CPU slots", style="dim")],
                     Text("; ".join(host_notes(host, options, brief=True)))))

    def fit(i: int, header: str, cap: int | None = None) -> int:
        longest = max([len(header)] + [max((t.cell_len for t in r[i]), default=0) if isinstance(r[i], list)
                                       else r[i].cell_len for r in rows])
        return min(longest, cap) if cap else longest

    widths = [fit(0, "host", COMPACT_HOST_WIDTH), fit(1, "state"), fit(2, "wk"), fit(3, "beat"),
              fit(4, "GPUs", COMPACT_GPU_WIDTH)]
    overhead = 2 + 5 + 6  # the box's edges, the dividers, one padding (right) per column
    # The note gets what is left, at least NOTE_MIN: GPUs, then host names, give way first.
    for i, floor in ((0, 10), (4, 12)):
        excess = sum(widths) + overhead + NOTE_MIN - width
        if excess > 0:
            widths[i] = max(min(widths[i], floor), widths[i] - excess)
    note_w = max(NOTE_MIN, width - overhead - sum(widths))
    table = Table(header_style="bold", expand=False, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0),
                  caption="full reasons: eltctl status HOST" if hosts else None,
                  caption_justify="left", caption_style="dim")
    for header, w, justify in zip(("host", "state", "wk", "beat", "GPUs", "note"), widths + [note_w],
                                  ("left", "left", "right", "right", "left", "left")):
        table.add_column(header, justify=justify, no_wrap=True, overflow="ellipsis", width=w)
    for name, state, workers, beat, gpus, note in rows:
        for t in (name, *gpus):
            t.no_wrap, t.overflow = True, "ellipsis"
        table.add_row(name, state, workers, beat, Text("\n").join(gpus), _fold_into(note, note_w, max(len(gpus), NOTE_LINES)))
    if not hosts:
        table.add_row(Text("no hosts", style="dim"), "", "", "", "", "")
    return table


def _fold_into(text, width: int, height: int):
    """`text` folded into at most `height` lines of `width` cells (the lines its host's
    GPUs take anyway), the last one cut with an ellipsis if it does not fit."""
    import textwrap

    from rich.text import Text

    lines = textwrap.wrap(text.plain, width, break_long_words=True, break_on_hyphens=False) or [""]
    if len(lines) > height:
        lines = lines[:height]
        lines[-1] = lines[-1][: max(0, width - 1)].rstrip() + "…"
    out = Text("\n".join(lines), style=text.style)
    out.no_wrap, out.overflow = True, "ellipsis"
    return out


# --------------------------------------------------------------------------- one host: `status HOST`

_HOST_KEYS_SHOWN = {"name", "state", "reason", "workers", "heartbeat_age_s", "benched_until",
                    "cooldown_until", "failures", "desired", "gpus", "daemon"}


def find_host(doc: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    for host in doc.get("hosts") or []:
        if isinstance(host, dict) and host.get("name") == name:
            return host
    return None


def host_events(doc: Mapping[str, Any], name: str) -> list[dict]:
    """The document's events that concern host `name` (its own, or naming its workers)."""
    out = []
    for e in doc.get("events") or []:
        if isinstance(e, dict) and name in describe_event(e)[0].split(", "):
            out.append(e)
    return out


def _value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return _show(value)


def render_host(snapshot: Snapshot, name: str, options: ViewOptions):
    """`eltctl status HOST`: that host's full entry: its state and why, every GPU with
    its full reason, its daemon and workers (when the document has them), any other
    field of the entry, and the recent events of that host. A rich renderable."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    doc = snapshot.document
    host = find_host(doc, name)
    parts: list[Any] = []
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    state = str(doc.get("state", "?"))
    grid.add_row("job", f"[bold]{escape(str(doc.get('job', '?')))}[/] "
                        f"[{JOB_STATE_STYLE.get(state, 'white')}]{escape(state)}[/]")
    if not snapshot.controller_alive:
        grid.add_row("controller", f"[bold yellow]{escape(CONTROLLER_DOWN)}[/]\n"
                                   f"[dim]showing the last status it wrote, "
                                   f"{format_age(_staleness(doc, options.now))} old[/]")
    if host is None:
        grid.add_row("host", f"[bold]{escape(name)}[/] [dim]not in the job's status "
                             "(not used by the job, or the controller has not seen it yet)[/]")
        return Group(grid, events_table(doc, options, host=name))
    hstate = str(host.get("state", "?"))
    grid.add_row("host", f"[bold]{escape(name)}[/] "
                         f"[{HOST_STATE_STYLE.get(hstate, 'white')}]{escape(hstate)}[/]")
    for note in host_notes(host, options):
        grid.add_row("", escape(note))
    desired = host.get("desired")
    workers = _show(host.get("workers", 0))
    if isinstance(desired, list):
        workers += f" running; desired slot(s): {', '.join(map(str, desired)) or 'none'}"
    grid.add_row("workers", workers)
    grid.add_row("heartbeat", _heartbeat(host, _staleness(doc, options.now)))
    for key in host:
        if key not in _HOST_KEYS_SHOWN and host[key] not in (None, "", [], {}):
            grid.add_row(escape(str(key).replace("_", " ")), escape(_value(host[key])))
    parts.append(grid)

    gpus = Table(header_style="bold", expand=False, box=_box(), title="GPUs", title_justify="left",
                 title_style="bold")
    gpus.add_column("GPU", justify="right", no_wrap=True)
    gpus.add_column("state", no_wrap=True)
    gpus.add_column("reason", overflow="fold")
    for gpu in host.get("gpus") or []:
        gstate = str(gpu.get("state", "?"))
        gpus.add_row(_show(gpu.get("index")), f"[{GPU_STATE_STYLE.get(gstate, 'white')}]{escape(gstate)}[/]",
                     escape(str(gpu.get("reason") or "")))
    if not host.get("gpus"):
        gpus.add_row("-", "[dim]no GPUs (CPU slots)[/]", "")
    parts.append(gpus)

    daemon = host.get("daemon")
    if isinstance(daemon, dict):
        parts.append(daemon_table(daemon, options))
    parts.append(events_table(doc, options, host=name))
    return Group(*parts)


def _box():
    from rich import box

    return box.SIMPLE_HEAD


def daemon_table(daemon: Mapping[str, Any], options: ViewOptions):
    """A host daemon's own report (its state document): its facts, then its workers."""
    from rich.markup import escape
    from rich.table import Table

    facts = ", ".join(f"{k} {_value(v)}" for k, v in daemon.items()
                      if k != "workers" and not isinstance(v, (dict, list)) and v not in (None, ""))
    table = Table(header_style="bold", expand=False, box=_box(), title_justify="left", title_style="bold",
                  title=f"daemon ({escape(facts)})" if facts else "daemon")
    table.add_column("slot", justify="right", no_wrap=True)
    table.add_column("worker", no_wrap=True)
    table.add_column("pid", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("since", no_wrap=True)
    table.add_column("detail", overflow="fold")
    workers = [w for w in daemon.get("workers") or [] if isinstance(w, dict)]
    for w in workers:
        wstate = str(w.get("state", "?"))
        style = "red" if wstate in FAILED_WORKER_STATES else "green" if wstate == "running" else "white"
        table.add_row(_show(w.get("slot")), escape(_show(w.get("worker_id"))), _show(w.get("pid")),
                      f"[{style}]{escape(wstate)}[/]", format_clock(_num(w.get("since")), options.tz),
                      escape(str(w.get("detail") or "")))
    if not workers:
        table.add_row("", "[dim]no workers[/]", "", "", "", "")
    return table


# Worker end states (runtime/daemon/logic.py WorkerState) of a worker that failed.
FAILED_WORKER_STATES = {"crashed", "lost"}


def _worker_slot(worker_id: Any, host: str) -> tuple[int, int] | None:
    """(slot, incarnation) of a worker id `<host>/<slot>/<n>` of `host`, else None."""
    parts = str(worker_id).rsplit("/", 2)
    if len(parts) == 3 and parts[0] == host and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


def failed_workers(doc: Mapping[str, Any], name: str) -> dict[int, str]:
    """The slots of host `name` whose worker failed and has not been replaced, each with
    what is known of why: from the daemon's worker states when the host's entry carries
    them (`daemon.workers`, state crashed or lost), and from the crash events of that
    host in the document, unless a later worker of that slot is live or ended well in
    the daemon's states, or is named by a later event (it joined: the slot recovered)."""
    out: dict[int, str] = {}
    host = find_host(doc, name) or {}
    daemon = host.get("daemon") if isinstance(host.get("daemon"), dict) else {}
    live: dict[int, str] = {}
    recovered: dict[int, int] = {}
    for w in daemon.get("workers") or []:
        if not isinstance(w, dict) or not isinstance(w.get("slot"), int):
            continue
        if w.get("state") in FAILED_WORKER_STATES:
            out[w["slot"]] = f"{w.get('worker_id') or 'worker'} {w['state']}" + (
                f": {w['detail']}" if w.get("detail") else "")
        else:
            if w.get("state") not in ("left", "finished"):
                live[w["slot"]] = str(w.get("worker_id"))
            ok = _worker_slot(str(w.get("worker_id")), name)
            if ok is not None:  # a later worker of the slot that did not fail: it recovered
                recovered[ok[0]] = max(recovered.get(ok[0], -1), ok[1])
    events = host_events(doc, name)
    for i, e in enumerate(events):
        if e.get("kind") != "crash":
            continue
        for wid in e.get("workers") or []:
            slot_n = _worker_slot(wid, name)
            if slot_n is None or slot_n[0] in out:
                continue
            slot, n = slot_n
            if (slot in live and live[slot] != str(wid)) or recovered.get(slot, -1) > n:
                continue
            later = (_worker_slot(w, name) for ev in events[i + 1:]
                     for key in ("workers", "joined", "members") for w in ev.get(key) or [])
            if any(x is not None and x[0] == slot and x[1] > n for x in later):
                continue
            out[slot] = f"{wid} crashed" + (f": {e['detail']}" if e.get("detail") else "")
    return dict(sorted(out.items()))


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


def events_table(doc: Mapping[str, Any], options: ViewOptions, *, host: str | None = None):
    """The last few events, oldest first, with the pause each cost the job (those of
    one host when `host` is given)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    events = ([e for e in (doc.get("events") or []) if isinstance(e, dict)] if host is None
              else host_events(doc, host))
    shown = events[-options.events:] if options.events > 0 else []
    what = "recent events" if host is None else "recent events of this host"
    table = Table(header_style="bold", expand=False, box=box.SIMPLE_HEAD,
                  title=f"{what} ({len(shown)} of {len(events)})", title_justify="left",
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

"""One host whole (`eltctl status HOST`), and which of its workers failed (`eltctl logs HOST --failed`)."""

from __future__ import annotations

import json
from typing import Any, Mapping

from eltctl.statusview.events import events_table, host_events
from eltctl.statusview.formatting import (
    GPU_STATE_STYLE, HOST_STATE_STYLE, JOB_STATE_STYLE, ViewOptions, format_age, format_clock, num, show,
)
from eltctl.statusview.hosts import doc_staleness, heartbeat, host_notes
from eltctl.statusview.snapshot import Snapshot, controller_down


# --------------------------------------------------------------------------- one host: `status HOST`

_HOST_KEYS_SHOWN = {"name", "state", "reason", "workers", "heartbeat_age_s", "benched_until",
                    "cooldown_until", "failures", "desired", "gpus", "daemon", "device",
                    "waiting"}  # a note (hosts.wait_note)


def find_host(doc: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    for host in doc.get("hosts") or []:
        if isinstance(host, dict) and host.get("name") == name:
            return host
    return None




def _value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return show(value)


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
        grid.add_row("controller", f"[bold yellow]{escape(controller_down(doc))}[/]\n"
                                   f"[dim]showing the last status it wrote, "
                                   f"{format_age(doc_staleness(doc, options.now))} old[/]")
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
    workers = show(host.get("workers", 0))
    if isinstance(desired, list):
        workers += f" running; desired slot(s): {', '.join(map(str, desired)) or 'none'}"
    grid.add_row("workers", workers)
    grid.add_row("heartbeat", heartbeat(host, doc_staleness(doc, options.now)))
    for key in host:
        if key not in _HOST_KEYS_SHOWN and host[key] not in (None, "", [], {}):
            grid.add_row(escape(str(key).replace("_", " ")), escape(_value(host[key])))
    parts.append(grid)

    cpu = host.get("device") == "cpu"
    gpus = Table(header_style="bold", expand=False, box=_box(), title="CPU slots" if cpu else "GPUs",
                 title_justify="left", title_style="bold")
    gpus.add_column("slot" if cpu else "GPU", justify="right", no_wrap=True)
    gpus.add_column("state", no_wrap=True)
    gpus.add_column("reason", overflow="fold")
    for gpu in host.get("gpus") or []:
        gstate = str(gpu.get("state", "?"))
        gpus.add_row(show(gpu.get("index")), f"[{GPU_STATE_STYLE.get(gstate, 'white')}]{escape(gstate)}[/]",
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
        table.add_row(show(w.get("slot")), escape(show(w.get("worker_id"))), show(w.get("pid")),
                      f"[{style}]{escape(wstate)}[/]", format_clock(num(w.get("since")), options.tz),
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

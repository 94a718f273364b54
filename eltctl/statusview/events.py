"""The recent events table, and how an event is described."""

from __future__ import annotations

from typing import Any, Mapping

from eltctl.statusview.formatting import EVENT_STYLE, ViewOptions, format_clock, format_pause, num


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
        if event.get("failed"):  # restart mode: the job stopped on its restart limit
            parts.append(f"failed: {event['failed']}")
        elif event.get("mode") == "restart" and event.get("restarts") is not None:  # the scripts were restarted
            parts.append(f"script restarted (restart {event.get('restarts', '?')})")
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
        table.add_row(format_clock(num(e.get("time")), options.tz),
                      f"[{EVENT_STYLE.get(kind, 'white')}]{escape(kind)}[/]",
                      escape(host), format_pause(num(e.get("pause_s"))), escape(detail))
    if not shown:
        table.add_row("[dim]none yet[/]", "", "", "", "")
    return table

def host_events(doc: Mapping[str, Any], name: str) -> list[dict]:
    """The document's events that concern host `name` (its own, or naming its workers)."""
    out = []
    for e in doc.get("events") or []:
        if isinstance(e, dict) and name in describe_event(e)[0].split(", "):
            out.append(e)
    return out

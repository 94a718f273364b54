"""The status view's warning about the shared GPU claims directory: the entries the
job's daemons did not believe there (issue 49: written by another account than the one
they name, a name outside the strict set, a time in the future, a lock without a live
process of its account), each named with its file and its owner's account. Pure."""

from __future__ import annotations

from typing import Any


def refused_entries(doc: Any) -> list[tuple[str, dict]]:
    """(host, {"file", "owner", "reason"}) for every refusal in status.json's hosts."""
    hosts = doc.get("hosts") if isinstance(doc, dict) else None
    out = []
    for h in hosts if isinstance(hosts, list) else []:
        refused = h.get("refused") if isinstance(h, dict) else None
        entries = refused.get("entries") if isinstance(refused, dict) else None
        for e in entries if isinstance(entries, list) else []:
            if isinstance(e, dict):
                out.append((str(h.get("name", "?")), e))
    return out


def refused_line(doc: Any) -> str | None:
    """The warning row (rich markup), None when nothing was refused."""
    from rich.markup import escape

    entries = refused_entries(doc)
    if not entries:
        return None
    n = len(entries)
    head = (f"[bold red]{n} entr{'y' if n == 1 else 'ies'} of the GPU claims directory not believed[/] "
            "(another account wrote them, or they are malformed; docs/fairshare.md):")
    lines = [f"  {escape(host)}: {escape(str(e.get('file', '?')))} (owner [bold]{escape(str(e.get('owner', '?')))}[/]): "
             f"{escape(str(e.get('reason', '')))}" for host, e in entries[:10]]
    if n > 10:
        lines.append(f"  ... and {n - 10} more (`eltctl status --json`)")
    return "\n".join([head, *lines])


__all__ = ["refused_entries", "refused_line"]

"""The workers table: each member's share of the global batch and its own speed.

Shares follow the workers' measured speeds (eltctl_runtime.train.balance); a worker
far slower than the others, or one the job would be faster without, is marked
a straggler, with the figure that says so.
"""

from __future__ import annotations

from typing import Any, Mapping

from eltctl.statusview.formatting import num


def worker_note(entry: Mapping[str, Any]) -> str:
    """Why a worker stands out: `straggler: 0.2x the others' speed`, `the job is
    1.3x faster without it`; empty for a worker that keeps up."""
    if not entry.get("straggler"):
        return ""
    parts = []
    rel = num(entry.get("relative_speed"))
    if rel is not None:
        parts.append(f"{rel:.2g}x the others' speed")
    gain = num(entry.get("speedup_without"))
    if gain is not None and gain > 1.0:
        parts.append(f"the job is {gain:.2g}x faster without it")
    return "straggler" + (": " + ", ".join(parts) if parts else "")


def workers_table(doc: Mapping[str, Any]):
    """One row per member in rank order: worker, share, samples/s, note. None when
    the document has no `workers` (no step committed in this generation yet)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    workers = [w for w in doc.get("workers") or [] if isinstance(w, dict)]
    if not workers:
        return None
    table = Table(header_style="bold", expand=False, box=box.SIMPLE_HEAD)
    table.add_column("worker", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    table.add_column("samples/s", justify="right", no_wrap=True)
    table.add_column("note", overflow="fold")
    for w in workers:
        sps = num(w.get("samples_per_s"))
        note = worker_note(w)
        table.add_row(escape(str(w.get("worker", "?"))), str(w.get("share", "-")),
                      f"{sps:,.1f}" if sps is not None else "-",
                      f"[yellow]{escape(note)}[/]" if note else "")
    return table

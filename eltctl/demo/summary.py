"""Reading the status documents the demo sees (pure predicates) and the closing summary."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from eltctl_runtime.protocol import MEMBERSHIP

RESIZE_KINDS = tuple(k.value for k in MEMBERSHIP)



def events_since(doc: Mapping[str, Any], since: float) -> list[dict]:
    return [e for e in doc.get("events") or [] if isinstance(e, dict)
            and isinstance(e.get("time"), (int, float)) and e["time"] >= since]


def is_training(doc: Mapping[str, Any], world_size: int, *, min_step: int = 0) -> bool:
    """The job trains at `world_size` workers and has reached `min_step`."""
    return (doc.get("state") == "training" and doc.get("world_size") == world_size
            and (doc.get("step") or 0) >= min_step)


def has_yielded(doc: Mapping[str, Any], host: str, since: float) -> bool:
    """A `yield` event on `host` since `since` (a second of clock skew allowed)."""
    return any(e.get("kind") == "yield" and e.get("host") == host for e in events_since(doc, since - 1))


def resizes(doc: Mapping[str, Any], since: float = 0.0) -> list[dict]:
    """The membership changes among the events since `since`, oldest first."""
    return [e for e in events_since(doc, since) if e.get("kind") in RESIZE_KINDS]




@dataclass(frozen=True)
class Resize:
    at_s: float  # seconds since the demo started
    kind: str
    host: str
    pause_s: float | None
    detail: str


@dataclass(frozen=True)
class DemoSummary:
    job: str
    steps: int | None
    final_loss: float | None
    first_loss: float | None
    resizes: tuple[Resize, ...]
    yield_latency_s: float | None  # owner registered -> our worker on that GPU gone
    rejoin_after_s: float | None  # owner gone -> the job back at full size
    duration_s: float
    down_message: str = ""


def summarize(job: str, final_doc: Mapping[str, Any], *, started: float, first_loss: float | None,
              yield_latency_s: float | None, rejoin_after_s: float | None, duration_s: float,
              down_message: str = "") -> DemoSummary:
    """The summary from the last status document seen (pure)."""
    from eltctl.statusview import describe_event

    changes = tuple(
        Resize(at_s=max(0.0, float(e["time"]) - started), kind=str(e.get("kind")),
               host=describe_event(e)[0],
               pause_s=float(e["pause_s"]) if isinstance(e.get("pause_s"), (int, float)) else None,
               detail=describe_event(e)[1])
        for e in resizes(final_doc, started - 1))
    loss = final_doc.get("loss")
    return DemoSummary(job=job, steps=final_doc.get("step"),
                       final_loss=float(loss) if isinstance(loss, (int, float)) else None,
                       first_loss=first_loss, resizes=changes, yield_latency_s=yield_latency_s,
                       rejoin_after_s=rejoin_after_s, duration_s=duration_s, down_message=down_message)


def render_summary(summary: DemoSummary):
    """The closing table: what happened, each resize and its pause, the figures."""
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    from eltctl.statusview import format_pause

    table = Table(title="resizes", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
                  header_style="bold")
    table.add_column("at", justify="right", no_wrap=True)
    table.add_column("event", no_wrap=True)
    table.add_column("host", no_wrap=True)
    table.add_column("pause", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for r in summary.resizes:
        table.add_row(f"{r.at_s:.1f} s", r.kind, escape(r.host), format_pause(r.pause_s), escape(r.detail))
    if not summary.resizes:
        table.add_row("", "[dim]none[/]", "", "", "")
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column()
    facts.add_row("job", escape(summary.job))
    facts.add_row("steps", "?" if summary.steps is None else str(summary.steps))
    loss = "?" if summary.final_loss is None else f"{summary.final_loss:.4g}"
    if summary.first_loss is not None and summary.final_loss is not None:
        loss += f" (first seen {summary.first_loss:.4g})"
    facts.add_row("final loss", loss)
    pauses = [r.pause_s for r in summary.resizes if r.pause_s is not None]
    if pauses:
        facts.add_row("pauses", f"{len(pauses)} resize(s), longest {format_pause(max(pauses))}, "
                                f"median {format_pause(statistics.median(pauses))}")
    if summary.yield_latency_s is not None:
        facts.add_row("owner yield", f"{summary.yield_latency_s:.2f} s from the owner's process on the "
                                     "GPU to our worker's exit there (target <= 5 s)")
    if summary.rejoin_after_s is not None:
        facts.add_row("rejoin", f"{summary.rejoin_after_s:.1f} s after the owner left "
                                "(idle_for + cooldown + join)")
    facts.add_row("took", f"{summary.duration_s:.0f} s")
    if summary.down_message:
        facts.add_row("down", escape(summary.down_message))
    return Group("[bold]demo summary[/]", facts, table)


def yield_figures(latencies: Sequence[float]) -> dict[str, float | int | None]:
    """min / median / max of owner-yield latencies (seconds); shared with the benchmark."""
    if not latencies:
        return {"n": 0, "min_s": None, "median_s": None, "max_s": None}
    return {"n": len(latencies), "min_s": min(latencies), "median_s": statistics.median(latencies),
            "max_s": max(latencies)}

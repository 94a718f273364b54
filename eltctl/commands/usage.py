"""`eltctl usage [--since 7d] [--by host|gpu|day] [--json]`: what the job used.

Reads the usage ledger (`usage.db` in the job's state directory, eltctl/ledger)
read-only: it works while the controller runs and after it is gone. Shows GPU-hours,
owner yields and pauses, grouped as asked, and a per-host timeline: one row per GPU
(or CPU slot), time across, who held it (this job, its owner, another eltctl job, nobody).
Without --since, a job younger than the default window is shown from its first
observation, so the timeline spreads over the job's life instead of one character.

Exit status: 0 shown; 1 no ledger on this machine (the job never ran here); 2 bad usage.
"""

from __future__ import annotations

import typer

TIMELINE_MIN, TIMELINE_MAX = 10, 120


def usage(
    ctx: typer.Context,
    since: str = typer.Option("7d", "--since", help='How far back: a duration such as "7d", "12h", "90m".'),
    by: str = typer.Option("host", "--by", help="Group the figures by host, gpu (host:GPU) or day (local days)."),
    json_out: bool = typer.Option(False, "--json", help="Print the figures (and the timeline) as JSON."),
) -> None:
    """GPU-hours, owner yields and pauses of the job, and who held each GPU when."""
    import json
    import os
    import sys
    import time

    from eltctl.controller.statedir import StateDir, lock_holder
    from eltctl.durations import parse_duration
    from eltctl.errors import UsageError
    from eltctl.ledger import BY_CHOICES, first_seen, open_reader, slot_kinds, timeline
    from eltctl.ledger import usage as figures

    if by not in BY_CHOICES:
        raise UsageError(f"--by must be one of {', '.join(BY_CHOICES)}, not {by!r}")
    try:
        window = parse_duration(since)
    except ValueError as exc:
        raise UsageError(f"--since: {exc}") from None
    inventory = ctx.obj.inventory()
    state = StateDir.for_job(inventory.job.name, os.environ)
    conn = open_reader(state.usage_db)
    try:
        now = time.time()
        start = now - window
        if getattr(ctx.get_parameter_source("since"), "name", "") != "COMMANDLINE":
            first = first_seen(conn)  # a younger job: from its first observation on
            start = max(start, min(first, now - 1.0)) if first is not None else start
        live = lock_holder(state.lock) is not None
        doc = figures(conn, since=start, until=now, live=live, by=by)
        if json_out:
            buckets = TIMELINE_MAX
        else:
            from rich.console import Console

            console = Console(highlight=False)
            buckets = max(TIMELINE_MIN, min(TIMELINE_MAX, console.width - 24))
        lines = timeline(conn, since=start, until=now, live=live, buckets=buckets)
        kinds = slot_kinds(conn)
    finally:
        conn.close()
    if json_out:
        doc["timeline"] = {"buckets": buckets, "bucket_s": round((now - start) / buckets, 3),
                           "hosts": {h: {str(s): cells for s, cells in slots.items()} for h, slots in lines.items()}}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    from eltctl.statusview.usage import render_usage

    console.print(render_usage(doc, lines, kinds=kinds))

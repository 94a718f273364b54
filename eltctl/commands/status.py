"""`eltctl status [HOST]`: the job, its hosts and its recent events; `--watch` live, `--json` the document.

`--watch` (without HOST) adds the last hour's world size and samples/s as small
charts, from the samples in the usage ledger (usage.db, eltctl/ledger).

The hosts table fits the terminal: from `statusview.WIDE_MIN_WIDTH` (120) columns on it
shows every GPU's full reason; narrower, one line per GPU in few words. `status HOST`
shows one host's full entry: every GPU with its full reason, its daemon and workers
when known, the rest of its entry, and its recent events.

Exit status: 0 when a status was shown (even an old one from a dead controller);
1 when this machine holds no status of the job (never started here, or removed);
2 when HOST is not a host of the inventory.
"""

from __future__ import annotations

import typer

from eltctl.completion import complete_host

WATCH_INTERVAL_S = 1.0


def status(
    ctx: typer.Context,
    host: str = typer.Argument(None, metavar="HOST", help="Show this host's full entry: every GPU with its full reason, "
                                          "its daemon and workers, its recent events.",
                               show_default=False, autocompletion=complete_host),
    watch: bool = typer.Option(False, "--watch", "-w", help="Keep the view live (about once a second); Ctrl-C ends it."),
    json_out: bool = typer.Option(
        False, "--json", help="Print the status document (docs/control-plane.md) as JSON; with HOST, that host's entry."),
    events: int = typer.Option(8, "--events", min=0, help="How many recent events to show."),
) -> None:
    """The job: state, generation, workers, step, loss, checkpoint; each host and GPU; recent events."""
    import os

    from eltctl.statusview import job_state_dir, read_snapshot

    from eltctl.commands.common import inventory_or_recorded_job

    # A broken inventory of a recorded job: that job, from its state directory, and a warning.
    inventory, job = inventory_or_recorded_job(ctx)
    if host is not None and inventory is not None:
        inventory.hosts_named([host])  # an unknown name: exit 2, with a did-you-mean
    state_dir = job_state_dir(job, os.environ)
    if json_out:
        import json
        import sys

        snapshot = read_snapshot(job, state_dir)
        doc = snapshot.as_json()
        if host is not None:
            from eltctl.statusview import find_host

            doc = find_host(doc, host) or {"name": host}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    if watch:
        _watch(job, state_dir, events, host)
        return
    _show_once(job, state_dir, events, host)


def _view(snapshot, events: int, host: str | None):
    import time

    from eltctl.statusview import ViewOptions, render_host, render_status

    options = ViewOptions(now=time.time(), events=events)
    return render_status(snapshot, options) if host is None else render_host(snapshot, host, options)


def _show_once(job, state_dir, events: int, host: str | None) -> None:
    from rich.console import Console

    from eltctl.statusview import read_snapshot

    Console(highlight=False).print(_view(read_snapshot(job, state_dir), events, host))


def _watch(job, state_dir, events: int, host: str | None) -> None:
    import time

    from rich.console import Console
    from rich.live import Live
    from rich.markup import escape

    from rich.console import Group

    from eltctl.statusview import NoJobError, read_snapshot
    from eltctl.statusview.usage import ledger_charts

    console = Console(highlight=False)

    def view():
        try:
            snapshot = read_snapshot(job, state_dir)
        except NoJobError as exc:
            # A watch outlives `down` and precedes `up`: say so and keep watching.
            return f"[yellow]{escape(exc.message)}[/] [dim](watching; Ctrl-C ends)[/]"
        shown = _view(snapshot, events, host)
        # The last hour's world size and samples/s, from the usage ledger (eltctl/ledger).
        # The document's world size and samples/s end the charts: one figure for one moment.
        doc = snapshot.document
        ws = doc.get("world_size")
        current = (ws if isinstance(ws, int) else 0, doc.get("samples_per_s")) if snapshot.controller_alive else None
        charts = ledger_charts(state_dir, time.time(), max(10, min(60, console.width - 30)), current)
        return shown if charts is None or host is not None else Group(shown, "", charts)

    try:
        with Live(view(), console=console, auto_refresh=False,
                  screen=False, redirect_stdout=False) as live:
            while True:
                time.sleep(WATCH_INTERVAL_S)
                live.update(view(), refresh=True)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None

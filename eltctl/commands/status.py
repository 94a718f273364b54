"""`eltctl status`: the job, its hosts and its recent events; `--watch` live, `--json` the document.

Exit status: 0 when a status was shown (even an old one from a dead controller);
1 when this machine holds no status of the job (never started here, or removed).
"""

from __future__ import annotations

import typer

WATCH_INTERVAL_S = 1.0


def status(
    ctx: typer.Context,
    watch: bool = typer.Option(False, "--watch", "-w", help="Keep the view live (about once a second); Ctrl-C ends it."),
    json_out: bool = typer.Option(
        False, "--json", help="Print the status document (docs/control-plane.md) as JSON."),
    events: int = typer.Option(8, "--events", min=0, help="How many recent events to show."),
) -> None:
    """The job: state, generation, workers, step, loss, checkpoint; each host and GPU; recent events."""
    import os

    from eltctl.statusview import job_state_dir, read_snapshot

    job = ctx.obj.inventory().job.name
    state_dir = job_state_dir(job, os.environ)
    if json_out:
        import json
        import sys

        snapshot = read_snapshot(job, state_dir)
        sys.stdout.write(json.dumps(snapshot.as_json(), indent=2) + "\n")
        return
    if watch:
        _watch(job, state_dir, events)
        return
    _show_once(job, state_dir, events)


def _show_once(job, state_dir, events: int) -> None:
    import time

    from rich.console import Console

    from eltctl.statusview import ViewOptions, read_snapshot, render_status

    snapshot = read_snapshot(job, state_dir)
    Console(highlight=False).print(render_status(snapshot, ViewOptions(now=time.time(), events=events)))


def _watch(job, state_dir, events: int) -> None:
    import time

    from rich.console import Console
    from rich.live import Live
    from rich.markup import escape

    from eltctl.statusview import NoJobError, ViewOptions, read_snapshot, render_status

    def view():
        try:
            snapshot = read_snapshot(job, state_dir)
        except NoJobError as exc:
            # A watch outlives `down` and precedes `up`: say so and keep watching.
            return f"[yellow]{escape(exc.message)}[/] [dim](watching; Ctrl-C ends)[/]"
        return render_status(snapshot, ViewOptions(now=time.time(), events=events))

    try:
        with Live(view(), console=Console(highlight=False), auto_refresh=False,
                  screen=False, redirect_stdout=False) as live:
            while True:
                time.sleep(WATCH_INTERVAL_S)
                live.update(view(), refresh=True)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None

"""`eltctl metrics`: the job's figures in the Prometheus text format, on stdout.

The same text the controller writes to `[controller] metrics_file` (eltctl/metrics.py):
made from the status document (the live controller's answer, else status.json) and
the usage ledger (usage.db, read-only). It opens no socket and imports no torch; point
node_exporter's textfile collector at `metrics_file`, or run this from a cron job.

Exit status: 0 printed; 1 no status of the job on this machine.
"""

from __future__ import annotations

import typer


def metrics(ctx: typer.Context) -> None:
    """The job's figures in the Prometheus text format (what [controller] metrics_file holds)."""
    import os
    import sys
    import time

    from eltctl.controller.statedir import StateDir, lock_holder
    from eltctl.ledger import LedgerError, open_reader
    from eltctl.metrics import ledger_figures, render
    from eltctl.statusview import job_state_dir, read_snapshot

    inventory = ctx.obj.inventory()
    job = inventory.job.name
    snapshot = read_snapshot(job, job_state_dir(job, os.environ))
    state = StateDir.for_job(job, os.environ)
    figures = None
    try:
        conn = open_reader(state.usage_db)
    except LedgerError:
        pass  # no ledger yet: its families are left out
    else:
        try:
            figures = ledger_figures(conn, time.time(), live=lock_holder(state.lock) is not None)
        finally:
            conn.close()
    sys.stdout.write(render(snapshot.document, figures, controller_alive=snapshot.controller_alive))

"""The CLI's commands: one module per command, each a plain function registered here.

A command parses its options, calls one library function and renders the result; its
heavy imports stay inside the function body, so importing this package (and
`eltctl --help`) stays cheap. Each function can be imported and called on its own
(`from eltctl.commands.up import up`).
"""

from __future__ import annotations

import typer

from eltctl.commands import (checkpoints, cordon, cron, demo, doctor, down, init, lab, logs, metrics, notify, probe,
                             scale, status, up, usage)


def register(app: typer.Typer) -> None:
    """Add every command to `app`, in the order `eltctl --help` lists them."""
    app.command("init")(init.init)
    app.command("doctor")(doctor.doctor)
    app.command("probe")(probe.probe)
    app.command("up")(up.up)
    app.command("scale")(scale.scale)
    app.command("cordon")(cordon.cordon)
    app.command("uncordon")(cordon.uncordon)
    app.command("down")(down.down)
    app.command("status")(status.status)
    app.command("logs")(logs.logs)
    app.command("usage")(usage.usage)
    app.command("lab")(lab.lab)
    app.command("metrics")(metrics.metrics)
    app.add_typer(notify.app, name="notify")
    app.command("demo")(demo.demo)
    app.command("cron")(cron.cron)
    app.add_typer(checkpoints.app, name="checkpoints")

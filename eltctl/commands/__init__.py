"""The CLI's commands: one module per command, each a plain function registered here.

A command parses its options, calls one library function and renders the result; its
heavy imports stay inside the function body, so importing this package (and
`eltctl --help`) stays cheap. Each function can be imported and called on its own
(`from eltctl.commands.up import up`).
"""

from __future__ import annotations

import typer
import typer.core

from eltctl.commands import (checkpoints, cordon, cron, demo, doctor, down, init, lab, logs, metrics, notify, probe,
                             scale, status, up, usage)


def register(app: typer.Typer) -> None:
    """Add every command to `app`, in the order `eltctl --help` lists them.

    Each gets `-i FILE` and `--job NAME` after its name too, and its help read as text
    (eltctl/commands/common.py); `init` takes only `-i` (the file it writes), `demo` neither."""
    from eltctl.commands.common import InventoryCommand, InventoryGroup, InventoryOnlyCommand, PlainHelpCommand

    app.command("init", cls=InventoryOnlyCommand)(init.init)
    for name, function in (("doctor", doctor.doctor), ("probe", probe.probe), ("up", up.up), ("scale", scale.scale),
                           ("cordon", cordon.cordon), ("uncordon", cordon.uncordon), ("down", down.down),
                           ("status", status.status), ("logs", logs.logs), ("usage", usage.usage), ("lab", lab.lab),
                           ("metrics", metrics.metrics)):
        app.command(name, cls=InventoryCommand)(function)
    app.add_typer(notify.app, name="notify", cls=InventoryGroup)
    app.command("demo", cls=PlainHelpCommand)(demo.demo)
    app.command("cron", cls=InventoryCommand)(cron.cron)
    app.add_typer(checkpoints.app, name="checkpoints", cls=InventoryGroup)
    for group in (notify.app, checkpoints.app):
        for info in group.registered_commands:
            if info.cls in (None, typer.core.TyperCommand):  # typer's default: not chosen by the command
                info.cls = InventoryCommand

"""`eltctl lab`: every eltctl job on the inventory's hosts, its user, priority, GPUs held
and wanted, recent usage and fair share, from the hosts themselves (docs/fairshare.md)."""

from __future__ import annotations

import typer


def lab(
    ctx: typer.Context,
    json_out: bool = typer.Option(False, "--json", help="Print the JSON document (docs/commands.md) instead of a table."),
) -> None:
    """Every eltctl job on the inventory's hosts: user, priority, GPUs held and wanted, recent usage and fair share."""
    from eltctl.lab import lab_view, view_to_json
    from eltctl.probe import probe_inventory

    inventory = ctx.obj.inventory()
    view = lab_view(probe_inventory(inventory), inventory.policy.usage_half_life)
    if json_out:
        import json
        import sys

        sys.stdout.write(json.dumps(view_to_json(view), indent=2) + "\n")
        return
    render(view)


def render(view) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(header_style="bold", expand=False)
    for name, justify in (("job", "left"), ("user", "left"), ("priority", "right"), ("held", "right"),
                          ("wanted", "right"), ("usage GPU-h", "right"), ("fair share", "right"), ("hosts", "left")):
        table.add_column(name, justify=justify, overflow="fold", no_wrap=name != "hosts")

    def shown(v, fmt="{}"):
        return "?" if v is None else fmt.format(v)

    for j in view.jobs:
        share = shown(j.share)
        if j.share is not None and j.held > j.share:
            share = f"[yellow]{share}[/]"
        table.add_row(f"[bold]{escape(j.job)}[/]", escape(j.user), shown(j.priority), str(j.held), shown(j.wanted),
                      shown(j.usage_gpu_h, "{:.2f}"), share,
                      escape(", ".join(f"{h}:{n}" for h, n in j.hosts)) + ("" if j.published else
                                                                         " [dim](no demand published)[/]"))
    console = Console(highlight=False)
    if view.jobs:
        console.print(table)
    else:
        console.print("No eltctl job holds a GPU or published a demand on these hosts.")
    tail = f"; unreachable: {', '.join(view.unreachable)}" if view.unreachable else ""
    console.print(f"{len(view.jobs)} job(s) on {len(view.hosts)} host(s); {view.pool} GPUs shared, {view.free} free{tail}")

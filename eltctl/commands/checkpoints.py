"""`eltctl checkpoints`: the job's checkpoints on each host and on the mirror, verified.

Exit status: 0 when everything could be listed; 3 when a host or the mirror could not
be reached (what was found elsewhere is still shown). Never imports torch.
"""

from __future__ import annotations

import typer


def checkpoints(
    ctx: typer.Context,
    json_out: bool = typer.Option(False, "--json", help="Print {mirror, checkpoints, errors} as JSON."),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="Trust the manifests; skip recomputing sha256 where the files are."),
) -> None:
    """Local (per host) and mirrored checkpoints: step, time, size, where, verified."""
    import asyncio
    import json
    import sys

    from eltctl.mirror import list_all

    inventory = ctx.obj.inventory()
    listing = asyncio.run(list_all(inventory, verify=not no_verify,
                                   timeout=inventory.ssh.connect_timeout + 600))
    if json_out:
        sys.stdout.write(json.dumps(listing.as_json(), indent=2) + "\n")
    else:
        render(listing)
    if listing.errors:
        raise typer.Exit(3)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def render(listing) -> None:
    import time

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"mirror: {escape(listing.mirror or 'none (set [storage] mirror)')}", soft_wrap=True)
    table = Table()
    for col in ("step", "time", "size", "where", "verified"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for c in listing.checkpoints:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.created)) if c.created else "?"
        verified = {True: "[green]yes[/]", False: f"[red]NO[/] {escape(c.problem or '')}", None: "-"}[c.verified]
        table.add_row(str(c.step), when, _size(c.size), escape(c.where), verified)
    console.print(table)
    if not listing.checkpoints:
        console.print("no checkpoints found")
    for where, error in listing.errors:
        console.print(f"[red]{escape(where)}[/]: {escape(error)}")

"""`eltctl cordon HOST` / `eltctl uncordon HOST`: keep a host out until told otherwise."""

from __future__ import annotations

from typing import List

import typer

from eltctl.completion import complete_host


def _render(answer: dict) -> None:
    from rich.console import Console
    from rich.markup import escape

    from eltctl.errors import EltctlError

    if "results" not in answer:
        raise EltctlError(f"the controller refused: {answer.get('error')}")
    out = Console(highlight=False, soft_wrap=True)
    for r in answer["results"]:
        mark = "[green]ok[/]" if r["ok"] else "[red]refused[/]"
        out.print(f"{escape(r['host'])}: {mark} {escape(r['message'])}")
    if not answer.get("ok"):
        raise typer.Exit(1)


def cordon(ctx: typer.Context, hosts: List[str] = typer.Argument(..., metavar="HOST", help="The host(s) to cordon.",
                                                                 autocompletion=complete_host)) -> None:
    """Cordon hosts: their workers leave in the planned way and none start there until uncordoned
    (remembered across controller restarts)."""
    from eltctl.controller import client

    _render(client.cordon(ctx.obj.inventory(), list(hosts), True))


def uncordon(ctx: typer.Context, hosts: List[str] = typer.Argument(..., metavar="HOST",
                                                                   help="The host(s) to uncordon.",
                                                                   autocompletion=complete_host)) -> None:
    """Uncordon hosts: they are used again like any other."""
    from eltctl.controller import client

    _render(client.cordon(ctx.obj.inventory(), list(hosts), False))

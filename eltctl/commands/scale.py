"""`eltctl scale --add HOST --remove HOST`: a planned join or leave, now."""

from __future__ import annotations

from typing import List

import typer

from eltctl.completion import complete_host


def scale(
    ctx: typer.Context,
    add: List[str] = typer.Option([], "--add", metavar="HOST", help="A host to use now (repeatable).",
                                  show_default=False, autocompletion=complete_host),
    remove: List[str] = typer.Option([], "--remove", metavar="HOST", show_default=False,
                                     help="A host to leave now and keep out (repeatable).",
                                     autocompletion=complete_host),
    force: bool = typer.Option(False, "--force", help="Add a host even if its GPUs (or CPU slots) look busy."),
) -> None:
    """Add or remove hosts now; a removed host stays out until it is added again."""
    from rich.console import Console
    from rich.markup import escape

    from eltctl.controller import client
    from eltctl.errors import EltctlError, UsageError

    if not add and not remove:
        raise UsageError("nothing to do", hint="name hosts with --add HOST and/or --remove HOST")
    out = Console(highlight=False, soft_wrap=True)
    answer = client.scale(ctx.obj.inventory(), list(add), list(remove), force)
    if "results" not in answer:
        raise EltctlError(f"the controller refused: {answer.get('error')}")
    for r in answer["results"]:
        mark = "[green]ok[/]" if r["ok"] else "[red]refused[/]"
        out.print(f"{escape(r['host'])}: {mark} {escape(r['message'])}")
    if not answer.get("ok"):
        raise typer.Exit(1)

"""`eltctl doctor`: check every host and say how to fix each problem."""

from __future__ import annotations

import typer

STATUS_MARK = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]", "skip": "[dim]skip[/]"}


def doctor(
    ctx: typer.Context,
    accept_new: bool = typer.Option(
        False, "--accept-new",
        help="Record the host key of hosts not yet in known_hosts (shows its fingerprint). "
             "A changed key is never replaced."),
) -> None:
    """Check each host: reachable, host key, login, Python and torch versions, nvidia-smi, ~/.eltctl."""
    from eltctl.doctor import diagnose
    from eltctl.errors import HostError

    inventory = ctx.obj.inventory()
    results = diagnose(inventory, accept_new=accept_new)
    render(results)
    if not all(r.ok for r in results):
        raise typer.Exit(HostError.exit_code)


def render(results) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.tree import Tree

    console = Console(highlight=False)
    for r in results:
        verdict = "[green]ok[/]" if r.ok else "[bold red]problems[/]"
        tree = Tree(f"[bold]{escape(r.host)}[/] ({escape(r.address)}): {verdict}")
        for c in r.checks:
            node = tree.add(f"{STATUS_MARK[c.status.value]} {escape(c.name)}: {escape(c.detail)}")
            if c.fix and c.status.value in ("fail", "warn"):
                node.add(f"[bold]fix:[/] {escape(c.fix)}")
        console.print(tree)
    failed = sum(1 for r in results if not r.ok)
    console.print(f"{len(results) - failed} of {len(results)} host(s) ready"
                  + (f"; {failed} with problems" if failed else ""))

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
    no_link_test: bool = typer.Option(
        False, "--no-link-test",
        help="Skip the link test (about a second: each host that passes sends to the next over the data plane)."),
) -> None:
    """Check the job and each host, as `up` does: workdir and script, reachable, host key, login,
    Python and torch versions, nvidia-smi, ~/.eltctl; then the links between the hosts that pass."""
    from eltctl.errors import ConfigError, HostError
    from eltctl.preflight import for_doctor

    inventory = ctx.obj.inventory()
    problems, results = for_doctor(inventory, accept_new=accept_new, link_test=not no_link_test)
    render(results, job=inventory.job.name, problems=problems)
    if not all(r.ok for r in results):
        raise typer.Exit(HostError.exit_code)
    if problems:
        raise typer.Exit(ConfigError.exit_code)  # the inventory's [job]: `up` refuses it the same way


def render(results, *, job: str | None = None, problems=()) -> None:
    """Per host, each check with its fix; first the job's own checks on this machine (`job`)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.tree import Tree

    console = Console(highlight=False)
    if job is not None:
        verdict = "[green]ok[/]" if not problems else "[bold red]problems[/]"
        tree = Tree(f"[bold]job {escape(job)}[/] (this machine): {verdict}")
        if not problems:
            tree.add(f"{STATUS_MARK['ok']} workdir, command, env: as `eltctl up` checks them")
        for p in problems:
            node = tree.add(f"{STATUS_MARK['fail']} {escape(p.message)}")
            if p.hint:
                node.add(f"[bold]fix:[/] {escape(p.hint)}")
        console.print(tree)
    for r in results:
        verdict = "[green]ok[/]" if r.ok else "[bold red]problems[/]"
        tree = Tree(f"[bold]{escape(r.host)}[/] ({escape(r.address)}): {verdict}")
        for c in r.checks:
            node = tree.add(f"{STATUS_MARK[c.status.value]} {escape(c.name)}: {escape(c.detail)}")
            if c.fix and c.status.value in ("fail", "warn"):
                node.add(f"[bold]fix:[/] {escape(c.fix)}")
        console.print(tree)
    failed = sum(1 for r in results if not r.ok)
    job_line = "" if job is None else (f"the job has {len(problems)} problem(s); " if problems else "job ok; ")
    console.print(f"{job_line}{len(results) - failed} of {len(results)} host(s) ready"
                  + (f"; {failed} with problems" if failed else ""))

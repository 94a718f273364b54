"""`eltctl cron`: the crontab entry that keeps the job alive; `--install` / `--remove` it."""

from __future__ import annotations

import typer


def cron(
    ctx: typer.Context,
    install: bool = typer.Option(False, "--install", help="Put the entry in your crontab (once; idempotent)."),
    remove: bool = typer.Option(False, "--remove", help="Take this inventory's entry out of your crontab."),
    schedule: str = typer.Option("*/5 * * * *", "--schedule", help="When cron runs it (five fields, or @hourly...)."),
) -> None:
    """Print the crontab line that runs `eltctl up --unattended` for this inventory.

    The line works in cron's bare environment (absolute paths, no ssh-agent: the
    inventory's identity file); a run is skipped while another holds the lock, logs to
    the job's state directory (cron.log) and prints only a real failure, which cron mails.
    $ELTCTL_CRONTAB names another crontab program."""
    from rich.console import Console
    from rich.markup import escape

    from eltctl import cron as lib
    from eltctl.controller import client
    from eltctl.errors import UsageError

    if install and remove:
        raise UsageError("--install and --remove exclude each other")
    out = Console(highlight=False, soft_wrap=True)
    inventory = ctx.obj.inventory()
    log = client.state_of(inventory).path / lib.LOG_NAME
    if remove:
        change = lib.remove(inventory)
        out.print(f"removed from your crontab: {escape(change.line)}" if change.changed
                  else f"no entry for {escape(str(inventory.path))} in your crontab; nothing to remove")
        return
    if install:
        change = lib.install(inventory, schedule)
        out.print(("installed in your crontab:" if change.changed else "already in your crontab:")
                  + f"\n{escape(change.line)}")
        out.print(f"[dim]it logs to {escape(str(log))}; `eltctl cron --remove` takes it out (do that before a "
                  "`down` you mean to last)[/]")
        note = lib.agent_note(inventory)
        if note:
            out.print(f"[yellow]note:[/] {escape(note)}")
        return
    print(lib.entry(inventory, schedule))

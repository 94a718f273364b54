"""`eltctl up`: start what is missing of the job and return when it trains."""

from __future__ import annotations

import typer


def up(
    ctx: typer.Context,
    detach: bool = typer.Option(False, "--detach", "-d",
                                help="Return once the controller runs; do not wait for training."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for the first step."),
    unattended: bool = typer.Option(
        False, "--unattended",
        help="For cron (`eltctl cron`): skip if another run holds the lock, log to the job's state directory, "
             "print nothing unless it fails."),
    ignore_mirror_check: bool = typer.Option(
        False, "--ignore-mirror-check",
        help="Start even when [storage] mirror fails its check (an account cannot write it): the job trains "
             "with its checkpoints on the hosts only; `eltctl status` warns."),
    no_link_test: bool = typer.Option(
        False, "--no-link-test",
        help="Skip the link test of the hosts `up` checks (half a second; never under --unattended): it says when "
             "the network, not the GPUs, will set the job's speed, and which mode helps."),
) -> None:
    """Start (or adopt) the job's controller; idempotent: a healthy job is left as it is."""
    from rich.console import Console
    from rich.markup import escape

    from eltctl.controller import client

    inventory = ctx.obj.inventory()
    if unattended:
        from eltctl import cron

        given = getattr(ctx.get_parameter_source("timeout"), "name", "") == "COMMANDLINE"
        cron.run_unattended(inventory, timeout=timeout if given else cron.UNATTENDED_TIMEOUT_S)
        return
    out = Console(highlight=False, soft_wrap=True)
    import time

    from eltctl.controller import resume

    def say(warning: bool, line: str) -> None:
        out.print(f"[yellow]! warning: {escape(line)}[/]" if warning else f"[dim]·[/] {escape(line)}")

    since = time.time()
    if not inventory.job.shared_filesystem and inventory.job.workdir.is_dir():  # else preflight says why
        from eltctl.hosts import ignore, ops
        from eltctl.preflight import command_target

        target = command_target(inventory.job.command)
        needed = [target.name] if target is not None and target.kind == "script" else []
        for warning, line in ignore.describe(ops.code_selection(inventory), needed=needed):
            say(warning, line)
    try:
        result = client.up(inventory, detach=detach, timeout=timeout, ignore_mirror_check=ignore_mirror_check,
                           retry_failed=True,  # a person's `up`: "after a fix `eltctl up` retries at once"
                           link_test=not no_link_test,  # a person reads the advice; cron's `up` does not measure
                           progress=lambda m: out.print(f"[yellow]! {escape(m)}[/]" if m.startswith("warning:")
                                                        else f"[dim]·[/] {escape(m)}"))
    except client.UpInterrupted as stopped:
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        for line in stopped.lines(inventory.job.name):
            err.print(escape(line))
        raise typer.Exit(130) from None  # EXIT_INTERRUPTED (eltctl/cli.py): 128 + SIGINT
    for warning, line in resume.up_lines((result.status or {}).get("events") or (), since):
        say(warning, line)
    if result.controller_pid:  # 0: a finished job, unchanged, for which nothing was started (client.finished_run)
        who = "started" if result.started else "already running"
        out.print(f"controller {result.controller_pid} ({who})")
    if result.state == "waiting" and result.status.get("starts_at"):
        out.print(f"[yellow]waiting:[/] {escape(result.message)}")
        out.print("the controller starts the job by itself then (`eltctl status` shows the countdown)")
    elif result.state == "waiting":
        out.print(f"[yellow]waiting:[/] {escape(result.message)}; the controller starts the job "
                  "when enough GPUs (or CPU slots) are free (`eltctl status` shows them)")
    elif result.state == "paused":
        out.print(f"[blue]paused:[/] {escape(result.message)}; the controller resumes the job by itself "
                  "(`eltctl status` shows the hosts)")
    elif result.state == "training":
        out.print(f"[green]{escape(result.message)}[/]")
    elif result.state == "finished":
        out.print(f"[blue]finished:[/] {escape(result.message)}")
    else:
        out.print(f"{escape(result.message)}; `eltctl status` follows it")

"""`eltctl notify test [--kind KIND]`: send a test notification to `[notify]`'s targets now.

Sends one event (kind "test", or the KIND given, with a detail that says it is a test)
the way the controller sends them (eltctl/notify: the webhook's body in its format, the
command with the event on stdin), with the timeout and retries of `[notify]`, and says
what each target answered. It does not touch the controller's record (notify.json).

Exit status: 0 every target took it; 1 one failed, or `[notify]` names no target (nothing
was sent: the message says how to configure one); 2 bad usage (an unknown --kind).
"""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Notifications ([notify] in the inventory): `test` sends one now.")


@app.command("test")
def test(
    ctx: typer.Context,
    kind: str = typer.Option("test", "--kind", help="The event kind to send (test, finished, failed, ...)."),
) -> None:
    """Send a test notification to the webhook and the command of [notify], and say how it went."""
    import time

    from rich.console import Console
    from rich.markup import escape

    from eltctl.errors import EltctlError, UsageError
    from eltctl.inventory.notify import NOTIFY_EVENTS
    from eltctl.notify import Notifier, notification

    inventory = ctx.obj.inventory()
    settings = inventory.notify
    if not settings.enabled:
        # Nothing was sent: a failure of what was asked (1), not a mistake in the command line (2).
        raise EltctlError(f"no notifications are configured: {inventory.path} has no [notify] webhook or "
                          "command, so there is nothing to test",
                          hint='add a [notify] section to it with webhook = "https://..." (ntfy, Slack, a generic '
                               'JSON POST) and/or command = ["/path/to/program"]; docs/notifications.md')
    if kind not in ("test", *NOTIFY_EVENTS):
        raise UsageError(f"--kind must be test or one of {', '.join(NOTIFY_EVENTS)}, not {kind!r}")
    event = notification(kind, inventory.job.name, time.time(), "a test notification sent by `eltctl notify test`",
                         test=True)
    console = Console(highlight=False)
    results = Notifier(settings).deliver(event)
    for r in results:
        if r["ok"]:
            console.print(f"[green]sent[/] to {escape(r['target'])} ({r['attempts']} attempt(s))")
        else:
            console.print(f"[red]failed[/] to {escape(r['target'])} after {r['attempts']} attempt(s): "
                          f"{escape(str(r['error']))}")
    if not all(r["ok"] for r in results):
        raise typer.Exit(1)

"""`eltctl logs HOST`: the daemon's and the workers' logs of the job on one host."""

from __future__ import annotations

import typer


def logs(
    ctx: typer.Context,
    host: str = typer.Argument(..., help="The inventory name of the host."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until Ctrl-C."),
    lines: int = typer.Option(20, "--lines", "-n", min=0, help="How many of the last lines of each log to show first."),
) -> None:
    """The daemon's and the workers' logs from HOST, each line prefixed with its source."""
    import asyncio
    import sys

    from eltctl.errors import UsageError
    from eltctl.logs import show_logs
    from eltctl.hosts.fleet import Fleet

    inventory = ctx.obj.inventory()
    try:
        target = inventory.host(host)
    except KeyError:
        names = ", ".join(h.name for h in inventory.hosts)
        raise UsageError(f"no host {host!r} in {inventory.path}", hint=f"hosts: {names}") from None

    def emit(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    async def main() -> None:
        async with Fleet(inventory) as fleet:
            transport = await fleet.transport(target)
            await show_logs(transport, inventory.job.name, target.name, lines=lines,
                            follow=follow, emit=emit)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        raise typer.Exit(0) from None

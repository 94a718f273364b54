"""`eltctl logs HOST`: the daemon's and the workers' logs of the job on one host.

`--failed` shows only the logs of the workers that failed (crashed or lost: the
job's status on this machine says which, from the host daemon's worker states and
the crash events); `--worker SLOT` only those of the given slots.
"""

from __future__ import annotations

import typer

from eltctl.completion import complete_host


def logs(
    ctx: typer.Context,
    host: str = typer.Argument(..., metavar="HOST", help="The inventory name of the host.",
                               autocompletion=complete_host),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until Ctrl-C."),
    lines: int = typer.Option(20, "--lines", "-n", min=0, help="How many of the last lines of each log to show first."),
    failed: bool = typer.Option(
        False, "--failed", help="Only the logs of the workers that failed (crashed or lost), as the job's "
                                "status says; each is named first, with what is known of why, on stderr."),
    worker: list[int] = typer.Option(
        None, "--worker", "-w", min=0, show_default=False, metavar="SLOT",
        help="Only the log of the worker on this slot (a GPU index, or a CPU slot); repeat for several."),
) -> None:
    """The daemon's and the workers' logs from HOST, each line prefixed with its source."""
    import asyncio
    import sys

    from eltctl.logs import show_logs
    from eltctl.hosts.fleet import Fleet

    inventory = ctx.obj.inventory()
    (target,) = inventory.hosts_named([host])  # an unknown name: exit 2, with a did-you-mean

    slots: set[int] | None = set(worker) if worker else None
    if failed:
        why = failed_workers_of(inventory.job.name, target.name)
        if not why and not slots:
            sys.stderr.write(f"no worker of job {inventory.job.name!r} on {target.name} has failed "
                             "(as its status on this machine says); `eltctl logs "
                             f"{target.name}` shows every log\n")
            return
        for slot, what in why.items():
            sys.stderr.write(f"worker {slot} failed: {what}\n")
        slots = (slots or set()) | set(why)

    def emit(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    async def main() -> list[str]:
        async with Fleet(inventory) as fleet:
            transport = await fleet.transport(target)
            return await show_logs(transport, inventory.job.name, target.name, lines=lines,
                                   follow=follow, emit=emit, slots=slots)

    try:
        read = asyncio.run(main())
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    if slots:
        from eltctl.hosts import layout

        missing = [s for s in sorted(slots) if layout.worker_log(s) not in read]
        for slot in missing:
            sys.stderr.write(f"no log of worker {slot} on {target.name} "
                             f"({layout.worker_log(slot)} in the job's directory)\n")
        if len(missing) == len(slots):
            raise typer.Exit(1)


def failed_workers_of(job: str, host: str) -> dict[int, str]:
    """The slots of `host` whose worker failed, with what is known of why, from the job's
    status on this machine (the live controller, else its last status.json)."""
    import os

    from eltctl.errors import EltctlError
    from eltctl.statusview import NoJobError, failed_workers, job_state_dir, read_snapshot

    try:
        snapshot = read_snapshot(job, job_state_dir(job, os.environ))
    except NoJobError as exc:
        raise EltctlError(f"no status of job {job!r} on this machine to tell which workers failed",
                          hint=f"`eltctl logs {host} --worker SLOT` shows one worker's log "
                               f"({exc.message})") from None
    return failed_workers(snapshot.document, host)

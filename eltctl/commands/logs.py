"""`eltctl logs [HOST]`: the daemon's and the workers' logs of the job; `--controller` its controller's.

With HOST, that host's logs, each line prefixed with its source (`[daemon]`, `[worker 0]`).
Without, every host's, each line prefixed with the host's name too, host after host (as
they arrive with `--follow`); a host not reached or where the job never ran is said on
stderr, and the others are shown (exit 3 when a host was not reached). `--controller`
shows the controller's log on this machine (controller.log in the job's state directory).

`--failed` shows only the logs of the workers that failed (crashed or lost: the job's
status on this machine says which, from the host daemon's worker states and the crash
events), and of each only that worker's own output: a slot's log holds every worker that
ran on the slot, and the daemon records where each one's output began. `--worker SLOT`
shows only those of the given slots.
"""

from __future__ import annotations

from typing import Optional

import typer

from eltctl.completion import complete_host


def logs(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, metavar="HOST", show_default=False,
                                         help="The inventory name of the host (default: every host).",
                                         autocompletion=complete_host),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until Ctrl-C."),
    lines: int = typer.Option(20, "--lines", "-n", min=0, help="How many of the last lines of each log to show first."),
    failed: bool = typer.Option(
        False, "--failed", help="Only the logs of the workers that failed (crashed or lost), as the job's "
                                "status says, each from that worker's start; each is named first, with what is "
                                "known of why, on stderr."),
    worker: list[int] = typer.Option(
        None, "--worker", "-w", min=0, show_default=False, metavar="SLOT",
        help="Only the log of the worker on this slot (a GPU index, or a CPU slot); repeat for several."),
    controller: bool = typer.Option(
        False, "--controller", help="The controller's log on this machine instead (controller.log in the job's "
                                    "state directory)."),
) -> None:
    """The daemon's and the workers' logs from HOST (or every host), each line prefixed with its source."""
    import sys

    from eltctl.errors import UsageError

    inventory = ctx.obj.inventory()
    job = inventory.job.name
    if controller:
        if host is not None or failed or worker:
            raise UsageError("--controller shows the controller's log alone",
                             hint="leave out HOST, --failed and --worker, or --controller")
        _controller_log(job, lines=lines, follow=follow)
        return
    targets = inventory.hosts_named([host]) if host is not None else list(inventory.hosts)  # unknown: exit 2

    slots: dict[str, set[int]] | None = {h.name: set(worker) for h in targets} if worker else None
    starts: dict[str, dict[int, int]] = {}
    if failed:
        doc = status_document(job, host)
        slots = slots or {h.name: set() for h in targets}
        if not _failed(doc, targets, slots, starts):
            where = f" on {host}" if host is not None else ""
            sys.stderr.write(f"no worker of job {job!r}{where} has failed (as its status on this machine says); "
                             f"`eltctl logs{' ' + host if host else ''}` shows every log\n")
            return
    if host is not None:
        _one_host(inventory, targets[0], lines=lines, follow=follow,
                  slots=None if slots is None else slots[host], starts=starts.get(host))
    else:
        _every_host(inventory, targets, lines=lines, follow=follow, slots=slots, starts=starts,
                    worker=bool(worker))


def _failed(doc: dict, targets, slots: dict[str, set[int]], starts: dict[str, dict[int, int]]) -> bool:
    """Add each host's failed slots to `slots` and their log starts to `starts`, saying on
    stderr which failed and why; False when none did."""
    import sys

    from eltctl.logs import failed_log_starts
    from eltctl.statusview import FAILED_WORKER_STATES, failed_workers

    told = False
    for h in targets:
        why = failed_workers(doc, h.name)
        starts[h.name] = {s: off for s, off in failed_log_starts(doc, h.name, FAILED_WORKER_STATES).items()
                          if s in why}
        prefix = f"{h.name}: " if len(targets) > 1 else ""
        for slot, what in why.items():
            sys.stderr.write(f"{prefix}worker {slot} failed: {what}\n")
        if why:
            told = True
            slots[h.name] |= set(why)
        elif not slots[h.name]:
            slots.pop(h.name)
    return told or any(slots.values())


def _one_host(inventory, target, *, lines: int, follow: bool, slots: set[int] | None,
              starts: dict[int, int] | None) -> None:
    import asyncio
    import sys

    from eltctl.hosts.fleet import Fleet
    from eltctl.logs import show_logs

    def emit(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    async def main() -> list[str]:
        async with Fleet(inventory) as fleet:
            transport = await fleet.transport(target)
            return await show_logs(transport, inventory.job.name, target.name, lines=lines,
                                   follow=follow, emit=emit, slots=slots, starts=starts)

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


def _every_host(inventory, targets, *, lines: int, follow: bool, slots: dict[str, set[int]] | None,
                starts: dict[str, dict[int, int]], worker: bool) -> None:
    import asyncio
    import sys

    from eltctl.errors import EltctlError, HostError
    from eltctl.hosts.fleet import Fleet
    from eltctl.logs import NoLogsError, show_hosts_logs

    def emit(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    async def main():
        async with Fleet(inventory) as fleet:
            return await show_hosts_logs(fleet.transport, targets, inventory.job.name, lines=lines, follow=follow,
                                         emit=emit, slots=slots, starts=starts)

    try:
        results = asyncio.run(main())
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    unreached = [r for r in results if isinstance(r.error, HostError)]
    for r in results:
        if isinstance(r.error, NoLogsError):
            sys.stderr.write(f"{r.host}: no logs of job {inventory.job.name!r} (it has not run there)\n")
        elif r.error is not None:
            sys.stderr.write(f"{r.error.message}\n")
    if unreached:
        raise typer.Exit(HostError.exit_code)
    if not any(r.read for r in results):
        what = "of those workers " if worker else ""
        raise EltctlError(f"no host has logs {what}of job {inventory.job.name!r}",
                          hint="`eltctl status` shows where the job runs")


def _controller_log(job: str, *, lines: int, follow: bool) -> None:
    import os
    import sys

    from eltctl.controller.statedir import StateDir
    from eltctl.logs import show_local_log

    def emit(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    try:
        show_local_log(StateDir.for_job(job, os.environ).controller_log, lines=lines, follow=follow, emit=emit)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def status_document(job: str, host: str | None) -> dict:
    """The job's status on this machine (the live controller, else its last status.json),
    which says which workers failed."""
    import os

    from eltctl.errors import EltctlError
    from eltctl.statusview import NoJobError, job_state_dir, read_snapshot

    try:
        return read_snapshot(job, job_state_dir(job, os.environ)).document
    except NoJobError as exc:
        shown = f"{host} " if host else ""
        raise EltctlError(f"no status of job {job!r} on this machine to tell which workers failed",
                          hint=f"`eltctl logs {shown}--worker SLOT` shows one worker's log "
                               f"({exc.message})") from None


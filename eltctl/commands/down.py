"""`eltctl down`: a final checkpoint, then every worker, daemon and the controller stop."""

from __future__ import annotations

import typer


def down(
    ctx: typer.Context,
    force: bool = typer.Option(False, "--force", help="Kill what does not stop (a broken job)."),
) -> None:
    """Stop the job, then check that no process of it is left on any host."""
    from rich.console import Console
    from rich.markup import escape

    from eltctl.controller import client

    out = Console(highlight=False, soft_wrap=True)
    inventory = ctx.obj.inventory()
    result = client.down(inventory, force=force, progress=lambda m: out.print(f"[dim]·[/] {escape(m)}"))
    ck = result.checkpoint
    if ck and ck.get("step") is not None:
        out.print(f"final checkpoint: {checkpoint_name(ck)}"
                  + (f" at {escape(str(ck['path']))}" if ck.get("path") else ""))
    mirror_line = describe_mirror(result.mirror, ck)
    if mirror_line:
        out.print(mirror_line)
    for host, pids in result.killed.items():
        out.print(f"[yellow]{escape(host)}: killed {', '.join(map(str, pids))}[/]")
    names = ", ".join(h.name for h in inventory.hosts)
    if result.ok:
        out.print(f"[green]no process of job {escape(inventory.job.name)} left on {escape(names)}[/]")
        _cron_note(inventory, out)
        return
    for host, procs in result.left.items():
        for pid, cmd in procs:
            out.print(f"[red]{escape(host)}: pid {pid} still runs:[/] {escape(cmd[:120])}")
    for host, why in result.unchecked.items():
        out.print(f"[red]{escape(host)}: could not be checked:[/] {escape(why)}")
    if result.message:
        out.print(escape(result.message))
    hint = "" if force else " (`eltctl down --force` kills what is left)"
    out.print(f"job {escape(inventory.job.name)} is not fully down{hint}")
    raise typer.Exit(1)


def _cron_note(inventory, out) -> None:
    """A job kept alive by cron comes back at the next run: say so after `down`."""
    from rich.markup import escape

    from eltctl import cron

    line = cron.installed(inventory)
    if line:
        out.print(f"[yellow]note:[/] your crontab still runs this job ({escape(line.split(' cd ', 1)[0])}): its "
                  "next run starts it again; `eltctl cron --remove` takes the entry out")


def checkpoint_name(ck: dict) -> str:
    """`step N`; in restart mode `script step N (snapshot M)`: eltctl's checkpoints of a
    restart-mode job are numbered by the snapshot counter, the user knows the script's step."""
    if "snapshot" not in ck:
        return f"step {ck.get('step')}"
    if ck.get("script_step") is None:
        return f"snapshot {ck.get('step')} (the script's step is not known)"
    return f"script step {ck['script_step']} (snapshot {ck.get('step')})"


def describe_mirror(mirror: dict | None, checkpoint: dict | None) -> str | None:
    """The line `down` prints about the final checkpoint's copy on the mirror (rich markup)."""
    from rich.markup import escape

    if not mirror:
        return None
    target = escape(str(mirror.get("target")))
    step = (checkpoint or {}).get("step")
    if step is None:  # no final checkpoint is known (the store was gone): say what the mirror holds
        newest = mirror.get("step")
        return (f"newest checkpoint on the mirror {target}: step {newest}" if newest is not None
                else f"no checkpoint on the mirror {target}")
    if mirror.get("ok") and mirror.get("step") is not None:
        name = (checkpoint_name(checkpoint) if checkpoint and "snapshot" in checkpoint and mirror["step"] == step
                else f"step {mirror['step']}")
        return f"[green]final checkpoint {name} mirrored and verified to {target}[/]"
    why = mirror.get("last_error") or "the copy did not finish in time"
    newest = mirror.get("step")
    have = f"; the newest mirrored step is {newest}" if newest is not None else ""
    what = f"final checkpoint step {step}" if step is not None else "the final checkpoint"
    return f"[red]{what} NOT mirrored to {target}: {escape(str(why))}{have}[/]"

"""`eltctl checkpoints`: the job's checkpoints on each host and on the mirror, verified;
`eltctl checkpoints export OUT.pt`: one of them as a plain torch file.

Listing: exit status 0 when everything could be listed; 3 when a host or the mirror
could not be reached (what was found elsewhere is still shown). Never imports torch.
Export imports torch (to write the file), and only then; it refuses to replace an existing
file unless --force (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(invoke_without_command=True, no_args_is_help=False, add_completion=False,
                  help="Local (per host) and mirrored checkpoints; `export` one as a plain file.")


@app.callback()
def checkpoints(
    ctx: typer.Context,
    json_out: bool = typer.Option(False, "--json", help="Print {mirror, checkpoints, errors} as JSON."),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="Trust the manifests; skip recomputing sha256 where the files are."),
) -> None:
    """Local (per host) and mirrored checkpoints: step, time, size, where, verified."""
    if ctx.invoked_subcommand is not None:
        return
    import asyncio
    import json
    import sys

    from eltctl.mirror import list_all

    inventory = ctx.obj.inventory()
    listing = asyncio.run(list_all(inventory, verify=not no_verify,
                                   timeout=inventory.ssh.connect_timeout + 600))
    if json_out:
        sys.stdout.write(json.dumps(listing.as_json(), indent=2) + "\n")
    else:
        render(listing)
    if listing.errors:
        raise typer.Exit(3)


@app.command("export")
def export(
    ctx: typer.Context,
    out: Path = typer.Argument(..., help="The file to write (e.g. model.pt); an existing one only with --force."),
    step: Optional[int] = typer.Option(None, "--step", help="This step (default: the newest that verifies)."),
    source: Optional[str] = typer.Option(None, "--from", help="Only from this host, or 'mirror'."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists (atomically)."),
) -> None:
    """Write a checkpoint as a plain torch file: {model, optimizer, extra_state, step, epoch}.

    It opens with torch.load(OUT, weights_only=True), without eltctl installed. The checkpoint is brought here from the mirror or a host and verified first."""
    import asyncio
    import tempfile

    from rich.console import Console
    from rich.markup import escape

    from eltctl.errors import EltctlError
    from eltctl.mirror.fetch import fetch_checkpoint

    from eltctl.mirror.values import MIRROR_LABEL

    inventory = ctx.obj.inventory()
    if source is not None and source != MIRROR_LABEL:
        inventory.hosts_named([source])  # an unknown name: exit 2, with a did-you-mean
    out = out.expanduser().resolve()
    if out.is_dir():
        raise EltctlError(f"{out} is a directory", hint="give the file to write, e.g. model.pt")
    if not out.parent.is_dir():
        raise EltctlError(f"{out.parent} does not exist", hint="create the directory first, or write elsewhere")
    refuse_existing(out, force)
    console = Console(highlight=False, stderr=True)
    with tempfile.TemporaryDirectory(prefix=".eltctl-export-", dir=out.parent) as work:
        fetched = asyncio.run(fetch_checkpoint(inventory, Path(work), step=step, source=source,
                                               timeout=inventory.ssh.connect_timeout + 3600))
        for why in fetched.skipped:
            console.print(f"[yellow]passed over[/] {escape(why)}", soft_wrap=True)
        import importlib.util

        if importlib.util.find_spec("torch") is None:  # the file is written with torch.save
            raise EltctlError("exporting needs torch on this machine, and it has none",
                              hint="pip install torch==2.13.0 (the controller needs it too)")
        from eltctl_runtime.checkpoint.format import InvalidCheckpoint
        from eltctl_runtime.checkpoint.load import export_checkpoint

        try:
            done = export_checkpoint(fetched.path, out)  # atomic: a reader sees no file or the whole one
        except InvalidCheckpoint as e:
            raise EltctlError(f"step {fetched.step} from {fetched.where} cannot be exported: {e}") from e
    typer.echo(f"exported step {done['step']} (epoch {done['epoch']}, from {fetched.where}) to {out} "
               f"({_size(done['size'])}); load it with torch.load({str(out)!r}, weights_only=True)")


def refuse_existing(out: Path, force: bool) -> None:
    """An existing OUT is replaced only with --force (checked before anything is fetched)."""
    import shlex

    from eltctl.errors import UsageError

    if (out.exists() or out.is_symlink()) and not force:
        raise UsageError(f"{out} already exists; not overwriting it",
                         hint=f"`eltctl checkpoints export {shlex.quote(str(out))} --force` replaces it, "
                              "or name another file")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def render(listing) -> None:
    import time

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"mirror: {escape(listing.mirror or 'none (set [storage] mirror)')}", soft_wrap=True)
    if not listing.checkpoints:
        places = "the hosts" + (" or the mirror" if listing.mirror else "")
        console.print(f"no checkpoints on {places}"
                      + ("" if listing.errors else
                         " yet: rank 0 writes one every checkpoint_every_steps (or _seconds) of ElasticJob "
                         "while the job trains"), soft_wrap=True)
        for where, error in listing.errors:
            console.print(f"[red]{escape(where)}[/]: {escape(error)}")
        return
    table = Table()
    # restart mode: eltctl's checkpoints are the snapshots of the script's directory; the script's step beside
    restart = any(c.script_step is not None for c in listing.checkpoints)
    cols = ("snapshot", "script step") if restart else ("step",)
    for col in (*cols, "time", "size", "where", "verified"):
        table.add_column(col, justify="right" if col in ("step", "snapshot", "script step", "size") else "left")
    for c in listing.checkpoints:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.created)) if c.created else "?"
        verified = {True: "[green]yes[/]", False: f"[red]NO[/] {escape(c.problem or '')}", None: "-"}[c.verified]
        steps = (str(c.step), str(c.script_step) if c.script_step is not None else "?") if restart else (str(c.step),)
        table.add_row(*steps, when, _size(c.size), escape(c.where), verified)
    console.print(table)
    for where, error in listing.errors:
        console.print(f"[red]{escape(where)}[/]: {escape(error)}")

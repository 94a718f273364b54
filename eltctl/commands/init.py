"""`eltctl init`: write the commented starter inventory (eltctl/templates/hosts.example.toml).

The starter documents every key with a comment and parses as it is, so the first
`eltctl doctor` after editing it already talks about hosts, not about syntax.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import typer

from eltctl.errors import UsageError

STARTER_FILE = "hosts.example.toml"  # in the package eltctl.templates


def starter_text() -> str:
    """The starter inventory: the package's templates/hosts.example.toml (the repository's
    hosts.example.toml is a symlink to it, so there is one text)."""
    from importlib import resources

    return resources.files("eltctl.templates").joinpath(STARTER_FILE).read_text(encoding="utf-8")


def __getattr__(name: str) -> str:
    # `STARTER` read on first use, not at import: `eltctl --help` imports this module.
    if name == "STARTER":
        return starter_text()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def write_starter(path: Path, *, force: bool = False) -> Path:
    """Write the starter inventory to `path` (parent directories too); refuse to overwrite unless `force`."""
    if path.is_dir():
        raise UsageError(f"{path} is a directory",
                         hint=f"name a file, e.g. `eltctl init {shlex.quote(str(path / 'hosts.toml'))}`")
    if path.exists() and not force:
        raise UsageError(
            f"{path} already exists; not overwriting it",
            hint=f"`eltctl init {shlex.quote(str(path))} --force` replaces it, or name another file",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    text = starter_text()
    if not force:
        try:
            with open(path, "x", encoding="utf-8") as f:  # "x": never clobber a file that appeared meanwhile
                f.write(text)
        except FileExistsError:
            raise UsageError(f"{path} already exists; not overwriting it",
                             hint="`eltctl init --force` replaces it") from None
        return path
    from eltctl_runtime.files import write_atomic

    # A temporary file renamed into place: an interrupted --force never leaves half a file.
    write_atomic(path, text, mode=0o644)
    return path


def init(
    ctx: typer.Context,
    path: Optional[Path] = typer.Argument(
        None, help="Where to write it.", show_default="the -i inventory, else ./hosts.toml"),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write a commented starter inventory to edit."""
    from rich.console import Console
    from rich.markup import escape

    default = ctx.obj.inventory_path
    target = write_starter(path or default, force=force)
    # The next commands find the file by themselves only where eltctl looks without
    # -i: ./hosts.toml, or $ELTCTL_INVENTORY when that is set.
    found = target == default and ctx.obj.inventory_origin != "-i"
    flag = "" if found else f"-i {shlex.quote(str(target))} "
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"Wrote {escape(str(target))}, a commented starter inventory.")
    out.print("Next:")
    out.print(f"  1. Edit it: the \\[job] to run and one \\[\\[hosts]] section per machine.")
    out.print(f"  2. [bold]eltctl {escape(flag)}doctor[/]  checks every host: SSH, host keys, "
              "Python and torch, nvidia-smi.")
    out.print(f"  3. [bold]eltctl {escape(flag)}probe[/]   shows every host's GPUs and which are free.")

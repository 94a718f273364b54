"""`eltctl init`: write a starter inventory.

By default a short one made for this machine (eltctl/templates/starter.toml): the job,
and this machine as its one host, without SSH, with an interpreter that has torch and
its GPUs or CPU slots. Only [job] command needs an edit before `eltctl doctor` and
`eltctl up` work. `--full` writes the reference instead
(eltctl/templates/hosts.example.toml): every key with a comment, and example hosts of
each kind, which parses as it is but names machines that are not yours.
"""

from __future__ import annotations

import os
import re
import shlex
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from eltctl.errors import UsageError

STARTER_FILE = "hosts.example.toml"  # in the package eltctl.templates: the full reference
SHORT_FILE = "starter.toml"  # the short starter for this machine


def _template(name: str) -> str:
    from importlib import resources

    return resources.files("eltctl.templates").joinpath(name).read_text(encoding="utf-8")


def starter_text() -> str:
    """The full reference inventory: the package's templates/hosts.example.toml (the
    repository's hosts.example.toml is a symlink to it, so there is one text)."""
    return _template(STARTER_FILE)


@dataclass(frozen=True)
class Machine:
    """What the short starter says about this machine."""

    python: str  # an interpreter with torch: this one if it has torch, else "python3"
    gpus: bool  # nvidia-smi is on PATH
    cpus: int


def this_machine() -> Machine:
    """This machine's facts, without importing torch (a spec lookup only)."""
    import importlib.util
    import shutil
    import sys

    has_torch = importlib.util.find_spec("torch") is not None
    return Machine(python=sys.executable if has_torch and sys.executable else "python3",
                   gpus=shutil.which("nvidia-smi") is not None, cpus=os.cpu_count() or 1)


def job_name_for(directory: Path) -> str:
    """A job name from the inventory's directory name (letters, digits, '.', '_', '-')."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", directory.resolve().name).strip("-.")
    return name[:64] or "my-job"


def short_text(name: str, machine: Machine) -> str:
    """The short starter: the job `name` on this machine alone."""
    if machine.gpus:
        capacity = 'gpus = "all"'
        comment = ("Its GPUs, each once it has looked free\n# for [policy] idle_for (10 minutes unless "
                   "you set it): they may be someone else's.")
    else:
        slots = max(1, min(4, machine.cpus // 2))
        capacity = f"slots = {slots}"
        comment = (f"No GPUs: {slots} CPU worker(s), used at once\n# (a CPU slot has no "
                   "owner's process to wait for; [policy] cpu_idle_for makes them wait).")
    return string.Template(_template(SHORT_FILE)).substitute(
        name=name, python=machine.python.replace("\\", "\\\\").replace('"', '\\"'), capacity=capacity,
        capacity_comment=comment)


def __getattr__(name: str) -> str:
    # `STARTER` read on first use, not at import: `eltctl --help` imports this module.
    if name == "STARTER":
        return starter_text()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def write_starter(path: Path, *, force: bool = False, full: bool = False) -> Path:
    """Write the starter inventory to `path` (parent directories too): the short one for
    this machine, or with `full` the reference; refuse to overwrite unless `force`."""
    if path.is_dir():
        raise UsageError(f"{path} is a directory",
                         hint=f"name a file, e.g. `eltctl init {shlex.quote(str(path / 'hosts.toml'))}`")
    if path.exists() and not force:
        raise UsageError(
            f"{path} already exists; not overwriting it",
            hint=f"`eltctl init {shlex.quote(str(path))} --force` replaces it, or name another file",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    text = starter_text() if full else short_text(job_name_for(path.parent), this_machine())
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
    full: bool = typer.Option(False, "--full",
                              help="Write the reference instead: every key explained, example hosts of each kind."),
) -> None:
    """Write a starter inventory for this machine (set its command, then `doctor` and `up`)."""
    from rich.console import Console
    from rich.markup import escape

    default = ctx.obj.inventory_path
    target = write_starter(path or default, force=force, full=full)
    # The next commands find the file by themselves only where eltctl looks without
    # -i: ./hosts.toml, or $ELTCTL_INVENTORY when that is set.
    found = target == default and ctx.obj.inventory_origin != "-i"
    flag = "" if found else f"-i {shlex.quote(str(target))} "
    out = Console(highlight=False, soft_wrap=True)
    if full:
        out.print(f"Wrote {escape(str(target))}, the commented reference inventory.")
        out.print("Next:")
        out.print("  1. Edit it: the \\[job] to run and one \\[\\[hosts]] section per machine (its example "
                  "hosts are not yours).")
    else:
        out.print(f"Wrote {escape(str(target))}, a starter inventory for this machine.")
        out.print("Next:")
        out.print("  1. Set \\[job] command to your training script (examples/train.py in eltctl's repository "
                  "is one).")
    out.print(f"  2. [bold]eltctl {escape(flag)}doctor[/]  checks the job and every host: SSH, host keys, "
              "Python and torch, nvidia-smi.")
    out.print(f"  3. [bold]eltctl {escape(flag)}up[/]      starts training; [bold]eltctl {escape(flag)}status[/] "
              "follows it.")

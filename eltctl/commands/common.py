"""What every command shares: which inventory it runs on, and help text read as text.

Which inventory (`choose_inventory`, pure; `resolve` gathers its facts), first match wins:
  1. `-i FILE`, before or after the command's name (`eltctl -i F status`, `eltctl status -i F`);
  2. `--job NAME`: the inventory job NAME's controller was started from (its record in
     the job's state directory, controller.json); `-i` and `--job` together are refused;
  3. `$ELTCTL_INVENTORY`;
  4. `./hosts.toml`, when the current directory has one;
  5. the running job's recorded inventory, when exactly one job's controller runs on
     this machine (several: an error that lists them and says `--job NAME`);
  6. else `./hosts.toml`, whose absence is the usual "no such inventory file" (its hint
     then names the stopped jobs recorded here, for `--job NAME`).

`InventoryCommand` / `InventoryGroup` give every command `-i` and `--job` after its name
(`JOB_LESS` commands only `-i`), so a user need not remember where the option goes.
Every help text of the CLI is escaped once here (`plain_help`): typer reads help as rich
markup, which ate the inventory's section names (`[notify]`, `[storage]`); no help text
of eltctl uses markup.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import typer
from typer.core import TyperCommand, TyperGroup

from eltctl.errors import UsageError

if TYPE_CHECKING:
    from eltctl.controller.statedir import RecordedJob
    from eltctl.inventory import Inventory

DEFAULT_INVENTORY = "hosts.toml"
INVENTORY_PARAM, JOB_PARAM = "eltctl_inventory", "eltctl_job"


# --------------------------------------------------------------------------- which inventory (pure)

@dataclass(frozen=True)
class Choice:
    """The inventory a command runs on, who chose it (for messages: "-i", "--job t", ...),
    and a note for stderr when it was not the user's words that named it."""

    path: Path
    origin: str | None
    note: str | None = None
    if_missing: str | None = None  # more hint when the file turns out missing: the jobs recorded here


def choose_inventory(given: Path, origin: str | None, job: str | None, *, default_exists: bool,
                     recorded: Sequence[RecordedJob]) -> Choice:
    """The inventory to use (see the module docstring): `given` and `origin` are the `-i`
    option's value and source ("-i", "$ELTCTL_INVENTORY" or None for the default),
    `job` the `--job` option's, `recorded` the jobs this machine's state directory knows."""
    if job is not None:
        if origin == "-i":
            raise UsageError("-i and --job both choose the inventory; give one of them",
                             hint=f"--job {job} uses the inventory its controller was started from")
        match = [r for r in recorded if r.name == job]
        if not match:
            raise UsageError(f"no job {job!r} is recorded on this machine", hint=_listing(recorded))
        return Choice(match[0].inventory, f"--job {job}")
    if origin is not None or default_exists:
        return Choice(given, origin)
    running = [r for r in recorded if r.running]
    if len(running) == 1:
        r = running[0]
        return Choice(r.inventory, f"the running job {r.name}'s record",
                      note=f"no {given} here; using job {r.name}'s inventory {r.inventory} (its controller runs)")
    if running:
        names = ", ".join(f"{r.name} ({r.inventory})" for r in running)
        raise UsageError(f"no {given} here, and {len(running)} jobs run on this machine: {names}",
                         hint="choose one with --job NAME, or name its inventory with -i FILE")
    stopped = ", ".join(f"{r.name} ({r.inventory})" for r in recorded)
    return Choice(given, origin,
                  if_missing=f"or choose a job recorded here with --job NAME: {stopped}" if recorded else None)


def _listing(recorded: Sequence[RecordedJob]) -> str:
    if not recorded:
        return "no job was started on this machine; `eltctl up` in the job's directory starts one"
    jobs = ", ".join(f"{r.name} ({'running' if r.running else 'stopped'})" for r in recorded)
    return f"jobs recorded here: {jobs}"


# --------------------------------------------------------------------------- which inventory (I/O)

def resolve(given: Path, origin: str | None, job: str | None,
            environ: Mapping[str, str] | None = None) -> Choice:
    """`choose_inventory` with the facts read: does `given` exist, which jobs are recorded."""
    from eltctl.controller.statedir import recorded_jobs

    exists = given.exists() or given.is_symlink()
    needs_record = job is not None or (origin is None and not exists)
    return choose_inventory(given, origin, job, default_exists=exists,
                            recorded=recorded_jobs(environ) if needs_record else ())


def inventory_or_recorded_job(ctx: typer.Context) -> tuple[Inventory | None, str]:
    """The inventory and its job's name; when the inventory does not load but this
    machine's state directory records a job run from that very file, (None, that job),
    with the inventory's error printed as a warning: `status` still shows a running job
    whose hosts.toml has a typo."""
    from eltctl.errors import ConfigError

    try:
        inventory = ctx.obj.inventory()
    except ConfigError as exc:
        from eltctl.controller.statedir import recorded_jobs

        path = ctx.obj.chosen().path
        same = [r for r in recorded_jobs() if _same_file(r.inventory, path)]
        if not same:
            raise
        job = sorted(same, key=lambda r: not r.running)[0].name
        err = _stderr()
        from rich.markup import escape

        err.print(f"[yellow]warning:[/] {escape(exc.message)}")
        err.print(f"  showing job {escape(job)} from its state directory; `up`, `scale` and `down` need the "
                  "inventory fixed")
        return None, job
    return inventory, inventory.job.name


def _same_file(a: Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _stderr():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def print_note(note: str) -> None:
    from rich.markup import escape

    _stderr().print(f"[dim]{escape(note)}[/]")


# --------------------------------------------------------------------------- the options after a command's name

def _options(
    eltctl_inventory: Optional[Path] = typer.Option(
        None, "--inventory", "-i", show_default=False,
        help="The inventory file (also before the command: eltctl -i FILE ...)."),
    eltctl_job: Optional[str] = typer.Option(
        None, "--job", show_default=False,
        help="The job of that name on this machine: the inventory its controller was started from."),
) -> None:
    """Only its parameters are used: typer builds them as for any command."""


@functools.cache
def _built_params() -> tuple:
    import typer.main

    holder = typer.Typer(add_completion=False)
    holder.command()(_options)
    return tuple(typer.main.get_command(holder).params)


def _shared_params(job: bool) -> list:
    return [p for p in _built_params() if job or p.name != JOB_PARAM]


def plain_help(command) -> None:
    """Escape the help of `command` and its parameters where typer reads it as rich markup."""
    if getattr(command, "rich_markup_mode", None) != "rich":
        return  # markdown, or no markup: the text is shown as written
    from rich.markup import escape

    for owner in (command, *command.params):
        for attr in ("help", "short_help"):
            text = getattr(owner, attr, None)
            if isinstance(text, str) and not getattr(owner, f"_eltctl_plain_{attr}", False):
                setattr(owner, attr, escape(text))
                setattr(owner, f"_eltctl_plain_{attr}", True)


def take_shared_options(ctx) -> None:
    """Move `-i` / `--job` given after the command's name from its parameters to the
    app's context (`ctx.obj`), where every command reads the inventory."""
    path = ctx.params.pop(INVENTORY_PARAM, None)
    job = ctx.params.pop(JOB_PARAM, None)
    if ctx.obj is None:
        return  # called outside the app (a test's own click context)
    if path is not None:
        ctx.obj.set_inventory(Path(path), "-i")
    if job is not None:
        ctx.obj.job = job


class InventoryCommand(TyperCommand):
    """A command with `-i FILE` and `--job NAME` after its name, its help read as text."""

    with_job = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.params.extend(_shared_params(self.with_job))
        plain_help(self)

    def invoke(self, ctx):
        take_shared_options(ctx)
        return super().invoke(ctx)


class InventoryOnlyCommand(InventoryCommand):
    """`-i FILE` only (`init`: it writes the file; no job is chosen)."""

    with_job = False


class InventoryGroup(TyperGroup):
    """A group of commands (`notify`, `checkpoints`) with `-i` and `--job` after its name."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.params.extend(_shared_params(True))
        plain_help(self)

    def invoke(self, ctx):
        take_shared_options(ctx)
        return super().invoke(ctx)


class PlainHelpGroup(TyperGroup):
    """The app itself: its help and its global options' read as text."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        plain_help(self)


class PlainHelpCommand(TyperCommand):
    """A command that takes no inventory (`demo`), its help read as text."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        plain_help(self)


__all__ = ["Choice", "InventoryCommand", "InventoryGroup", "InventoryOnlyCommand", "PlainHelpCommand",
           "PlainHelpGroup", "choose_inventory", "inventory_or_recorded_job", "plain_help", "print_note", "resolve"]

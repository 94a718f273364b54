"""The `eltctl` command line: global options, command registration, the error edge.

Commands live one per module in `eltctl.commands`, each a plain function that
`eltctl.commands.register` adds to the app; each stays thin: parse, call the
library, render with rich. A command ends with a non-zero status by raising an `EltctlError`
or `typer.Exit(code)`; it never returns a status.

Exit codes (README, "Exit codes"), decided here and nowhere else:
  0 success; 1 a runtime failure (EltctlError); 2 bad usage or configuration
  (a usage error, ConfigError); 3 a required host failed (HostError);
  130 interrupted (Ctrl-C). Anything else is a bug and keeps its traceback.

Importing this module must stay cheap (`eltctl --help` well under 0.5 s): commands
import torch, asyncssh and the heavier library parts inside their functions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from eltctl.commands.common import DEFAULT_INVENTORY, PlainHelpGroup
from eltctl.errors import ConfigError, EltctlError

if TYPE_CHECKING:
    from eltctl.commands.common import Choice
    from eltctl.inventory import Inventory

INVENTORY_ENV = "ELTCTL_INVENTORY"

EXIT_OK = 0
EXIT_FAILURE = 1  # EltctlError.exit_code
EXIT_USAGE = 2  # UsageError / ConfigError, and typer's own usage errors
EXIT_HOST = 3  # HostError
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


@dataclass
class AppContext:
    """What every command gets (`ctx.obj`): where the inventory is, loaded on first use.

    `inventory_path` and `inventory_origin` are the `-i` option's (before or after the
    command's name) or $ELTCTL_INVENTORY's, the origin saying who chose the path ("-i",
    "$ELTCTL_INVENTORY", or None for the default) so a missing file can be explained;
    `job` is `--job NAME`. Which file is used follows from them
    (eltctl/commands/common.py: `choose_inventory`).
    """

    inventory_path: Path
    inventory_origin: str | None = None
    job: str | None = None
    _inventory: Inventory | None = field(default=None, repr=False)
    _choice: Choice | None = field(default=None, repr=False)

    def set_inventory(self, path: Path, origin: str | None) -> None:
        self.inventory_path, self.inventory_origin = path, origin
        self._inventory = self._choice = None

    def chosen(self) -> Choice:
        """The inventory file to use and who chose it (a note on stderr when eltctl did)."""
        if self._choice is None:
            from eltctl.commands.common import print_note, resolve

            self._choice = resolve(self.inventory_path, self.inventory_origin, self.job)
            if self._choice.note:
                print_note(self._choice.note)
        return self._choice

    def inventory(self) -> Inventory:
        if self._inventory is None:
            from eltctl.inventory import load_inventory

            choice = self.chosen()
            try:
                self._inventory = load_inventory(choice.path, origin=choice.origin)
            except ConfigError as exc:
                if choice.if_missing and not (choice.path.exists() or choice.path.is_symlink()):
                    exc.hint = f"{exc.hint}; {choice.if_missing}" if exc.hint else choice.if_missing
                raise
        return self._inventory


def _flags_take_no_value() -> None:
    """`--help` shows a flag (`--force`) as a flag, with no value to give.

    typer's rich help labels every option with its type, flags too (`--force <bool>`),
    so a reader tries `--force true`, which click refuses as an extra argument. A flag's
    type label is dropped here, for every command at once (also typer's own `--help`),
    and so is the type of an argument named by its metavar (`HOST`, not `HOST <list[str]>`).
    """
    from typer.core import TyperArgument, TyperOption

    if not (hasattr(TyperOption, "display_type_rich") and hasattr(TyperArgument, "display_type_rich")):
        return  # a typer without the rich type labels (older, or changed since 0.24): nothing to drop
    if getattr(TyperOption.display_type_rich, "_eltctl", False):
        return
    option_label, argument_label = TyperOption.display_type_rich, TyperArgument.display_type_rich

    def option_type(self, ctx):
        return None if self.is_flag else option_label(self, ctx)

    def argument_type(self, ctx):
        return None if self.metavar is not None else argument_label(self, ctx)

    for patched in (option_type, argument_type):
        patched._eltctl = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = option_type  # type: ignore[method-assign]
    TyperArgument.display_type_rich = argument_type  # type: ignore[method-assign]


_flags_take_no_value()

app = typer.Typer(
    name="eltctl",
    cls=PlainHelpGroup,  # help read as text: "[notify]" is a section name, not markup
    help="Elastic PyTorch training on the GPUs your lab already has, over SSH.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion (typer imports its completion code anyway)
    pretty_exceptions_enable=False,
)


@app.callback()
def _global(
    ctx: typer.Context,
    inventory: Path = typer.Option(
        Path(DEFAULT_INVENTORY),
        "--inventory",
        "-i",
        envvar=INVENTORY_ENV,
        show_envvar=True,
        help="The inventory file: the job and the hosts it may use (default: ./hosts.toml, else the "
             "inventory of the one job running on this machine). Also after the command's name.",
    ),
    job: Optional[str] = typer.Option(
        None, "--job", show_default=False,
        help="The job of that name on this machine: the inventory its controller was started from."),
) -> None:
    source = ctx.get_parameter_source("inventory")
    origin = {"COMMANDLINE": "-i", "ENVIRONMENT": f"${INVENTORY_ENV}"}.get(
        getattr(source, "name", ""))
    ctx.obj = AppContext(inventory_path=inventory, inventory_origin=origin, job=job)


def _register_commands() -> None:
    from eltctl import commands

    commands.register(app)


_register_commands()


def report_error(exc: EltctlError) -> None:
    """Print a project error to stderr the one way the CLI does: message, then hint."""
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    # Messages quote user text (paths, TOML keys like [job]): never read it as markup.
    err.print(f"[bold red]error:[/] {escape(exc.message)}")
    if exc.hint:
        err.print(f"  [bold]hint:[/] {escape(exc.hint)}")


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: run the app, map the outcome to an exit code.

    typer's standalone mode already prints usage errors (exit 2) and turns Ctrl-C
    into 130; project errors pass through it and are reported here.
    """
    try:
        app(args=argv, prog_name="eltctl")
    except EltctlError as exc:
        report_error(exc)
        return exc.exit_code
    except KeyboardInterrupt:  # raised outside a command (e.g. while importing)
        return EXIT_INTERRUPTED
    except SystemExit as exc:
        if exc.code is None:
            return EXIT_OK
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)  # sys.exit("message"): a message, status 1
        return EXIT_FAILURE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

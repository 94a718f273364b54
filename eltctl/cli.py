"""The `eltctl` command line: global options, command registration, the error edge.

Commands live one per module in `eltctl.commands`; each exposes
`register(app: typer.Typer) -> None` and stays thin: parse, call the library,
render with rich. This module turns `EltctlError`s into a message and an exit code
(README, "Exit codes"); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import typer

from eltctl.errors import EltctlError

DEFAULT_INVENTORY = "hosts.toml"
INVENTORY_ENV = "ELTCTL_INVENTORY"


@dataclass
class AppContext:
    """What every command gets: where the inventory is, loaded on first use."""

    inventory_path: Path
    _inventory: object = field(default=None, repr=False)

    def inventory(self):
        if self._inventory is None:
            from eltctl.inventory import load_inventory

            self._inventory = load_inventory(self.inventory_path)
        return self._inventory


app = typer.Typer(
    name="eltctl",
    help="Elastic PyTorch training on the GPUs your lab already has, over SSH.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _global(
    ctx: typer.Context,
    inventory: Optional[Path] = typer.Option(
        None,
        "--inventory",
        "-i",
        help=f"Inventory file [default: ${INVENTORY_ENV} or ./{DEFAULT_INVENTORY}].",
        show_default=False,
    ),
) -> None:
    path = inventory or Path(os.environ.get(INVENTORY_ENV) or DEFAULT_INVENTORY)
    ctx.obj = AppContext(inventory_path=path)


def _register_commands() -> None:
    from eltctl import commands

    for module in commands.load_all():
        module.register(app)


_register_commands()


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: run the app, map project errors to exit codes."""
    from rich.console import Console

    try:
        app(args=argv, standalone_mode=False)
    except EltctlError as exc:
        err = Console(stderr=True, highlight=False)
        err.print(f"[bold red]error:[/] {exc.message}", markup=True, soft_wrap=True)
        if exc.hint:
            err.print(f"  [bold]hint:[/] {exc.hint}", soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:  # typer/click exits (e.g. --help) pass through
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            return 2 if isinstance(exc, click.exceptions.UsageError) else exc.exit_code
        if isinstance(exc, click.exceptions.Exit):
            return exc.exit_code
        if isinstance(exc, click.exceptions.Abort):
            return 130
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())

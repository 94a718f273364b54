"""Shell completion beyond typer's own (`eltctl --install-completion`): the inventory's
host names for a HOST argument (`eltctl logs <TAB>`).

Runs in the completion request (`_ELTCTL_COMPLETE=...`), where no command runs and
`ctx.obj` is not set: the inventory is found as the command line (`-i`), then
$ELTCTL_INVENTORY, then the default name it. Any problem completes nothing: a broken
inventory is reported when the command runs, not while a user presses TAB.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer


def complete_host(ctx: typer.Context, incomplete: str) -> list[str]:
    """The inventory's host names that start with `incomplete`."""
    from eltctl.cli import DEFAULT_INVENTORY, INVENTORY_ENV

    root = ctx.find_root()
    path = root.params.get("inventory") or os.environ.get(INVENTORY_ENV) or DEFAULT_INVENTORY
    try:
        from eltctl.inventory import load_inventory

        names = [h.name for h in load_inventory(Path(path)).hosts]
    except Exception:  # noqa: BLE001 - completion must never fail loudly
        return []
    return [n for n in names if n.startswith(incomplete)]

"""Shell completion beyond typer's own (`eltctl --install-completion`): the inventory's
host names for a HOST argument (`eltctl logs <TAB>`).

Runs in the completion request (`_ELTCTL_COMPLETE=...`), where no command runs and
`ctx.obj` is not set: the inventory is the global option's value, which click has
resolved as for a command (`-i`, else $ELTCTL_INVENTORY, else hosts.toml). Any problem
completes nothing: a broken inventory is reported when the command runs, not while a
user presses TAB.
"""

from __future__ import annotations

from pathlib import Path

import typer


def complete_host(ctx: typer.Context, incomplete: str) -> list[str]:
    """The inventory's host names that start with `incomplete`."""
    path = ctx.find_root().params.get("inventory")
    if not path:
        return []
    try:
        from eltctl.inventory import load_inventory

        names = [h.name for h in load_inventory(Path(path)).hosts]
    except Exception:  # noqa: BLE001 - completion must never fail loudly
        return []
    return [n for n in names if n.startswith(incomplete)]

"""Shell completion beyond typer's own (`eltctl --install-completion`): the inventory's
host names for a HOST argument (`eltctl logs <TAB>`).

Runs in the completion request (`_ELTCTL_COMPLETE=...`), where no command runs and
`ctx.obj` is not set: the inventory is the global option's value, which click has
resolved as for a command (`-i` after the command or before it, else $ELTCTL_INVENTORY,
else hosts.toml, else the running job's: commands/common.py `resolve`). Any problem
completes nothing: a broken inventory is reported when the command runs, not while a
user presses TAB.
"""

from __future__ import annotations

from pathlib import Path

import typer

from eltctl.commands.common import DEFAULT_INVENTORY, INVENTORY_PARAM, JOB_PARAM


def complete_host(ctx: typer.Context, incomplete: str) -> list[str]:
    """The inventory's host names that start with `incomplete`."""
    root = ctx.find_root().params
    path = ctx.params.get(INVENTORY_PARAM) or root.get("inventory")  # `-i` after the command, else before
    if not path:
        return []
    try:
        from eltctl.commands.common import resolve
        from eltctl.inventory import load_inventory

        given = ctx.params.get(INVENTORY_PARAM) is not None or root.get("inventory") != Path(DEFAULT_INVENTORY)
        job = ctx.params.get(JOB_PARAM) or root.get("job")
        choice = resolve(Path(path), "-i" if given else None, job)  # as the command will choose it
        names = [h.name for h in load_inventory(choice.path).hosts]
    except Exception:  # noqa: BLE001 - completion must never fail loudly
        return []
    return [n for n in names if n.startswith(incomplete)]

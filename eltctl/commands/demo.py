"""`eltctl demo`: the real system on this machine, no SSH server (see eltctl/demo/)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def demo(
    keep: bool = typer.Option(False, "--keep", help="Keep the demo's directory (inventory, logs) afterwards."),
    plain: bool = typer.Option(False, "--plain", help="Print progress lines instead of the live view."),
    owner_stays: float = typer.Option(6.0, "--owner-stays", min=0, help="Seconds the simulated owner keeps the GPU."),
    directory: Optional[Path] = typer.Option(
        None, "--dir", help="Run in this (existing, empty) directory instead of a temporary one; implies --keep."),
) -> None:
    """Run the whole system here: 3 local hosts with simulated GPUs, an owner taking one back, a summary."""
    from dataclasses import replace

    from rich.console import Console

    from eltctl.demo import DemoPlan, render_summary, run_demo

    console = Console(highlight=False)
    plan = replace(DemoPlan(), owner_stays_s=owner_stays)
    try:
        summary = run_demo(plan, console, keep=keep or directory is not None,
                           live=False if plain else None, root=directory)
    except KeyboardInterrupt:
        console.print("demo interrupted; every process it started has been stopped")
        raise typer.Exit(130) from None
    console.print(render_summary(summary))

"""One module per command. Each exposes `register(app)`; add new ones to COMMANDS."""

from __future__ import annotations

import importlib
from types import ModuleType

# Order is the order in `eltctl --help`.
COMMANDS = ["init", "doctor", "probe", "up", "scale", "down", "status", "logs", "checkpoints", "demo"]


def load_all() -> list[ModuleType]:
    return [importlib.import_module(f"eltctl.commands.{name}") for name in COMMANDS]

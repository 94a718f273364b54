"""The inventory: hosts.toml parsed once into typed, frozen values (`types.py`) by `parse.py`.

Everything else in eltctl takes an `Inventory` (or a part of it) as an argument;
nothing deeper reads the file or the environment.

`load_inventory(path)` reads the file; `parse_inventory(text, path)` checks every
key in one pass and raises one `ConfigError` that lists every problem found, each
named by its TOML key path (`hosts[3].port (host "gpu4")`), with the line where the
key (or its table) is written and what to write instead. The documented example of
every key is hosts.example.toml (the reference that `eltctl init --full` writes).
"""

from eltctl.inventory.parse import (
    CONTROLLER_KEYS,
    DEFAULT_INVENTORY_NAME,
    HOST_KEYS,
    JOB_KEYS,
    NAME_PATTERN,
    POLICY_KEYS,
    SSH_KEYS,
    STORAGE_KEYS,
    TOP_KEYS,
    load_inventory,
    parse_inventory,
)
from eltctl.inventory.types import (
    LOCAL,
    ControllerSettings,
    DeviceKind,
    Host,
    Inventory,
    JobMode,
    JobSpec,
    Policy,
    SSHSettings,
    Storage,
    StragglerPolicy,
)

__all__ = [
    "CONTROLLER_KEYS", "DEFAULT_INVENTORY_NAME", "HOST_KEYS", "JOB_KEYS", "LOCAL", "NAME_PATTERN", "POLICY_KEYS",
    "SSH_KEYS", "STORAGE_KEYS", "TOP_KEYS", "ControllerSettings", "DeviceKind", "Host", "Inventory", "JobMode",
    "JobSpec", "Policy", "SSHSettings", "Storage", "StragglerPolicy", "load_inventory", "parse_inventory",
]

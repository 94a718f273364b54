"""The interpreter simulated hosts run the runtime with: Python and torch, nothing else.

A lab host has what `pip install torch==2.13.0` leaves (torch and its own
requirements; no numpy), so the test bed does not run host-side code with the
project's own environment, which has the test tools and more. `scripts/setup.sh`
makes that interpreter in `.venv-host/`; `ELTCTL_TEST_HOST_PYTHON` names another.

Code that runs on a host gets the runtime the way eltctl ships it, as the package
`eltctl_runtime` on `PYTHONPATH`, never from the project's editable install.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST_PYTHON = os.environ.get("ELTCTL_TEST_HOST_PYTHON") or str(ROOT / ".venv-host" / "bin" / "python")
SETUP_HINT = "run `bash scripts/setup.sh` (it makes .venv-host with `pip install torch==2.13.0` alone)"


def runtime_path() -> str:
    """A directory holding `eltctl_runtime` (a link to ./runtime), for PYTHONPATH."""
    d = ROOT / "build" / "host-pythonpath"
    link = d / "eltctl_runtime"
    if not link.is_symlink():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".eltctl_runtime.{os.getpid()}"
        tmp.symlink_to(ROOT / "runtime", target_is_directory=True)
        os.replace(tmp, link)
    return str(d)


def host_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the runtime on PYTHONPATH, as on a host."""
    return {**env, "PYTHONPATH": runtime_path()}

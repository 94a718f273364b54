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


# A second host interpreter for the tests of eltctl_runtime.integrations: the one
# above plus the pinned frameworks (pyproject's `frameworks` extra). Jobs name it
# as their command's interpreter; the runtime itself still runs on HOST_PYTHON.
FRAMEWORKS_PYTHON = (os.environ.get("ELTCTL_TEST_FRAMEWORKS_PYTHON")
                     or str(ROOT / ".venv-host-frameworks" / "bin" / "python"))


def frameworks_missing_reason() -> str | None:
    """Why the framework tests cannot run here (None: they can)."""
    import subprocess

    if not os.path.exists(FRAMEWORKS_PYTHON):
        return f"no {FRAMEWORKS_PYTHON}: run `bash scripts/setup.sh` (it makes .venv-host-frameworks)"
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('transformers') and u.find_spec('lightning') else 1)"
    if subprocess.run([FRAMEWORKS_PYTHON, "-c", probe]).returncode != 0:
        return f"{FRAMEWORKS_PYTHON} lacks transformers or lightning: run `bash scripts/setup.sh`"
    return None

"""A simulated host that has met eltctl before: its record of a good `import torch`.

`eltctl up` imports torch on each host it checks unless the host's stamp
(`~/.eltctl/torch-import-ok`, eltctl/doctor.py `doctor_script`) matches its torch
install. Every host of a fresh test bed lacked it, so each test's first `up` (and each
later check of a host) imported torch on every host: seconds of CPU apiece on two shared
cores, for nothing the test asserts. The stamp is made once per test process by the
production script itself (`doctor_script` run with the host interpreter in a scratch
HOME) and copied into each new host's home, as a host that had run `eltctl up` before
would hold it. `eltctl doctor` imports torch whatever the stamp says; a host whose
`python` is another interpreter (no torch) does not match the stamp and is checked in full.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from eltctl.doctor import TORCH_STAMP, doctor_script

from .hostpython import HOST_PYTHON

_stamp: list[bytes | None] = []  # made at most once per process: [] not yet, [None] could not


def torch_stamp() -> bytes | None:
    """The stamp `doctor_script` writes for HOST_PYTHON (None: it wrote none, e.g. no torch)."""
    if not _stamp:
        with tempfile.TemporaryDirectory(prefix="eltsim-stamp-") as home:
            try:
                subprocess.run(["sh", "-c", doctor_script(HOST_PYTHON)], cwd=home, capture_output=True,
                               timeout=300, env={"HOME": home, "PATH": "/usr/local/bin:/usr/bin:/bin"})
            except (OSError, subprocess.TimeoutExpired):
                pass  # no stamp: the hosts are checked in full, as fresh ones
            path = Path(home) / TORCH_STAMP
            _stamp.append(path.read_bytes() if path.is_file() else None)
    return _stamp[0]


def seed_torch_stamp(home: Path) -> None:
    """Give `home` the stamp of a host whose `import torch` already worked (private, as
    eltctl keeps ~/.eltctl)."""
    stamp = torch_stamp()
    if stamp is None:
        return
    path = home / TORCH_STAMP
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(stamp)
    os.chmod(path, 0o600)

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

Under pytest-xdist the workers of one run make it once between them (`share_in`, called
by tests/conftest.py with the run's own temporary directory): the first takes a lock and
makes it, the other waits on the lock and reads it, instead of importing torch at the
same time on the same two cores.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from pathlib import Path

from eltctl.doctor import TORCH_STAMP, doctor_script

from .hostpython import HOST_PYTHON

_stamp: list[bytes | None] = []  # made at most once per process: [] not yet, [None] could not
_shared: list[Path] = []  # [dir]: a directory this run's test processes share (share_in)


def share_in(directory: Path) -> None:
    """Make the stamp at most once for all test processes that name the same `directory`
    (one test run's own, private directory: what is there is believed)."""
    _shared[:] = [Path(directory)]


def torch_stamp() -> bytes | None:
    """The stamp `doctor_script` writes for HOST_PYTHON (None: it wrote none, e.g. no torch)."""
    if not _stamp:
        _stamp.append(_shared_stamp(_shared[0]) if _shared else _make_stamp())
    return _stamp[0]


def _shared_stamp(directory: Path) -> bytes | None:
    """The stamp made once in `directory`: by this process, or read from the one that made it."""
    made = directory / "torch-stamp"
    with open(directory / "torch-stamp.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on an exception
        if made.is_file():
            data = made.read_bytes()
            return data[1:] if data[:1] == b"+" else None
        stamp = _make_stamp()
        made.write_bytes(b"-" if stamp is None else b"+" + stamp)  # "-": none could be made
        return stamp


def _make_stamp() -> bytes | None:
    with tempfile.TemporaryDirectory(prefix="eltsim-stamp-") as home:
        try:
            subprocess.run(["sh", "-c", doctor_script(HOST_PYTHON)], cwd=home, capture_output=True,
                           timeout=300, env={"HOME": home, "PATH": "/usr/local/bin:/usr/bin:/bin"})
        except (OSError, subprocess.TimeoutExpired):
            pass  # no stamp: the hosts are checked in full, as fresh ones
        path = Path(home) / TORCH_STAMP
        return path.read_bytes() if path.is_file() else None


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

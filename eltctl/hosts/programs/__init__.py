"""Programs that run on the hosts, each a real `.py` file of this directory.

They use the standard library only and run on any Python 3.8+, because they run with
the HOST's Python (which may have nothing but torch). They are never imported there:
`command(python, name, *args)` is the one way they are shipped, a shell command that
runs the file's source with `python -c` (so nothing is installed on the host).

- `unpack_runtime`: a base64 tar on stdin becomes the runtime directory, atomically;
- `manifest`: `{relative path: sha256}` of the job's code directory on the host;
- `apply`: deletes and writes code files, as `sync_code` planned them;
- `list_processes`: this job's processes (`ELTCTL_JOB` in /proc/<pid>/environ);
- `mirror_copy`: copy, hash, verify and publish one checkpoint (the mirror);
- `script_imports`: compile the job's script and find its top-level imports (`doctor`);
- `link_test`: one side of a short host-to-host throughput test (eltctl/linkspeed.py).
"""

from __future__ import annotations

import functools
import shlex
from pathlib import Path

NAMES = ("unpack_runtime", "manifest", "apply", "list_processes", "mirror_copy", "script_imports",
         "link_test")


@functools.cache
def source(name: str) -> str:
    """The text of program `name` (read once per process)."""
    if name not in NAMES:
        raise ValueError(f"no host program {name!r}; there are {', '.join(NAMES)}")
    return (Path(__file__).parent / f"{name}.py").read_text(encoding="utf-8")


def command(python: str, name: str, *args: str) -> str:
    """A shell command running program `name` with `python` and `args` (quoted for any sh)."""
    return " ".join([shlex.quote(python), "-c", shlex.quote(source(name)), *map(shlex.quote, args)])

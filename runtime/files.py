"""Files that a reader must see whole: atomic writes and JSON state files.

One helper each, with one meaning, for the runtime and the control side alike
(stdlib only): `write_atomic` writes a temporary file in the same directory,
fsyncs it and renames it over the target, so a reader (another process, or
this one after a crash) sees the old file or the new one, never half of one;
`write_json_atomic` / `read_json` are the JSON state files built on it (a
missing or unreadable file reads as None: state files are advisory, their
writer rewrites them); `fsync_dir` makes a rename in a directory durable.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def fsync_dir(path: Path | str) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path | str, data: str | bytes, *, mode: int | None = None, sync: bool = True,
                 sync_dir: bool = False) -> None:
    """Replace `path` with `data` (text is written as UTF-8) so that readers see
    the old or the new file, never a part.

    The temporary file `.<name>.<random>.tmp` is created beside the target
    (a rename is atomic only within one filesystem) with mode 0600 unless
    `mode` says otherwise; on any error it is removed and the target is left
    as it was. `sync` (default) fsyncs the data before the rename, so a crash
    cannot leave an empty file under the new name; `sync_dir` also fsyncs the
    directory afterwards, so the rename itself survives a crash."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if sync_dir:
        fsync_dir(path.parent)


def write_json_atomic(path: Path | str, document: Any, *, indent: int | None = 1, mode: int | None = None,
                      sync: bool = True, mkdir: bool = False) -> None:
    """Write `document` as JSON (with `indent`, and a final newline) atomically
    (`write_atomic`). `mkdir`: create the parent directories first."""
    path = Path(path)
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, indent=indent)
    write_atomic(path, text + "\n", mode=mode, sync=sync)


def read_json(path: Path | str) -> Any | None:
    """The JSON document at `path`, or None when it is missing, unreadable or not valid JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def remove(path: Path | str) -> None:
    """Remove a file; one that is already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def try_flock(path: Path | str, mode: int = 0o600, *, write_pid: bool = False) -> int | None:
    """Open `path` (created with `mode`) and take an exclusive flock on it without
    waiting: the open descriptor, which holds the lock until it is closed (so the
    lock goes with its process however that dies), or None when another process
    holds it. With `write_pid` the file then holds this process's pid (a hint for
    messages). Other errors raise."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    if write_pid:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    return fd

"""The on-disk format of a checkpoint: its names, its manifest, and how it is verified.

A checkpoint is a directory that either exists whole or does not exist at all.
The on-disk layout is the contract with anything else that reads checkpoints
(the restore path, and a mirror to shared storage that copies and verifies
directories on its own, in another process, with `verify_dir`)::

    <directory>/
      step-00001234/            one committed checkpoint (name = "step-" + step, >= 8 digits)
        state.pt                torch.save() of the state (tensors and plain types only); an
                                ElasticJob's is {model, optimizer, extra_state, progress, rng}
                                (state.capture)
        manifest.json           written last, see below
      .tmp-step-00001240-<pid>-<hex>/   a write in progress, or the leftover of a failed one

    manifest.json = {
      "format": "eltctl-checkpoint", "version": 1,
      "step": 1234,
      "created": 1763740000.25,          # wall time the snapshot was taken (time.time())
      "torch": "2.13.0+cpu",
      "files": {"state.pt": {"size": 3613, "sha256": "<64 hex>"}}
    }

Sharded optimizer state (ZeRO, train/zero/checkpoint.py) adds one file per chunk to the
same step directory, listed in the same manifest::

    step-00001234/
      state.pt                   the job's state; its "optimizer" holds only param_groups
      optimizer-00000-of-00004.pt ... one per rank of the layout: that rank's primary chunk
                                 (zero.checkpoint_shard)
      manifest.json              every file's size and sha256, and "sharded": the layout and
                                 the facts that rebuild the full state (zero.checkpoint_layout)

Writing is store.py (CheckpointStore), reading load.py. Standard library only: the
control side (eltctl's mirror and `eltctl checkpoints`) reads and verifies checkpoints
with this module and must not pay for, or even have, torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT = "eltctl-checkpoint"
FORMAT_VERSION = 1
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
TMP_PREFIX = ".tmp-"

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_OWNER = re.compile(r"^\.tmp-.*?-(\d+)-[0-9a-f]+$")
_HASH_CHUNK = 1 << 20
_HASH_THREADS = 4  # files hashed side by side at most (_sha256_files)


class CheckpointError(Exception):
    """A checkpoint could not be written; the previous ones are intact."""


class InvalidCheckpoint(Exception):
    """A checkpoint directory fails verification; the message says why."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint: `path` is its directory, `size` and `sha256` are of state.pt."""

    step: int
    path: Path
    created: float
    size: int
    sha256: str

    @property
    def state_file(self) -> Path:
        return self.path / STATE_FILE


# ---------------------------------------------------------------------------
# Pure decisions (tested by tables)


def step_dirname(step: int) -> str:
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"step-{step:08d}"


def parse_step_dirname(name: str) -> int | None:
    """The step a committed checkpoint directory is named after, or None if the name is not one."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def expired_steps(steps: Iterable[int], keep: int) -> list[int]:
    """Steps to delete so that the `keep` highest remain (highest step = newest)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    ordered = sorted(set(steps), reverse=True)
    return sorted(ordered[keep:])


def tmp_owner_pid(name: str) -> int | None:
    """The pid that created a `.tmp-*` directory, from its name, or None if unknown."""
    m = _TMP_OWNER.match(name)
    return int(m.group(1)) if m else None


def shard_filename(chunk: int, world: int) -> str:
    return f"optimizer-{chunk:05d}-of-{world:05d}.pt"


# ---------------------------------------------------------------------------
# Verification (no store needed: a mirror calls verify_dir in its own process)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sha256_files(paths: list[Path]) -> list[str | OSError]:
    """Each file's sha256 (or the OSError reading it), the files hashed side by side:
    hashlib and the reads release the GIL, so a sharded checkpoint's state.pt and its
    shard files (a restore reads them all) take about the time of the largest where
    cores are free, rather than of their sum."""
    def one(path: Path) -> str | OSError:
        try:
            return _sha256_file(path)
        except OSError as exc:
            return exc

    workers = min(len(paths), os.cpu_count() or 1, _HASH_THREADS)
    if workers <= 1:
        return [one(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="eltctl-sha256") as pool:
        return list(pool.map(one, paths))


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory, checked for shape; raises InvalidCheckpoint."""
    try:
        raw = (path / MANIFEST_FILE).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidCheckpoint(f"{path}: cannot read {MANIFEST_FILE}: {exc}") from exc
    try:
        m = json.loads(raw)
    except ValueError as exc:
        raise InvalidCheckpoint(f"{path}: {MANIFEST_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise InvalidCheckpoint(f"{path}: {MANIFEST_FILE} is not an {FORMAT} manifest")
    if m.get("version") != FORMAT_VERSION:
        raise InvalidCheckpoint(f"{path}: manifest version {m.get('version')!r}, this reader knows {FORMAT_VERSION}")
    files = m.get("files")
    if (
        not isinstance(m.get("step"), int)
        or not isinstance(m.get("created"), (int, float))
        or not isinstance(files, dict)
        or STATE_FILE not in files
        or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()
        )
    ):
        raise InvalidCheckpoint(f"{path}: {MANIFEST_FILE} lacks step, created or files[{STATE_FILE}] size/sha256")
    sharded = m.get("sharded")
    if sharded is not None and not (
        isinstance(sharded, dict) and isinstance(sharded.get("layout"), dict) and isinstance(sharded.get("step"), int)
        and isinstance(sharded.get("files"), list) and isinstance(sharded.get("params"), list)
        and isinstance(sharded.get("names"), list)
        and len(sharded["files"]) == len(sharded["layout"].get("members") or ())
        and all(isinstance(f, str) and f in files for f in sharded["files"])
    ):
        raise InvalidCheckpoint(f"{path}: {MANIFEST_FILE} has a malformed \"sharded\" entry (a shard file "
                                "per member of its layout, each listed in files)")
    named = parse_step_dirname(path.name)
    if named is not None and named != m["step"]:
        raise InvalidCheckpoint(f"{path}: directory is named for step {named} but the manifest says {m['step']}")
    return m


def info_from_manifest(path: Path, m: Mapping[str, Any]) -> CheckpointInfo:
    entry = m["files"][STATE_FILE]
    return CheckpointInfo(m["step"], path, float(m["created"]), entry["size"], entry["sha256"])


def check_dir(path: Path | str) -> CheckpointInfo:
    """Verify every file a checkpoint directory's manifest lists (size, then sha256).

    Returns its CheckpointInfo; raises InvalidCheckpoint saying what is wrong.
    """
    path = Path(path)
    m = check_sizes(path)
    check_hashes(path, m)
    return info_from_manifest(path, m)


def check_sizes(path: Path) -> dict[str, Any]:
    """check_dir's quick half: the manifest, and every file it lists there at its size."""
    m = read_manifest(path)
    for name, entry in m["files"].items():
        if "/" in name or name in ("", ".", ".."):
            raise InvalidCheckpoint(f"{path}: manifest lists a file outside the directory: {name!r}")
        f = path / name
        try:
            size = f.stat().st_size
        except OSError as exc:
            raise InvalidCheckpoint(f"{path}: {name} is missing: {exc}") from exc
        if size != entry["size"]:
            raise InvalidCheckpoint(f"{path}: {name} has {size} bytes, the manifest says {entry['size']} (truncated?)")
    return m


def check_hashes(path: Path, m: Mapping[str, Any], names: Iterable[str] | None = None) -> None:
    """check_dir's slow half: every file's sha256 (or those of `names`) against the manifest `m`."""
    names = list(m["files"]) if names is None else list(names)
    for name, digest in zip(names, _sha256_files([path / name for name in names])):
        if isinstance(digest, OSError):
            raise InvalidCheckpoint(f"{path}: {name} cannot be read: {digest}") from digest
        try:
            want = m["files"][name]["sha256"]
        except (KeyError, TypeError) as exc:
            raise InvalidCheckpoint(f"{path}: {MANIFEST_FILE} lists no sha256 for {name}") from exc
        if digest != want:
            raise InvalidCheckpoint(f"{path}: {name} sha256 {digest[:12]}... differs from the manifest's {want[:12]}...")


class PendingCheck:
    """A checkpoint's files (all its manifest lists, or `names`) being hashed on threads
    while its state is loaded and applied (CheckpointStore.latest_for_restore, the job's
    restore on the other ranks, restore_chunks); `confirm()` waits for the hashes."""

    def __init__(self, path: Path | str, manifest: Mapping[str, Any], names: Iterable[str] | None = None) -> None:
        self.path = Path(path)
        self._error: InvalidCheckpoint | None = None
        self._thread = threading.Thread(target=self._run, args=(manifest, None if names is None else list(names)),
                                        name="eltctl-verify", daemon=True)
        self._thread.start()

    def _run(self, manifest: Mapping[str, Any], names: list[str] | None) -> None:
        try:
            check_hashes(self.path, manifest, names)
        except InvalidCheckpoint as exc:
            self._error = exc
        except Exception as exc:  # noqa: BLE001 - whatever stops the check fails it
            self._error = InvalidCheckpoint(f"{self.path}: cannot be verified: {exc!r}")

    def confirm(self) -> None:
        """Wait for the hashes; raises InvalidCheckpoint (saying which file differs) if one
        does not match the manifest."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def verify_dir(path: Path | str) -> CheckpointInfo | None:
    """The CheckpointInfo of a checkpoint directory if all its files match its manifest, else None."""
    try:
        return check_dir(path)
    except InvalidCheckpoint as exc:
        log.info("Checkpoint directory does not verify: %s", exc)
        return None


def verify_shard_files(path: Path, manifest: Mapping[str, Any], chunks: list[int]) -> None:
    """Raise InvalidCheckpoint unless the shard files of `chunks` hash as the manifest says."""
    try:
        names = [manifest["sharded"]["files"][j] for j in chunks]
        wants = [manifest["files"][fname]["sha256"] for fname in names]
    except (KeyError, TypeError, IndexError) as exc:
        raise InvalidCheckpoint(f"{path}: cannot verify the shard files of chunks {chunks}: {exc}") from exc
    for fname, want, got in zip(names, wants, _sha256_files([path / fname for fname in names])):
        if isinstance(got, OSError):
            raise InvalidCheckpoint(f"{path}: cannot verify {fname}: {got}") from got
        if got != want:
            raise InvalidCheckpoint(f"{path}: {fname} does not match its sha256 in {MANIFEST_FILE}")

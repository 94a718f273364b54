"""Atomic, self-verifying checkpoints on a worker's local disk.

A checkpoint is a directory that either exists whole or does not exist at all.
The on-disk layout is the contract with anything else that reads checkpoints
(the restore path here, and a mirror to shared storage that copies and verifies
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

How a write commits: the state is serialised into `.tmp-.../state.pt` while its
sha256 is computed on the fly, the file is fsynced, the manifest is written and
fsynced, the temp directory is fsynced, renamed to `step-NNNNNNNN`, and the parent
directory is fsynced. A crash or an error at any point leaves at most a `.tmp-*`
directory, which nothing reads and the next write removes; the committed
checkpoints are never touched by a failed write. Retention removes old
checkpoints only after a newer one has committed, and removes them by renaming
them to a `.tmp-*` name first, so a half-deleted checkpoint is never seen as one.

`CheckpointStore.save_async` takes the snapshot (a CPU clone of every tensor) on
the caller's thread, so the saved state is consistent with the step it names,
and leaves serialisation, hashing, fsync and rename to one background thread.
At most one write is in flight; a newer request replaces one still waiting.
Errors of a background write are logged and kept in `last_error`; training
goes on with the previous checkpoint still in place.

One store (one process) writes a given directory; readers may be many.

Sharded optimizer state (ZeRO, zero.py) is checkpointed with `save_sharded`, called
by every rank: one file per rank's chunk in the same step directory, listed in the
same manifest (plus a "sharded" entry: the layout), committed as one; readers get
the full optimizer state rebuilt from the files (`assemble_optimizer`). See the
section near the end of this module.

`load_checkpoint(path)` returns a checkpoint's state as plain data (`model`,
`optimizer`, `extra_state`, `step`, `epoch`) and `export_checkpoint(path, out)`
writes that into one file that `torch.load(out, weights_only=True)` opens
without eltctl: how the trained model leaves eltctl.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..files import fsync_dir
from ..pids import pid_alive

if TYPE_CHECKING:  # pragma: no cover
    import torch

# torch is imported inside the functions that need it: the control side (eltctl's
# mirror and `eltctl checkpoints`) reads and verifies checkpoints with this module
# and must not pay for, or even have, torch.

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


# ---------------------------------------------------------------------------
# Snapshot: a consistent CPU copy of the state, taken on the caller's thread

_PLAIN_BASE = (type(None), bool, int, float, complex, str, bytes)


def _plain_types() -> tuple[type, ...]:
    import torch

    return _PLAIN_BASE + (torch.dtype, torch.device, torch.Size)


def snapshot(state: Any, _where: str = "state") -> Any:
    """Copy `state` so that later training steps cannot change what gets written.

    Tensors are cloned to CPU (a fresh, compact storage: a view would otherwise
    save its whole base). Containers are rebuilt; plain values are kept. Anything
    else is refused here, on the caller's thread, because `torch.load(weights_only=True)`
    could not read it back on restore.
    """
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, _plain_types()):
        return state
    if isinstance(state, Mapping):
        out = {}
        for k, v in state.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{_where}: dict key {k!r} is a {type(k).__name__}; use str or int keys")
            out[k] = snapshot(v, f"{_where}[{k!r}]")
        return out
    if isinstance(state, list):
        return [snapshot(v, f"{_where}[{i}]") for i, v in enumerate(state)]
    if isinstance(state, tuple):
        return tuple(snapshot(v, f"{_where}[{i}]") for i, v in enumerate(state))
    raise TypeError(
        f"{_where} is a {type(state).__name__}; a checkpoint holds only tensors, "
        "dicts, lists, tuples and plain values (int, float, str, bytes, bool, None)"
    )


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


def _info_from_manifest(path: Path, m: Mapping[str, Any]) -> CheckpointInfo:
    entry = m["files"][STATE_FILE]
    return CheckpointInfo(m["step"], path, float(m["created"]), entry["size"], entry["sha256"])


def check_dir(path: Path | str) -> CheckpointInfo:
    """Verify every file a checkpoint directory's manifest lists (size, then sha256).

    Returns its CheckpointInfo; raises InvalidCheckpoint saying what is wrong.
    """
    path = Path(path)
    m = _check_sizes(path)
    _check_hashes(path, m)
    return _info_from_manifest(path, m)


def _check_sizes(path: Path) -> dict[str, Any]:
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


def _check_hashes(path: Path, m: Mapping[str, Any], names: Iterable[str] | None = None) -> None:
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
            _check_hashes(self.path, manifest, names)
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


# ---------------------------------------------------------------------------
# Writing


class _HashingWriter:
    """A file-like sink for torch.save that hashes and counts what passes through.

    torch's zip writer ignores short writes and turns a Python exception from
    `write` into an unrelated "unexpected pos" error, so this sink writes every
    byte itself (looping on short writes) and keeps the first OSError (ENOSPC,
    EIO...) so that the real cause is what gets reported.
    """

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            done = 0
            while done < len(view):
                n = self._f.write(view[done:])
                if not n:
                    raise OSError(errno.EIO, "write made no progress")
                done += n
        except OSError as exc:
            if self.error is None:
                self.error = exc
            raise
        self.sha256.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            if self.error is None:
                self.error = exc
            raise


@dataclass(frozen=True)
class _Request:
    step: int
    state: Any
    created: float
    meta: dict | None = None  # written as the manifest's "meta" (restart mode: the script's step)
    # A sharded checkpoint: files already written and hashed beside the directory
    # (name in the step dir, staged path, size, sha256), moved in by the write; and the
    # manifest's "sharded" entry.
    staged: tuple[tuple[str, Path, int, str], ...] = ()
    sharded: dict | None = None


class CheckpointStore:
    """Writes, retains, lists and restores the checkpoints of one directory.

    Nothing happens in the constructor: the directory is created and the writer
    thread started by the first save. Use `close()` (or `with store:`) to finish.

    `on_committed(info)` runs right after a checkpoint is committed and old ones
    are pruned: on the writer thread for save_async, on the caller's thread for
    save. It must return quickly (enqueue, do not copy there): until it returns
    the write counts as in flight for `wait()` and for the next save. Its
    exceptions are logged and do not affect the store. A mirror that copies a
    checkpoint later must expect retention to remove it meanwhile, and should
    check its copy with `verify_dir`.
    """

    def __init__(
        self,
        directory: Path,
        keep: int = 3,
        on_committed: Callable[[CheckpointInfo], None] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self._on_committed = on_committed
        self._cond = threading.Condition()
        self._pending: _Request | None = None
        self._writing = False  # a write (background or save()) owns the directory
        self._writing_tmp: Path | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last_error: str | None = None
        self._last_committed: CheckpointInfo | None = None
        self._superseded = 0
        self._failures = 0
        self._staged: set[Path] = set()  # shard files staged for a write: cleanup leaves them

    # -- status ------------------------------------------------------------

    @property
    def last_error(self) -> str | None:
        """The message of the most recent failed write (not cleared by later successes), or None."""
        with self._cond:
            return self._last_error

    @property
    def failures(self) -> int:
        """How many writes have failed so far."""
        with self._cond:
            return self._failures

    @property
    def superseded(self) -> int:
        """How many pending requests were replaced by a newer one before being written."""
        with self._cond:
            return self._superseded

    @property
    def last_committed(self) -> CheckpointInfo | None:
        """The checkpoint this store committed most recently, or None."""
        with self._cond:
            return self._last_committed

    # -- writing -----------------------------------------------------------

    def save_async(self, step: int, state: dict, meta: dict | None = None) -> None:
        """Snapshot `state` now and write it as `step` in the background. `meta`: small
        JSON facts the manifest carries (`meta`), for listings that do not load the state."""
        step_dirname(step)  # validates
        if self._closed:  # checked again below; this one spares the copy
            raise RuntimeError(f"checkpoint store {self.directory} is closed")
        req = _Request(step, snapshot(state), time.time(), dict(meta) if meta else None)
        self._enqueue(req)

    def save_async_files(self, step: int, state: dict, staged: Iterable[tuple[str, Path, int, str]],
                         sharded: dict | None = None, meta: dict | None = None) -> None:
        """As save_async, with files already written and hashed by `stage` (or by a rank on
        this host: `write_staged`) that the write moves into the step directory and lists in
        the manifest, with `sharded` as its "sharded" entry. Used by `save_sharded`."""
        staged = tuple((n, Path(p), int(size), str(sha)) for n, p, size, sha in staged)
        with self._cond:
            self._staged.update(p for _n, p, _s, _h in staged)
        try:
            step_dirname(step)
            if self._closed:
                raise RuntimeError(f"checkpoint store {self.directory} is closed")
            req = _Request(step, snapshot(state), time.time(), dict(meta) if meta else None, staged,
                           dict(sharded) if sharded is not None else None)
        except BaseException:
            self._discard(_Request(step, None, 0.0, staged=staged))
            raise
        self._enqueue(req)

    def _enqueue(self, req: _Request) -> None:
        """Hand `req` to the writer thread (started on first use); a request still pending
        is superseded by it (its staged files go)."""
        with self._cond:
            if self._closed:
                self._discard(req)
                raise RuntimeError(f"checkpoint store {self.directory} is closed")
            if self._pending is not None:
                log.info("Checkpoint of step %d in %s superseded by step %d before it was written.",
                         self._pending.step, self.directory, req.step)
                self._superseded += 1
                self._discard(self._pending)
            self._pending = req
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"checkpoint-writer:{self.directory.name}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def stage(self, step: int, tag: str, obj: Any = None, data: Any = None) -> tuple[Path, int, str]:
        """Write one file of a coming sharded checkpoint beside the directory (torch.save of
        `obj`, or the bytes `data`), fsynced and hashed: (path, size, sha256). Cleanup leaves
        it alone until save_async_files takes it (or `unstage`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = _staged_path(self.directory, step, tag)
        with self._cond:
            self._staged.add(path)
        try:
            return _write_file(path, obj, data)
        except BaseException:
            self.unstage([path])
            raise

    def unstage(self, paths: Iterable[Path]) -> None:
        """Remove staged files that will not be written after all."""
        for p in paths:
            with self._cond:
                self._staged.discard(Path(p))
            Path(p).unlink(missing_ok=True)

    def _discard(self, req: _Request) -> None:
        """A request that will not be written: its staged files go."""
        if req.staged:
            self.unstage(p for _n, p, _s, _h in req.staged)

    def save(self, step: int, state: dict) -> CheckpointInfo:
        """Write `state` as `step` now, on the caller's thread; raises CheckpointError on failure.

        A request still pending from save_async is dropped (this one is newer);
        one being written is waited for first.
        """
        step_dirname(step)
        req = _Request(step, snapshot(state), time.time())
        with self._cond:
            if self._pending is not None:
                log.info(
                    "Checkpoint of step %d in %s superseded by a synchronous save of step %d.",
                    self._pending.step, self.directory, step,
                )
                self._superseded += 1
                self._discard(self._pending)
                self._pending = None
            while self._writing:
                self._cond.wait()
            self._writing = True
        try:
            info, err = self._write(req)
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
        if info is None:
            raise CheckpointError(err or "checkpoint write failed")
        return info

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or being written; False if `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, drain: bool = True) -> None:
        """Stop the writer thread after the write in flight; with `drain`, a pending request is written first."""
        with self._cond:
            self._closed = True
            if not drain and self._pending is not None:
                log.warning(
                    "Checkpoint of step %d in %s dropped unwritten at close.", self._pending.step, self.directory
                )
                self._discard(self._pending)
                self._pending = None
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:  # closed and drained
                    return
                while self._writing:  # a synchronous save() holds the directory
                    self._cond.wait()
                    if self._pending is None:
                        break
                if self._pending is None:
                    continue
                req, self._pending = self._pending, None
                self._writing = True
            try:
                self._write(req)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, req: _Request) -> tuple[CheckpointInfo | None, str | None]:
        """Write one checkpoint; never raises. Returns (info, None) or (None, error message)."""
        import torch

        tmp = self.directory / f"{TMP_PREFIX}{step_dirname(req.step)}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        sink: _HashingWriter | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._writing_tmp = tmp
            tmp.mkdir()
            files = {}
            for name, staged, size, sha in req.staged:
                if name in (STATE_FILE, MANIFEST_FILE) or "/" in name or name in files:
                    raise ValueError(f"a staged file may not be named {name!r}")
                os.rename(staged, tmp / name)  # same filesystem: the shard's bytes stay where they were written
                with self._cond:
                    self._staged.discard(staged)
                on_disk = (tmp / name).stat().st_size
                if on_disk != size:
                    raise OSError(errno.EIO, f"{name} has {on_disk} bytes on disk, its writer wrote {size}")
                files[name] = {"size": size, "sha256": sha}
            self._cleanup_tmp(exclude=tmp)
            with open(tmp / STATE_FILE, "wb") as f:
                sink = _HashingWriter(f)
                torch.save(req.state, sink)
                f.flush()
                os.fsync(f.fileno())
            written = (tmp / STATE_FILE).stat().st_size
            if written != sink.size:
                raise OSError(errno.EIO, f"{STATE_FILE} has {written} bytes on disk, {sink.size} were written")
            manifest = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "step": req.step,
                "created": req.created,
                "torch": torch.__version__,
                "files": {STATE_FILE: {"size": sink.size, "sha256": sink.sha256.hexdigest()}, **files},
            }
            if req.meta:
                manifest["meta"] = req.meta
            if req.sharded is not None:
                manifest["sharded"] = req.sharded
            with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            final = self.directory / step_dirname(req.step)
            self._commit(tmp, final)
            info = _info_from_manifest(final, manifest)
        except Exception as exc:  # the boundary: any failure of this write leaves old checkpoints as they were
            if sink is not None and sink.error is not None and exc is not sink.error:
                exc = sink.error  # the root cause, not torch's restatement of it
            msg = f"checkpoint of step {req.step} in {self.directory} failed: {type(exc).__name__}: {exc}"
            log.error("%s; the previous checkpoints are kept, training goes on.", msg)
            shutil.rmtree(tmp, ignore_errors=True)
            self._discard(req)
            with self._cond:
                self._last_error = msg
                self._failures += 1
            return None, msg
        finally:
            self._writing_tmp = None
        with self._cond:
            self._last_committed = info
        log.info("Checkpoint of step %d committed to %s (%d bytes).", info.step, info.path, info.size)
        self._apply_retention()
        if self._on_committed is not None:
            try:
                self._on_committed(info)
            except Exception:  # a mirror's bug must not stop checkpointing
                log.exception("on_committed callback failed for checkpoint of step %d", info.step)
        return info, None

    def _commit(self, tmp: Path, final: Path) -> None:
        """Rename the finished temp directory into place and make the rename durable."""
        if final.exists():
            # The same step again (e.g. after restoring from an older checkpoint).
            # rename() cannot replace a non-empty directory: move the old one
            # aside first; the window without it only exposes older checkpoints.
            aside = self.directory / f"{TMP_PREFIX}replaced-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            os.rename(final, aside)
            os.rename(tmp, final)
            fsync_dir(self.directory)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
            fsync_dir(self.directory)

    def _apply_retention(self) -> None:
        try:
            steps = {s: p for s, p in self._step_dirs()}
            for step in expired_steps(steps, self.keep):
                path = steps[step]
                doomed = self.directory / f"{TMP_PREFIX}expired-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
                os.rename(path, doomed)  # atomic: never visible as a half-deleted checkpoint
                shutil.rmtree(doomed, ignore_errors=True)
                log.info("Checkpoint of step %d removed from %s (keeping the newest %d).", step, self.directory, self.keep)
        except OSError as exc:
            log.warning("Retention in %s failed, old checkpoints stay for now: %s", self.directory, exc)

    def _cleanup_tmp(self, exclude: Path | None) -> list[Path]:
        """Remove `.tmp-*` leftovers of failed or interrupted writes (not another live writer's)."""
        removed = []
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return removed
        for p in entries:
            if not p.name.startswith(TMP_PREFIX) or p == exclude or p == self._writing_tmp:
                continue
            with self._cond:
                if p in self._staged:
                    continue  # a shard file staged for a write not started yet
            owner = tmp_owner_pid(p.name)
            if owner is not None and owner != os.getpid() and pid_alive(owner):
                continue  # some other live process is writing it
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
            log.info("Removed leftover temporary checkpoint %s.", p)
        return removed

    def cleanup(self) -> list[Path]:
        """Remove leftover `.tmp-*` entries now (writes do it anyway); returns what was removed."""
        with self._cond:
            if self._writing:
                return []
            self._writing = True
        try:
            return self._cleanup_tmp(exclude=None)
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    # -- reading -----------------------------------------------------------

    def _step_dirs(self) -> list[tuple[int, Path]]:
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return []
        out = []
        for p in entries:
            step = parse_step_dirname(p.name)
            if step is not None and p.is_dir():
                out.append((step, p))
        out.sort(key=lambda sp: sp[0], reverse=True)
        return out

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, newest (highest step) first, from their manifests; no hashing."""
        infos = []
        for _step, path in self._step_dirs():
            try:
                infos.append(_info_from_manifest(path, read_manifest(path)))
            except InvalidCheckpoint as exc:
                log.warning("Ignoring checkpoint directory: %s", exc)
        return infos

    def verify(self, info: CheckpointInfo) -> bool:
        """Recompute the checksums of a checkpoint and compare them with its manifest and `info`."""
        checked = verify_dir(info.path)
        return checked is not None and checked.sha256 == info.sha256 and checked.size == info.size

    def load(self, info: CheckpointInfo, assemble: bool = True, mmap: bool = False) -> dict:
        """Load a checkpoint's state (weights_only, to CPU) without verifying it. A sharded
        checkpoint's "optimizer" is the full state dict rebuilt from its shard files
        (`assemble`), or as stored (its param_groups alone: the caller takes its chunks
        from the files, load_optimizer_chunks). `mmap`: state.pt's tensors map the file."""
        return load_state(info.path, assemble=assemble, mmap=mmap)

    def latest_for_restore(self, assemble: bool = True,
                           mmap: bool = False) -> tuple[CheckpointInfo, dict, PendingCheck | None] | None:
        """As latest_valid, but where an older checkpoint is there to fall back on, the
        newest is loaded while its files are hashed (on threads: the restore's copies and
        transfers go on meanwhile; hashing a 600 MB checkpoint takes about as long as
        taking it up). Then the third item is that check: the caller must `confirm()` it
        before it uses the state (trains with it, sends it on), and if that raises
        InvalidCheckpoint, drop what it loaded and call latest_valid(), which checks the
        files before it loads them (it skips the bad one). Otherwise the third item is
        None: the checkpoint was checked first, as by latest_valid."""
        with self._cond:
            idle = not self._writing
        if idle:
            self.cleanup()
        infos = self.list()
        if len(infos) >= 2:
            newest = infos[0]
            try:
                m = _check_sizes(newest.path)
            except InvalidCheckpoint as exc:
                log.warning("Skipping checkpoint of step %d: %s", newest.step, exc)
            else:
                check = PendingCheck(newest.path, m)
                try:
                    state = self.load(newest, assemble=assemble, mmap=mmap)
                except Exception as exc:  # noqa: BLE001 - unreadable: the older ones, checked first
                    log.warning("Skipping checkpoint of step %d: %s does not load: %s", newest.step,
                                newest.state_file, exc)
                    try:
                        check.confirm()  # its reads end before the fall-back reads the others
                    except InvalidCheckpoint:
                        pass
                else:
                    log.info("Restoring from the checkpoint of step %d in %s (its files are hashed meanwhile).",
                             newest.step, newest.path)
                    return newest, state, check
            infos = infos[1:]
        found = self._first_valid(infos, assemble, mmap)
        return (*found, None) if found is not None else None

    def latest_valid(self, assemble: bool = True, mmap: bool = False) -> tuple[CheckpointInfo, dict] | None:
        """The newest checkpoint that verifies and loads, with its state; older ones if newer
        are bad. `assemble`, `mmap`: as for `load`."""
        with self._cond:
            idle = not self._writing
        if idle:
            self.cleanup()
        return self._first_valid(self.list(), assemble, mmap)

    def _first_valid(self, infos: list[CheckpointInfo], assemble: bool,
                     mmap: bool) -> tuple[CheckpointInfo, dict] | None:
        for info in infos:
            try:
                check_dir(info.path)
            except InvalidCheckpoint as exc:
                log.warning("Skipping checkpoint of step %d: %s", info.step, exc)
                continue
            try:
                state = self.load(info, assemble=assemble, mmap=mmap)
            except Exception as exc:  # any unreadable payload: fall back to an older checkpoint
                log.warning("Skipping checkpoint of step %d: %s does not load: %s", info.step, info.state_file, exc)
                continue
            log.info("Restoring from the checkpoint of step %d in %s.", info.step, info.path)
            return info, state
        log.info("No valid checkpoint in %s.", self.directory)
        return None


# ---------------------------------------------------------------------------
# Taking the trained state out (the control side calls these: torch is imported inside)

EXPORT_KEYS = ("model", "optimizer", "extra_state", "step", "epoch")


def _newest_first(directory: Path) -> list[Path]:
    try:
        entries = list(directory.iterdir())
    except OSError as exc:
        raise InvalidCheckpoint(f"{directory}: cannot list the checkpoints directory: {exc}") from exc
    steps = [(s, p) for p in entries if (s := parse_step_dirname(p.name)) is not None and p.is_dir()]
    return [p for _s, p in sorted(steps, reverse=True)]


def _exported(state: Mapping[str, Any], where: Path) -> dict[str, Any]:
    try:
        progress = state["progress"]
        return {"model": state["model"], "optimizer": state["optimizer"],
                "extra_state": dict(state.get("extra_state") or {}),
                "step": int(progress["step"]), "epoch": int(progress["epoch"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidCheckpoint(f"{where}: {STATE_FILE} is not an ElasticJob state (no {exc})") from exc


def _load_verified(path: Path) -> dict[str, Any]:
    check_dir(path)
    try:
        state = load_state(path)
    except InvalidCheckpoint:
        raise
    except Exception as exc:  # any unreadable payload is an invalid checkpoint
        raise InvalidCheckpoint(f"{path}: {STATE_FILE} does not load: {exc}") from exc
    return _exported(state, path)


def load_checkpoint(path: Path | str, step: int | None = None) -> dict[str, Any]:
    """The training state of a checkpoint as plain data, on CPU:
    `{"model", "optimizer", "extra_state", "step", "epoch"}` (state dicts; extra
    state by name, e.g. "scheduler", "grad_scaler").

    `path` is a checkpoint directory (`step-NNNNNNNN`) or a checkpoints
    directory; there, the newest checkpoint that verifies and loads is taken
    (a damaged newer one is skipped, with a warning), or the one of `step`.
    Nothing is written or removed. Raises InvalidCheckpoint saying what is
    wrong."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists():
        state = _load_verified(path)
        if step is not None and state["step"] != step:
            raise InvalidCheckpoint(f"{path} holds step {state['step']}, not {step}; name the checkpoints "
                                    "directory to choose among its steps")
        return state
    candidates = _newest_first(path)
    if step is not None:
        chosen = [p for p in candidates if parse_step_dirname(p.name) == step]
        if not chosen:
            have = ", ".join(str(parse_step_dirname(p.name)) for p in candidates) or "none"
            raise InvalidCheckpoint(f"{path}: no checkpoint of step {step} (steps there: {have})")
        return _load_verified(chosen[0])
    problems = []
    for p in candidates:
        try:
            return _load_verified(p)
        except InvalidCheckpoint as exc:
            log.warning("Skipping checkpoint: %s", exc)
            problems.append(str(exc))
    if not candidates:
        raise InvalidCheckpoint(f"{path}: no checkpoint here (neither a {MANIFEST_FILE} nor step-NNNNNNNN "
                                "directories); name a job's checkpoint directory or one step-NNNNNNNN in it")
    raise InvalidCheckpoint(f"{path}: no checkpoint verifies and loads: " + "; ".join(problems))


def export_checkpoint(path: Path | str, out: Path | str, step: int | None = None) -> dict[str, Any]:
    """Write the state load_checkpoint(path, step) returns to `out` with
    torch.save, atomically (a reader sees no file or the whole one).
    `torch.load(out, weights_only=True)` opens it without eltctl installed:
    it holds only tensors, dicts, lists and plain values. Returns
    `{"step", "epoch", "out", "size"}`."""
    import torch

    state = load_checkpoint(path, step)
    out = Path(out)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent if str(out.parent) else ".")
    return {"step": state["step"], "epoch": state["epoch"], "out": str(out), "size": out.stat().st_size}


# ---------------------------------------------------------------------------
# Sharded optimizer state (ZeRO, runtime/zero.py): one file per chunk, one manifest
#
#   step-00001234/
#     state.pt                   the job's state; its "optimizer" holds only param_groups
#     optimizer-00000-of-00004.pt ... one per rank of the layout: that rank's primary chunk
#                                (zero.checkpoint_shard), written by the rank itself when it is
#                                on the writer's host, else sent to the writer (point-to-point)
#     manifest.json              every file's size and sha256, and "sharded": the layout and
#                                the facts that rebuild the full state (zero.checkpoint_layout)
#
# The directory commits as one (the writer renames it into place after every file is in
# it), so verification, mirroring and signing treat it like any checkpoint: the mirror
# copies every file the manifest lists and the MAC covers the manifest, which holds
# every file's sha256. Readers (load_checkpoint, export_checkpoint, CheckpointStore.load)
# get one plain full optimizer state dict, rebuilt here with torch alone (no process
# group), whatever the world size or shard setting of the run that restores it.

SHARD_TAG = 0x5AD  # point-to-point tag of the shard transfer


def shard_filename(chunk: int, world: int) -> str:
    return f"optimizer-{chunk:05d}-of-{world:05d}.pt"


def _staged_path(directory: Path, step: int, tag: str) -> Path:
    # The owner pid in the name (tmp_owner_pid): a leftover of a dead process is swept.
    return Path(directory) / f"{TMP_PREFIX}{step_dirname(step)}-{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _write_file(path: Path, obj: Any = None, data: Any = None) -> tuple[Path, int, str]:
    """torch.save(obj) (or the bytes-like `data`) into a new file, hashed on the fly and fsynced."""
    sink: _HashingWriter | None = None
    try:
        with open(path, "xb") as f:
            sink = _HashingWriter(f)
            if data is not None:
                sink.write(data)
            else:
                import torch

                torch.save(obj, sink)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:
        path.unlink(missing_ok=True)
        if sink is not None and sink.error is not None and exc is not sink.error:
            raise sink.error from exc
        raise
    return path, sink.size, sink.sha256.hexdigest()


def write_staged(directory: Path | str, step: int, tag: str, obj: Any) -> tuple[Path, int, str]:
    """A rank on the writer's host writes its own shard beside the checkpoints directory
    (no store: the writer's store moves it in). (path, size, sha256)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return _write_file(_staged_path(directory, step, tag), obj)


def _wait(work: Any, abort: Any) -> None:
    """A send's or recv's work: gloo's point-to-point works report completion only from
    wait() (is_completed() stays False), so an abortable wait runs wait() on a helper
    thread (collectives.wait_p2p)."""
    from ..member import collectives

    collectives.wait_p2p([work], abort, "shard transfers")


def _send_bytes(pg: Any, dst: int, data: Any, abort: Any) -> None:
    import torch

    from ..member.collectives import send

    view = memoryview(bytearray(data) if isinstance(data, bytes) else data).cast("B")  # frombuffer: writable
    n = torch.tensor([len(view)], dtype=torch.int64)
    _wait(send(pg, n, dst, SHARD_TAG), abort)
    if len(view):
        _wait(send(pg, torch.frombuffer(view, dtype=torch.uint8), dst, SHARD_TAG), abort)


def _recv_bytes(pg: Any, src: int, abort: Any) -> Any:
    """The bytes `src` sent with _send_bytes, as a uint8 tensor. A peer already gone when
    a receive is posted is an Aborted (collectives.recv), as one gone during it."""
    import torch

    from ..member.collectives import recv

    n = torch.zeros(1, dtype=torch.int64)
    _wait(recv(pg, n, src, SHARD_TAG), abort)
    buf = torch.empty(int(n[0]), dtype=torch.uint8)
    if buf.numel():
        _wait(recv(pg, buf, src, SHARD_TAG), abort)
    return buf


def _tensor_bytes(t: Any) -> memoryview:
    """A uint8 CPU tensor's bytes, without a copy."""
    import ctypes

    n = t.numel()
    if not n:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def save_sharded(step: int, state: dict, sg: Any, pg: Any, *, hosts: list[str], directory: Path | str,
                 store: CheckpointStore | None = None, writer: int = 0, meta: dict | None = None,
                 abort: threading.Event | None = None) -> None:
    """Checkpoint sharded optimizer state as one step directory on the writer's host.
    Every rank of `pg` calls it at the same step (collective; pg rank == layout rank).

    - every rank clones its primary chunk to CPU now (the state of this step);
    - a rank on the writer's host (`hosts[rank] == hosts[writer]`) writes its shard file
      itself beside `directory` (in parallel with the others), hashing it as it writes,
      and tells the writer its name, size and sha256;
    - a rank on another host serializes its shard and sends it to the writer point to
      point; the writer receives them one at a time, in rank order, writing each to disk
      before the next, so the writer's memory holds one shard at a time, never the state;
    - the writer (`store` given; its directory is `directory`) then hands everything to
      its store: the rest (state.pt with `state` whose "optimizer" keeps only the
      param_groups, the manifest, the atomic rename, retention, on_committed, the
      mirror) happens on the store's thread as for `save_async`.

    Ranks other than the writer return when their shard is on the writer's disk or in
    flight to it. On any failure the staged files are removed and no step directory
    appears; the exception propagates (a collective failure means the group is broken)."""
    from ..train.zero import sharded as zero

    rank, world = pg.rank(), pg.size()
    if world != sg.layout.world or len(hosts) != world:
        raise ValueError(f"save_sharded: group of {world}, layout of {sg.layout.world}, {len(hosts)} hosts")
    if not 0 <= writer < world:
        raise ValueError(f"writer rank {writer} is not in a group of {world}")
    directory = Path(directory)
    shard = zero.checkpoint_shard(sg)
    name = shard_filename(sg.rank, world)
    tag = f"shard{sg.rank:05d}"
    if rank != writer:
        if hosts[rank] == hosts[writer]:
            path, size, sha = write_staged(directory, step, tag, shard)
            msg = {"name": name, "path": str(path), "size": size, "sha256": sha}
            try:
                _send_bytes(pg, writer, json.dumps(msg).encode(), abort)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        else:
            import io

            import torch

            buf = io.BytesIO()
            torch.save(shard, buf)
            del shard
            _send_bytes(pg, writer, json.dumps({"name": name}).encode(), abort)
            _send_bytes(pg, writer, buf.getbuffer(), abort)
        return
    if store is None:
        raise ValueError("save_sharded: the writer rank needs the CheckpointStore")
    if Path(store.directory) != directory:
        raise ValueError(f"save_sharded: the store writes {store.directory}, not {directory}")
    staged: list[tuple[str, Path, int, str]] = []
    try:
        staged.append((name, *store.stage(step, tag, shard)))
        del shard
        for r in range(world):
            if r == writer:
                continue
            head = _recv_bytes(pg, r, abort)  # kept alive while its bytes are read
            msg = json.loads(bytes(_tensor_bytes(head)).decode())
            if "path" in msg:  # written on this host by rank r
                path = Path(msg["path"])
                if path.parent != directory or not path.name.startswith(TMP_PREFIX):
                    raise CheckpointError(f"rank {r} staged its shard outside {directory}: {path}")
                staged.append((msg["name"], path, int(msg["size"]), str(msg["sha256"])))
            else:  # sent: to disk before the next one arrives
                data = _recv_bytes(pg, r, abort)
                staged.append((msg["name"], *store.stage(step, f"shard{r:05d}", data=_tensor_bytes(data))))
                del data
        if sorted(n for n, *_ in staged) != [shard_filename(j, world) for j in range(world)]:
            raise CheckpointError(f"shard files of step {step} do not cover the layout: {[n for n, *_ in staged]}")
    except BaseException:
        store.unstage(p for _n, p, _s, _h in staged)
        raise
    whole = dict(state)
    whole["optimizer"] = {"state": {}, "param_groups": zero.checkpoint_param_groups(sg)}
    sharded = {**zero.checkpoint_layout(sg), "files": [shard_filename(j, world) for j in range(world)]}
    store.save_async_files(step, whole, sorted(staged), sharded, meta)


def assemble_optimizer(path: Path | str, sharded: Mapping[str, Any], param_groups: Any) -> dict[str, Any]:
    """The full optimizer state dict (the format of the script's optimizer's
    `state_dict()`, as zero.ShardedGradients.full_state_dict gives it) rebuilt from a
    sharded checkpoint's files with torch alone: the manifest's layout says where each
    chunk's elements belong. The shard files are memory-mapped."""
    import torch

    from ..train.zero import sharded as zero

    path = Path(path)
    lay = sharded["layout"]
    world = len(lay["members"])
    buckets = lay["buckets"]  # [group, start, numel, chunk, pstart, params]
    slots = lay["slots"]  # [group, offset, numel] per parameter
    step = int(sharded["step"])
    state: dict[int, dict[str, Any]] = {}
    if step:
        shards = []
        for j, fname in enumerate(sharded["files"]):
            sd = torch.load(path / fname, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(sd, dict) or sd.get("chunk") != j:
                raise InvalidCheckpoint(f"{path}: {fname} is not the shard of chunk {j}")
            shards.append(sd["state"])
        bucket_of = {i: b for b, bk in enumerate(buckets) for i in bk[5]}
        offsets, seen = [], {}
        for bk in buckets:
            offsets.append(seen.get(bk[0], 0))
            seen[bk[0]] = offsets[-1] + bk[3]
        for g in range(len(lay["groups"])):
            padded = sum(bk[3] * world for bk in buckets if bk[0] == g)
            for name in sharded["names"][g]:
                full = torch.zeros(padded, dtype=shards[0][g][name].dtype)
                for b, (bg, _start, _numel, chunk, pstart, _members) in enumerate(buckets):
                    if bg != g:
                        continue
                    for j in range(world):
                        full[pstart + j * chunk:pstart + (j + 1) * chunk].copy_(
                            shards[j][g][name][offsets[b]:offsets[b] + chunk])
                for i, (pg_of, off, numel) in enumerate(slots):
                    if pg_of != g:
                        continue
                    bk = buckets[bucket_of[i]]
                    at = bk[4] + off - bk[1]
                    opt_index, shape = sharded["params"][i]
                    entry = state.setdefault(int(opt_index), {})
                    # "adamw": what counts_steps was called when AdamW was the only optimizer that did
                    if sharded.get("counts_steps", sharded.get("adamw")) and "step" not in entry:
                        entry["step"] = zero.step_tensor(step)
                    entry[name] = full[at:at + numel].view(shape).clone()
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def load_state(path: Path | str, assemble: bool = True, mmap: bool = False) -> dict:
    """A checkpoint directory's state.pt (weights_only, to CPU), not verified; for a sharded
    checkpoint with "optimizer" replaced by the full state dict rebuilt from its shards
    (with `assemble`; else as stored: the param_groups alone, and a rank takes its chunks
    with load_optimizer_chunks). `mmap`: the tensors map state.pt rather than being read in
    (a restore that copies them into the model at once)."""
    import torch

    path = Path(path)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True, mmap=mmap)
    m = read_manifest(path)
    if m.get("sharded") is not None and assemble:
        try:
            groups = state["optimizer"]["param_groups"]
        except (KeyError, TypeError) as exc:
            raise InvalidCheckpoint(f"{path}: sharded checkpoint whose {STATE_FILE} has no optimizer "
                                    "param_groups") from exc
        state["optimizer"] = assemble_optimizer(path, m["sharded"], groups)
    return state


def is_sharded(path: Path | str) -> bool:
    """True if a checkpoint directory holds sharded optimizer state (its manifest says so)."""
    return read_manifest(Path(path)).get("sharded") is not None


def restore_sharded(path: Path | str, sg: Any) -> dict:
    """Restore a rank's sharded optimizer state from a checkpoint directory, under the
    rank's own layout (any world size, shard setting, replicas). From a sharded checkpoint
    only the element ranges of the rank's held chunks are read from the memory-mapped shard
    files (no full state is built); from a plain one, its chunks of the full state. Not
    verified here (check_dir first, as latest_valid does). Returns state.pt's state (its
    "optimizer" as stored: the param_groups alone for a sharded checkpoint)."""
    import torch

    from ..train.zero import sharded as zero

    path = Path(path)
    m = read_manifest(path)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if m.get("sharded") is None:
        sg.load_full_state_dict(state["optimizer"])
        return state
    load_optimizer_chunks(path, sg, state["optimizer"]["param_groups"], manifest=m)
    return state


def load_optimizer_chunks(path: Path | str, sg: Any, param_groups: Any, manifest: Mapping[str, Any] | None = None,
                          verify: bool = False) -> None:
    """A rank's held chunks (zero.ShardedGradients `sg`, under its own layout) straight
    from a sharded checkpoint's memory-mapped shard files: only the shard files its chunks
    take elements from are opened (zero.checkpoint_chunks_needed), and of those only the
    element ranges it needs are read; no full state is built. `param_groups`: the
    optimizer's hyperparameters (state.pt's "optimizer"). `verify`: each of those files is
    hashed against the manifest first (verify_shard_files); else they are not verified here."""
    import torch

    from ..train.zero import sharded as zero

    path = Path(path)
    m = manifest if manifest is not None else read_manifest(path)
    sharded = m.get("sharded")
    if sharded is None:
        raise InvalidCheckpoint(f"{path}: not a sharded checkpoint")
    shards: dict[int, Any] = {}
    if sharded["step"]:
        need = zero.checkpoint_chunks_needed(sg, sharded)
        if verify:
            verify_shard_files(path, m, need)
        for j in need:
            fname = sharded["files"][j]
            sd = torch.load(path / fname, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(sd, dict) or sd.get("chunk") != j:
                raise InvalidCheckpoint(f"{path}: {fname} is not the shard of chunk {j}")
            shards[j] = sd["state"]
    zero.load_checkpoint_chunks(sg, sharded, shards, param_groups)


def _machine_id() -> str | None:
    """This machine's kernel for this boot (Linux's boot_id), or None where it cannot tell."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def restore_identity(path: Path | str) -> dict[str, Any]:
    """What a restoring rank says of the checkpoint directory it restores (with its "path",
    "sha256" and "host"), so that another rank can tell it reads the very same files:
    this machine's boot id and the directory's device and inode (covered_by_restorer)."""
    try:
        st = os.stat(path)
    except OSError:
        return {}
    machine = _machine_id()
    return {"machine": machine, "dir": [st.st_dev, st.st_ino]} if machine else {}


def covered_by_restorer(desc: Mapping[str, Any], host: str) -> bool:
    """Whether the restoring rank's hashes (all of the checkpoint's files, confirmed on every
    rank before the first step) cover what this rank reads of the checkpoint `desc`: it is
    on the same host, or it reads the very same directory on the same machine (the same
    kernel, device and inode: the same files, whatever the hosts are called, as for the
    simulated hosts of a test bed or a benchmark on one machine). Elsewhere (another
    machine, a copy at the same path, shared storage) a rank hashes what it reads."""
    if host == desc.get("host"):
        return True
    machine = desc.get("machine")
    if not machine or machine != _machine_id():
        return False
    try:
        st = os.stat(desc["path"])
    except OSError:
        return False
    return [st.st_dev, st.st_ino] == list(desc.get("dir") or ())


def load_restored(path: Path | str, sha256: str, *, assemble: bool, mmap: bool, verify: bool,
                  defer: bool) -> tuple[dict, PendingCheck | None] | None:
    """Another rank's restore, taken up on this one: the state of the checkpoint at `path`
    whose state.pt has `sha256` (load_state's `assemble`, `mmap`), or None when that
    checkpoint is not there (no such directory, or another checkpoint at that path). With
    `verify` (the restoring rank's hashes do not cover its reads: covered_by_restorer) the files it reads (state.pt; with `assemble` the shard files too: without,
    restore_chunks reads and hashes those) are hashed: with `defer` on threads while it
    loads, the PendingCheck returned for the caller to confirm before it uses the state,
    else first. Raises InvalidCheckpoint when the checkpoint is there but damaged or
    unreadable."""
    path = Path(path)
    try:
        m = read_manifest(path)
        if m["files"][STATE_FILE]["sha256"] != sha256:
            return None
    except InvalidCheckpoint:
        if not (path / MANIFEST_FILE).exists():
            return None
        raise
    m = _check_sizes(path)
    names = list(m["files"]) if assemble else [STATE_FILE]
    check = None
    if verify:
        if defer:
            check = PendingCheck(path, m, names)
        else:
            _check_hashes(path, m, names)
    try:
        state = load_state(path, assemble=assemble, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any unreadable payload
        if check is not None:
            try:
                check.confirm()  # its reads end here
            except InvalidCheckpoint:
                pass
        raise InvalidCheckpoint(f"{path}: {STATE_FILE} does not load here: {exc}") from exc
    return state, check


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


def restore_chunks(ckpt: Mapping[str, Any], sg: Any, pg: Any, host: str, abort: Any = None,
                   checks: list | None = None) -> dict[str, Any]:
    """Every rank of `pg` (pg rank == `sg`'s layout rank) takes its chunks of the sharded
    checkpoint one rank restored from (`ckpt`: its "path", state.pt's "sha256" and the
    "host" it was read on; the job's restore sends it with the rest of the state). When
    every rank can read that checkpoint at that path (its host; another host on shared
    storage, or with the same checkpoint there), each reads only its own chunks out of the
    memory-mapped shard files (load_optimizer_chunks: no full state is built, nothing
    travels); a rank on another host first hashes the shard files it reads (the restoring
    rank verified those on its own host); with `checks` (a list) it hashes them on threads
    while it reads them instead, and appends that PendingCheck for the caller to confirm
    before the state is used. Else the lowest rank that has the files
    assembles the full state and broadcasts it, and every rank takes its chunks of it.
    A collective. Returns what it did, for the log."""
    import copy

    import torch

    from ..member import collectives
    from ..train import state as state_mod
    from ..train.zero import sharded as zero

    t0 = time.perf_counter()
    path, rank = Path(ckpt["path"]), pg.rank()
    verify = not covered_by_restorer(ckpt, host)
    try:
        manifest = read_manifest(path)
        has = manifest["files"][STATE_FILE]["sha256"] == ckpt["sha256"]
        if has and verify and manifest["sharded"]["step"]:
            need = zero.checkpoint_chunks_needed(sg, manifest["sharded"])
            if checks is None:
                verify_shard_files(path, manifest, need)
            else:
                names = [manifest["sharded"]["files"][j] for j in need]
                _check_sizes(path)
                checks.append(PendingCheck(path, manifest, names))
    except (InvalidCheckpoint, KeyError, TypeError, IndexError) as exc:
        if verify and path.exists():
            log.warning("checkpoint %s: this rank cannot take its chunks from it here (%s); they come from "
                        "a rank that can", path, exc)
        has = False
    flags = torch.zeros(pg.size(), dtype=torch.float64, device=sg.device)
    flags[rank] = 1.0 if has else 0.0
    collectives.allreduce(pg, flags, abort)
    holders = [r for r, f in enumerate(flags.tolist()) if f > 0]
    groups = copy.deepcopy(sg.optimizer.state_dict()["param_groups"])
    if len(holders) == pg.size():
        load_optimizer_chunks(path, sg, groups, manifest)  # verified above where it had to be, or being hashed
        return {"restored_chunks_from_files_s": round(time.perf_counter() - t0, 4), "verified_here": verify,
                "hashed_meanwhile": verify and checks is not None}
    if not holders:
        raise CheckpointError(f"no rank can read the sharded checkpoint {path} the job restored from")
    src = holders[0]
    if rank == src:
        header, flat = state_mod.pack({"state": load_state(path)["optimizer"]["state"]})
        sizes = torch.tensor([len(header), flat.numel()], dtype=torch.int64)
    else:
        sizes = torch.zeros(2, dtype=torch.int64)
    sizes = collectives.broadcast(pg, sizes.to(sg.device), src, abort).cpu()
    if rank == src:
        hbuf = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    else:
        hbuf = torch.empty(int(sizes[0]), dtype=torch.uint8)
        flat = torch.empty(int(sizes[1]), dtype=torch.uint8)
    hbuf = collectives.broadcast(pg, hbuf.to(sg.device), src, abort).cpu()
    flat = collectives.broadcast(pg, flat.to(sg.device), src, abort).cpu()
    state = state_mod.unpack(state_mod.tensor_bytes(hbuf), flat)["state"]
    sg.load_full_state_dict({"state": state, "param_groups": groups})
    return {"restored_full_state_from_rank": src, "s": round(time.perf_counter() - t0, 4)}

"""Writing checkpoints: `CheckpointStore` writes, retains, lists and finds the
checkpoints of one directory, atomically (the format: format.py).

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

Sharded optimizer state (ZeRO) is written by every rank with
train/zero/checkpoint.py's `save_sharded`: each rank's shard file is staged beside
the directory (`stage`, `write_staged`) and the writer's store moves them into the
step directory and lists them in its manifest (`save_async_files`), committed as one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import fsync_dir
from ..pids import pid_alive
from .format import (FORMAT, FORMAT_VERSION, MANIFEST_FILE, STATE_FILE, TMP_PREFIX, CheckpointError, CheckpointInfo,
                     InvalidCheckpoint, PendingCheck, expired_steps, info_from_manifest, parse_step_dirname,
                     read_manifest, step_dirname, tmp_owner_pid, verify_dir)
from .load import first_valid, load_state, newest_for_restore

# torch is imported inside the functions that need it: the control side (eltctl's
# mirror and `eltctl checkpoints`) lists checkpoints with this module and must not
# pay for, or even have, torch.

log = logging.getLogger(__name__)


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
            info = info_from_manifest(final, manifest)
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
                infos.append(info_from_manifest(path, read_manifest(path)))
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
        self._cleanup_if_idle()
        return newest_for_restore(self.list(), self.directory, assemble, mmap)

    def latest_valid(self, assemble: bool = True, mmap: bool = False) -> tuple[CheckpointInfo, dict] | None:
        """The newest checkpoint that verifies and loads, with its state; older ones if newer
        are bad. `assemble`, `mmap`: as for `load`."""
        self._cleanup_if_idle()
        return first_valid(self.list(), self.directory, assemble, mmap)

    def _cleanup_if_idle(self) -> None:
        with self._cond:
            idle = not self._writing
        if idle:
            self.cleanup()


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

"""Restart mode: watching the script without changing it (used by restart/supervisor.py).

- `OutputPump`: the script's stdout and stderr pass through the supervisor
  unchanged (to the worker's log); on the way every line (split at \\n and \\r)
  is offered to the progress patterns and the last lines are kept for the
  failure message.
- `CheckpointWatch`: when the script's checkpoint directory holds a new
  complete checkpoint, so that rank 0 can mirror it while the script runs. It
  tells two kinds of savers apart by what it sees between its looks: an
  *atomic* saver has replaced a file by rename (a name's inode changed, or the
  temporary name seen at one look is the final one at the next) and rewrote no
  file in place since the last look; any other saver writes in place (a name
  keeps its inode, its size or mtime changes) or is not known yet. stat cannot
  tell an in-place rewrite from a freed inode reused by the next save, so an
  in-place change sends only that look to the older rule.
  - In-place savers (and unknown ones), the older rule: a directory counts as complete when no
    process of the script's group holds a file in it open for writing and its
    listing has not changed since the previous look or no file in it changed
    for QUIET_S (a save of several files is not taken between two of them).
  - Atomic savers: a rename never shows a half-written file, so any moment when
    nothing under the directory is open for writing and its listing (inodes and
    folders' mtimes included) is the same as SETTLED_S before is a consistent
    one, however often the script saves; once a look sees a new save, such a
    moment is looked for during about a second (`LiveSnapshots`). No clock is
    compared with the files' mtimes (a file server's clock may differ).
  Either way the snapshot is a hard-linked capture (`capture`): every file is
  linked into a scratch folder in one pass (a file replaced by rename later
  keeps its captured inode), the listing is checked before and after the pass,
  the capture is packed at leisure, and a captured file written in place
  meanwhile discards it. Where links are refused (another file system under
  the directory), the directory itself is packed and a change discards it.
  One look per --checkpoint-poll (2 s) bounds the rate: at most one snapshot
  per look.
- `RestartLimit`: the failures of the script within a window, the back-off
  before the next start and when to give up (pure).
"""
from __future__ import annotations

import enum
import os
import re
import shutil
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterable, Mapping, NamedTuple, Sequence

from ..daemon.logic import cause_line
from .snapshots import pack_dir
from .progress import match_progress

LAST_LINES = 40
QUIET_S = 0.5  # no file of the directory changed this long: the save is over
# Atomic savers: the directory is the same at two tries this long apart (a save of several
# files, each renamed into place, is not taken between two of them unless it pauses longer) ...
SETTLED_S = 0.05
CAPTURE_TRIES = 20  # ... looked for this often, SETTLED_S apart, once a look found a new save
LINE_MAX = 16 * 1024  # a longer "line" (a progress bar without \r?) is cut here


class Stamp(NamedTuple):
    size: int
    mtime_ns: int
    ino: int


Listing = Mapping[str, Stamp]  # relative path -> what the file is now


# ---- output -------------------------------------------------------------------------


class OutputPump:
    """Copies a process's stdout and stderr to this process's fds 1 and 2 (one
    thread each), feeding each line to `on_line(line)` and keeping the last ones."""

    def __init__(self, on_line: Callable[[str], None] | None = None) -> None:
        self._on_line = on_line
        self._lock = threading.Lock()
        self._last: deque[str] = deque(maxlen=LAST_LINES)
        self._threads: list[threading.Thread] = []

    def attach(self, stdout, stderr) -> None:
        """Start copying the pipes (file objects of a Popen with PIPE); new lines replace the kept ones."""
        with self._lock:
            self._last.clear()
        for pipe, fd in ((stdout, 1), (stderr, 2)):
            if pipe is None:
                continue
            t = threading.Thread(target=self._copy, args=(pipe, fd), name=f"script-output-{fd}", daemon=True)
            t.start()
            self._threads.append(t)

    def join(self, timeout: float = 2.0) -> None:
        """Wait (briefly) for the copies to reach the end of the pipes (the script has exited)."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]

    def last_lines(self) -> list[str]:
        with self._lock:
            return list(self._last)

    def cause(self) -> str:
        """The line that says why the script ended (a traceback's exception line, else its last line)."""
        return cause_line("\n".join(self.last_lines()))

    def _copy(self, pipe, fd: int) -> None:
        src = pipe.fileno()
        rest = b""
        try:
            while True:
                try:
                    data = os.read(src, 65536)
                except OSError:
                    break
                if not data:
                    break
                _write_all(fd, data)
                parts = re.split(rb"[\r\n]", rest + data)
                rest = parts.pop()
                if len(rest) > LINE_MAX:
                    parts.append(rest[:LINE_MAX])
                    rest = b""
                for raw in parts:
                    self._line(raw)
            if rest:
                self._line(rest)
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    def _line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace")
        if not line.strip():
            return
        with self._lock:
            self._last.append(line)
        if self._on_line is not None:
            try:
                self._on_line(line)
            except Exception:  # noqa: BLE001 - a pattern must never stop the copy (the script would block)
                pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return  # our own output is gone: keep draining the script's
        view = view[n:]


def progress_matcher(patterns: Sequence[re.Pattern[str]], sink: Callable[[Mapping[str, float]], None]
                     ) -> Callable[[str], None]:
    def on_line(line: str) -> None:
        values = match_progress(patterns, line)
        if values:
            sink(values)
    return on_line


# ---- the checkpoint directory ------------------------------------------------------------


def listing(root: Path) -> dict[str, Stamp]:
    """Every regular file (and link) under `root`: relative path -> (size, mtime_ns, inode)."""
    out: dict[str, Stamp] = {}
    if not root.is_dir():
        return out
    for dirpath, dirs, names in os.walk(root):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            out[os.path.relpath(p, root)] = Stamp(st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def folder_stamps(root: Path) -> dict[str, int]:
    """The mtime of every folder under `root` (itself included): a file created,
    renamed or removed in a folder changes its mtime."""
    out = {}
    for dirpath, _dirs, _names in os.walk(root):
        try:
            out[dirpath] = os.lstat(dirpath).st_mtime_ns
        except OSError:
            continue
    return out


def group_pids(pgid: int) -> list[int]:
    """The processes of process group `pgid` (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def writers_under(pids: Iterable[int], root: Path) -> list[str]:
    """Files under `root` that one of `pids` holds open for writing."""
    prefix = str(root.resolve()) + os.sep
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if not target.startswith(prefix):
                continue
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    flags = next((int(ln.split()[1], 8) for ln in f if ln.startswith("flags:")), 0)
            except (OSError, ValueError):
                flags = os.O_WRONLY  # cannot tell: assume the worst
            if flags & 3 in (os.O_WRONLY, os.O_RDWR):
                found.append(target)
    return found


class Take(enum.Enum):
    """What a look decided: pack the directory as it was judged (NOW), or find a
    consistent moment of an atomic saver within the next second (ATOMIC)."""

    NOW = "now"
    ATOMIC = "atomic"


@dataclass
class CheckpointWatch:
    """Decides when rank 0's script directory holds a new complete checkpoint.
    `look(listing, writers, announced)` once a poll (`writers`: the relative
    paths the script holds open for writing); a `Take`: snapshot it now (and
    `taken(listing)` once the copy is made), None: not now."""

    last_taken: Listing | None = None
    previous: Listing | None = None
    previous_writers: frozenset[str] = frozenset()
    renames_seen: bool = False  # a name's inode changed between two looks: the script saves by rename
    # A name kept its inode and changed since the last look: rewritten in place (or, as
    # stat cannot tell, a replaced file's inode reused by the next one): not sticky.
    in_place_now: bool = False

    @property
    def atomic(self) -> bool:
        return self.renames_seen and not self.in_place_now

    def look(self, current: Listing, writers: Collection[str], announced: bool = False,
             now_ns: int | None = None) -> Take | None:
        previous, self.previous = self.previous, dict(current)
        previous_writers, self.previous_writers = self.previous_writers, frozenset(writers)
        self.in_place_now = False
        if previous is not None:
            self._learn(previous, current, previous_writers)
        if not current or current == self.last_taken:
            return None
        if announced:
            return Take.NOW  # the script said it is complete
        if self.atomic:
            return Take.ATOMIC
        now_ns = time.time_ns() if now_ns is None else now_ns
        quiet = now_ns - max(st.mtime_ns for st in current.values()) >= QUIET_S * 1e9
        return Take.NOW if not writers and (current == previous or quiet) else None

    def _learn(self, previous: Listing, current: Listing, previous_writers: Collection[str]) -> None:
        by_ino = {st.ino: name for name, st in previous.items()}
        for name, st in current.items():
            old = previous.get(name)
            if old is None:
                was = by_ino.get(st.ino)
                if was is not None and was not in current and previous[was] == st:
                    self.renames_seen = True  # a file seen before, under a new name (tmp -> final name)
                continue
            if old == st:
                continue
            if old.ino != st.ino:
                self.renames_seen = True
            elif name not in previous_writers:  # not a file still being written at the last look
                self.in_place_now = True

    def taken(self, current: Listing) -> None:
        self.last_taken = dict(current)

    def unpacked(self, current: Listing) -> None:
        """The directory was replaced by a snapshot (every inode is new: nothing to learn from it)."""
        self.last_taken, self.previous, self.previous_writers = dict(current), None, frozenset()


# ---- taking a snapshot while the script runs ------------------------------------------


def capture(root: Path, dest: Path) -> None:
    """Hard-link every file under `root` into `dest` (created; the same tree; a
    symbolic link is linked itself, not its target), so `listing(dest)` equals
    `listing(root)` inodes included. OSError from os.link (EXDEV, EPERM, ...) means
    links cannot be used here; FileNotFoundError, that a file went away during the pass."""
    dest.mkdir()
    for dirpath, dirs, names in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        to = dest if rel == "." else dest / rel
        for d in list(dirs):
            if os.path.islink(os.path.join(dirpath, d)):
                dirs.remove(d)
                names.append(d)
            else:
                (to / d).mkdir()
        for name in names:
            os.link(os.path.join(dirpath, name), to / name, follow_symlinks=False)


@dataclass
class LiveSnapshots:
    """Takes the snapshots `CheckpointWatch` asks for, from a running script's
    directory `root`; `writing()` says whether the script holds a file under it
    open for writing. `take` returns (listing, tar) or None (nothing consistent
    was found: the next look tries again)."""

    root: Path
    writing: Callable[[], bool]
    links: bool = True  # False once os.link was refused: pack the directory itself
    swept: bool = False  # captures left by a supervisor killed while it packed are removed once

    def take(self, how: Take, judged: Listing, last_taken: Listing | None) -> tuple[dict[str, Stamp], bytes] | None:
        if not self.swept:
            self.swept = True
            for old in self.root.parent.glob(f".{self.root.name}.capture-*"):
                shutil.rmtree(old, ignore_errors=True)
        if how is Take.NOW:
            before = listing(self.root)
            if not before or before == last_taken or before != judged:
                return None  # it changed since the look judged it complete
            data = self._copy(before)
            return (before, data) if data is not None else None
        seen = None  # the directory at the previous try, SETTLED_S ago
        for i in range(CAPTURE_TRIES):
            if i:
                time.sleep(SETTLED_S)
            before = listing(self.root)
            if not before or before == last_taken:
                return None
            now = (before, folder_stamps(self.root))
            if now != seen:  # it changed within SETTLED_S (or this is the first try)
                seen = now
                continue
            if self.writing():
                continue
            data = self._copy(before)
            if data is not None:
                return before, data
            seen = None
        return None

    def _copy(self, before: Listing) -> bytes | None:
        return self._capture(before) if self.links else self._pack_live(before)

    def _capture(self, before: Listing) -> bytes | None:
        scratch = self.root.parent / f".{self.root.name}.capture-{uuid.uuid4().hex[:8]}"
        try:
            try:
                capture(self.root, scratch)
            except FileNotFoundError:
                return None  # a file was renamed away during the pass
            except OSError:
                self.links = False  # no hard links here (another file system?): the old way
                return self._pack_live(before)
            if listing(self.root) != before or listing(scratch) != before:
                return None  # renamed or written during the pass
            data = pack_dir(scratch)
            if listing(scratch) != before:
                return None  # a captured file was written in place while it was packed
            return data
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _pack_live(self, before: Listing) -> bytes | None:
        try:
            data = pack_dir(self.root)
        except OSError:
            return None  # a file went away while it was packed
        return data if listing(self.root) == before else None


# ---- the restart limit ------------------------------------------------------------------


@dataclass(frozen=True)
class RestartLimit:
    """`max_restarts` failures of the script within `window_s` stop the job; before
    a restart after the n-th failure in the window (n >= 2: a one-off crash restarts
    at once) the supervisors wait backoff_s * 2^(n-2), at most `backoff_cap_s`.
    Leaves, joins, owner yields and crashes of a host are not failures of the script
    and never count."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_cap_s: float = 60.0

    def recent(self, failures: Iterable[float], now: float) -> list[float]:
        return sorted(t for t in failures if now - t <= self.window_s)

    def gives_up(self, failures: Iterable[float], now: float) -> bool:
        return self.max_restarts > 0 and len(self.recent(failures, now)) >= self.max_restarts

    def backoff(self, failures: Iterable[float], now: float) -> float:
        n = len(self.recent(failures, now))
        return 0.0 if n <= 1 else min(self.backoff_cap_s, self.backoff_s * 2 ** (n - 2))

    def message(self, n: int, last_line: str) -> str:
        return (f"the script exited {n} time{'' if n == 1 else 's'} in {_span(self.window_s)}"
                + (f"; last line: {last_line}" if last_line else ""))


def _span(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"

"""Restart mode: watching the script without changing it (used by restart.py).

- `OutputPump`: the script's stdout and stderr pass through the supervisor
  unchanged (to the worker's log); on the way every line (split at \\n and \\r)
  is offered to the progress patterns and the last lines are kept for the
  failure message.
- `CheckpointWatch`: when the script's checkpoint directory holds a new
  complete checkpoint, so that rank 0 can mirror it while the script runs. A
  directory counts as complete when no process of the script's group holds a
  file in it open for writing and its listing (names, sizes, mtimes) has not
  changed since the previous look or no file in it changed for QUIET_S (a
  save of several files is not taken between two of them); a script that
  writes with rename, or that calls `checkpoint_saved`, is never caught
  half-way. The listing is checked
  again after packing: a file that changed meanwhile discards the copy.
- `RestartLimit`: the failures of the script within a window, the back-off
  before the next start and when to give up (pure).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from .daemon.logic import cause_line
from .progress import match_progress

LAST_LINES = 40
QUIET_S = 0.5  # no file of the directory changed this long: the save is over
LINE_MAX = 16 * 1024  # a longer "line" (a progress bar without \r?) is cut here

Listing = Mapping[str, tuple[int, int]]  # relative path -> (size, mtime_ns)


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


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every regular file under `root`: relative path -> (size, mtime_ns)."""
    out: dict[str, tuple[int, int]] = {}
    if not root.is_dir():
        return out
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
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


@dataclass
class CheckpointWatch:
    """Decides when rank 0's script directory holds a new complete checkpoint.
    `look(listing, writers, announced)` once a poll; True: pack it now (and
    `taken(listing)` once the copy is made)."""

    last_taken: Mapping[str, tuple[int, int]] | None = None
    previous: Mapping[str, tuple[int, int]] | None = None

    def look(self, current: Listing, writers: bool, announced: bool = False, now_ns: int | None = None) -> bool:
        previous, self.previous = self.previous, dict(current)
        if not current or current == self.last_taken:
            return False
        if announced:
            return True  # the script said it is complete
        now_ns = time.time_ns() if now_ns is None else now_ns
        quiet = now_ns - max(m for _s, m in current.values()) >= QUIET_S * 1e9
        return not writers and (current == previous or quiet)

    def taken(self, current: Listing) -> None:
        self.last_taken = dict(current)


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

"""The snapshots of the script's checkpoint directory that one restart-mode
supervisor holds.

The newest snapshot (a counter and a tar: snapshots.py) is kept in memory; the
directory holds the one `unpacked`; rank 0 saves each new one as an ordinary
eltctl checkpoint (step = the counter, with how often the job's scripts were
started and the script's step), so the controller's mirror and restore work
unchanged, and restores the newest one when no member holds a snapshot. While
the script runs, rank 0 looks for a new complete checkpoint of it every
`poll_s` and copies the directory in the background (watch.py: a consistent
copy, taken while no process of the script writes there).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

from ..member.transfer import as_tensor, tensor_bytes
from .snapshots import pack_dir, unpack_dir
from .watch import CheckpointWatch, Listing, LiveSnapshots, Take, group_pids, listing, writers_under

log = logging.getLogger("eltctl_runtime")

SNAPSHOT_FORMAT = "eltctl-restart-snapshot"


class SnapshotKeeper:
    """See the module docstring. `script_step()` is the script's step as known now,
    `child()` its process (a launch.Child) or None. The constructor does no I/O;
    `open` makes the checkpoint store."""

    def __init__(self, me: str, script_dir: Path, poll_s: float, script_step: Callable[[], int | None],
                 child: Callable[[], Any]) -> None:
        self.me = me
        self.script_dir = script_dir
        self._poll_s = poll_s
        self._script_step = script_step
        self._child = child
        self.snap: tuple[int, bytes] | None = None  # (snapshot counter, tar) held in memory
        self.unpacked: int | None = None  # the counter whose tar is in script_dir
        self.saved = 0  # the newest counter this supervisor saved as an eltctl checkpoint
        self.starts = 0  # how often the job's scripts were started (job-wide, agreed)
        self.steps: dict[int, int | None] = {}  # snapshot counter -> the script's step when it was taken
        self.ckpt = None
        self._watch = CheckpointWatch()
        self.announced = False  # the script called checkpoint_saved since the last look
        self._last_look = 0.0
        self._live: threading.Thread | None = None  # rank 0: a snapshot taken while the script runs
        self._live_snaps: LiveSnapshots | None = None  # how it is taken (made at the first one)

    @property
    def counter(self) -> int:
        return self.snap[0] if self.snap else 0

    def open(self, directory: Path, keep: int, on_committed: Callable[[Any], None]) -> None:
        from ..checkpoint.store import CheckpointStore

        self.ckpt = CheckpointStore(directory, keep=keep, on_committed=on_committed)

    def close(self) -> None:
        self.join_live()
        if self.ckpt is not None:
            self.ckpt.close()

    # -- held, taken, unpacked ---------------------------------------------------------
    def take(self) -> None:
        """A snapshot of the directory (no script runs)."""
        counter = self.counter + 1
        self.snap = (counter, pack_dir(self.script_dir))
        self.unpacked = counter  # the directory is the snapshot
        log.info("supervisor %s: snapshot %d of %s (%d bytes)", self.me, counter, self.script_dir,
                 len(self.snap[1]))

    def unpack(self) -> int:
        """The directory holds the snapshot held (unpacked if it does not yet); its counter."""
        counter, data = self.snap
        if self.unpacked != counter:
            unpack_dir(data, self.script_dir)
            self.unpacked = counter
        self.script_dir.mkdir(parents=True, exist_ok=True)
        return counter

    def unpacked_here(self) -> None:
        """Rank 0: the directory is snapshot `counter` now (the live copies compare with it)."""
        self._watch.unpacked(listing(self.script_dir))

    # -- eltctl checkpoints ----------------------------------------------------------
    def restore(self) -> dict | None:
        """No member holds a snapshot: the newest eltctl checkpoint's, if any (then its
        state: the script's step and starts saved with it)."""
        self.snap = (0, b"")
        if self.ckpt is None:
            return None
        found = self.ckpt.latest_valid()
        if found is None:
            return None
        info, state = found
        if not isinstance(state, dict) or state.get("format") != SNAPSHOT_FORMAT:
            log.warning("supervisor %s: the checkpoint %s is not a restart-mode snapshot; starting afresh",
                        self.me, info.path)
            return None
        self.snap = (info.step, tensor_bytes(state["tar"]))
        self.saved = info.step
        script_step = int(state.get("script_step", -1))
        if script_step >= 0:
            self.steps[info.step] = script_step
        # The generation that ran after this snapshot used the saved count: the
        # restored scripts get a higher one (TORCHELASTIC_RESTART_COUNT only grows).
        self.starts = max(self.starts, int(state.get("starts", 0)) + 1)
        log.info("supervisor %s: restored snapshot %d from %s", self.me, info.step, info.path)
        return state

    def save(self, wait: bool) -> None:
        """Rank 0: the snapshot held as an eltctl checkpoint, if it is newer than the last saved."""
        if self.ckpt is None or self.snap is None or self.snap[0] <= self.saved:
            return
        counter, data = self.snap
        script_step = self._script_step()
        self.steps[counter] = script_step
        self.ckpt.save_async(counter, {"format": SNAPSHOT_FORMAT, "tar": as_tensor(data), "starts": self.starts,
                                       "script_step": script_step if script_step is not None else -1},
                             meta={"mode": "restart", "snapshot": counter, "script_step": script_step})
        self.saved = counter
        if wait:
            self.ckpt.wait()

    # -- rank 0: mirroring the script's checkpoints while it runs ----------------------
    def look(self, now: float) -> None:
        """Every `poll_s`: pack the script's directory in the background when it holds a
        new complete checkpoint."""
        if now - self._last_look < self._poll_s:
            return
        self._last_look = now
        child = self._child()
        if self.ckpt is None or child is None or child.stopping or (
                self._live is not None and self._live.is_alive()):
            return
        current = listing(self.script_dir)
        announced, self.announced = self.announced, False
        writers = self._writers() if current else []
        how = self._watch.look(current, writers, announced)
        if how is None:
            return
        self._live = threading.Thread(target=self._live_snapshot, args=(how, current), name="live-snapshot",
                                      daemon=True)
        self._live.start()

    def _writers(self) -> list[str]:
        """The files under the script's directory its processes hold open for writing (relative)."""
        child = self._child()
        if child is None:
            return []
        root = str(self.script_dir.resolve())
        return [os.path.relpath(w, root) for w in writers_under(group_pids(child.proc.pid), self.script_dir)]

    def _live_snapshot(self, how: Take, judged: Listing) -> None:
        if self._live_snaps is None:
            self._live_snaps = LiveSnapshots(self.script_dir, lambda: bool(self._writers()))
        got = self._live_snaps.take(how, judged, self._watch.last_taken)
        if got is None:
            log.info("supervisor %s: no consistent copy of the script's directory this time (%s); next look",
                     self.me, how.value)
            return
        before, data = got
        self._watch.taken(before)
        counter = self.counter + 1
        self.snap = (counter, data)
        self.unpacked = counter
        log.info("supervisor %s: snapshot %d of %s while the script runs (script step %s, %d bytes)", self.me,
                 counter, self.script_dir, self._script_step(), len(data))
        self.save(wait=False)

    def join_live(self) -> None:
        if self._live is not None:
            self._live.join()
            self._live = None

"""What the framework callbacks share: SIGTERM as a flag, the ranks' agreement on
it, and where a script's checkpoints live. Standard library at import; torch only
inside `agree`."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from ..restart.progress import checkpoint_saved, report  # noqa: F401 - re-exported for the callbacks

# The exit status of a script that stopped on SIGTERM after saving (128 + SIGTERM,
# as a shell reports a process killed by it). Not 0: under restart mode rank 0's
# script exiting 0 means the job is finished, and a stranger's SIGTERM is no finish.
STOPPED_EXIT = 128 + int(signal.SIGTERM)


class StopSignal:
    """SIGTERM sets `requested`, nothing else: the stop itself happens at a step's
    end, where every rank takes it together (a collective or a save inside a signal
    handler could run in the middle of another collective and deadlock)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


def agree(flag: bool, device: Any = None) -> bool:
    """True on every rank when `flag` is True on any (a MAX all-reduce of one
    integer over the default process group; the flag itself without one). Every
    rank must call it at the same point of its step. `device` is where the
    backend wants the tensor (a CUDA device for NCCL)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else "cpu"
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def checkpoint_dir(default: str | os.PathLike) -> str:
    """Where the script should keep its checkpoints: `ELTCTL_CHECKPOINT_DIR` (restart
    mode's directory for this slot, the one it snapshots and hands over), else `default`."""
    return os.environ.get("ELTCTL_CHECKPOINT_DIR") or str(default)


def inside_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Whether `path` lies in ELTCTL_CHECKPOINT_DIR (only those can be mirrored)."""
    base = os.environ.get("ELTCTL_CHECKPOINT_DIR")
    if not base:
        return False
    try:
        Path(path).resolve().relative_to(Path(base).resolve())
    except ValueError:
        return False
    return True


def torchrun_world() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, TORCHELASTIC_RESTART_COUNT) from torchrun's environment (0, 1, 0 outside it)."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("TORCHELASTIC_RESTART_COUNT", 0))


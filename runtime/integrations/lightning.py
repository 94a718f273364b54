"""PyTorch Lightning under eltctl: save on SIGTERM, report, resume.

A few lines in the script::

    from eltctl_runtime.integrations.lightning import EltctlCallback, last_checkpoint, trainer_kwargs

    cb = EltctlCallback()          # saves into ELTCTL_CHECKPOINT_DIR (else dirpath=...)
    trainer = L.Trainer(..., callbacks=[cb], **trainer_kwargs())
    trainer.fit(model, data, ckpt_path=last_checkpoint(cb.dirpath))

On SIGTERM every rank finishes its batch, the ranks agree on the stop at the
end of the batch that completes an optimizer step (with gradient accumulation,
not in between), `trainer.save_checkpoint` writes `step=<global_step>.ckpt` (as a
`ModelCheckpoint(every_n_train_steps=1)` would at that point), the supervisor
is told (`checkpoint_saved`) and the script exits 143. Lightning's own SIGTERM
handling (a broadcast inside the signal handler, then an exit at the next batch
without saving) is replaced while training runs. Checkpoints the script's own
`ModelCheckpoint` callbacks save are reported too (at the next batch's end).

`trainer_kwargs()` makes each process its own node to Lightning (devices 1, or
its GPU `cuda:LOCAL_RANK`; num_nodes = WORLD_SIZE; ranks from torchrun's
environment): restart mode may place 2 members on one host and 1 on another,
which Lightning's own torchelastic environment rejects (devices x num_nodes
must be the world size).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from .common import STOPPED_EXIT, StopSignal, agree, checkpoint_dir, checkpoint_saved, inside_checkpoint_dir, report

_STEP = re.compile(r"step=(\d+)")


def last_checkpoint(dirpath: str | os.PathLike) -> str | None:
    """The `.ckpt` file in `dirpath` with the highest `step=N` in its name (the
    newest file among equals), else None: pass it to `trainer.fit(ckpt_path=...)`.
    Lightning writes a checkpoint whole or not at all (an atomic save)."""
    d = Path(dirpath)
    if not d.is_dir():
        return None
    found = []
    for f in d.glob("*.ckpt"):
        m = _STEP.search(f.name)
        if m:
            found.append((int(m.group(1)), f.stat().st_mtime, str(f)))
    return max(found)[2] if found else None


class OneProcessPerNode(TorchElasticEnvironment):
    """torchrun's environment where every process is a node of one device, so any
    placement of the world's ranks over hosts is valid."""

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.global_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices != 1 or num_nodes != self.world_size():
            raise ValueError(f"trainer_kwargs() gives devices=1 and num_nodes={self.world_size()}; "
                             f"got devices={num_devices}, num_nodes={num_nodes}")


def trainer_kwargs(accelerator: str = "auto") -> dict:
    """`accelerator`, `devices`, `num_nodes`, `strategy` and `plugins` for a
    `Trainer` under torchrun's environment ({} outside it, where Lightning's
    defaults apply)."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return {}
    world = int(env["WORLD_SIZE"])
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    kwargs = {"accelerator": "gpu" if gpu else "cpu", "devices": [int(env.get("LOCAL_RANK", 0))] if gpu else 1,
              "num_nodes": world, "plugins": [OneProcessPerNode()]}
    if world > 1:
        kwargs["strategy"] = "ddp"
    return kwargs


class EltctlCallback(Callback):
    """See the module docstring. `dirpath`: where it saves on SIGTERM (default
    ELTCTL_CHECKPOINT_DIR, else `checkpoints` in the trainer's root directory)."""

    def __init__(self, dirpath: str | os.PathLike | None = None) -> None:
        self.dirpath = str(dirpath) if dirpath is not None else checkpoint_dir("checkpoints")
        self._signal = StopSignal()
        self._announced: set[str] = set()
        self._step_seen = -1

    def on_train_start(self, trainer, pl_module) -> None:
        # After Lightning's own signal connector registered its SIGTERM handler.
        self._signal.install()
        self._announced = set(self._saved_paths(trainer))  # those existed before this run
        self._step_seen = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            self._announce(trainer)
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            # The tensor itself: report() converts it only when it writes (no sync per step).
            report(step=trainer.global_step, loss=loss.detach() if isinstance(loss, torch.Tensor) else None)
        if trainer.global_step == self._step_seen:
            return  # mid gradient accumulation: stop only where an optimizer step ended (same on every rank)
        self._step_seen = trainer.global_step
        if agree(self._signal.requested, trainer.strategy.root_device):
            path = os.path.join(self.dirpath, f"step={trainer.global_step}.ckpt")
            trainer.save_checkpoint(path)  # every rank: it holds a barrier; rank 0 writes
            if trainer.is_global_zero:
                self._announced.add(path)
                if inside_checkpoint_dir(path):
                    checkpoint_saved(path)
            self._signal.restore()
            raise SystemExit(STOPPED_EXIT)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self._announce(trainer)
        self._signal.restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._signal.restore()

    def _saved_paths(self, trainer) -> list[str]:
        paths = []
        for cb in trainer.callbacks:
            if isinstance(cb, ModelCheckpoint):
                paths += [p for p in (cb.last_model_path, cb.best_model_path) if p]
        return paths

    def _announce(self, trainer) -> None:
        """Report the script's own ModelCheckpoint saves (complete once they are its paths)."""
        for p in self._saved_paths(trainer):
            if p not in self._announced and os.path.exists(p):
                self._announced.add(p)
                if inside_checkpoint_dir(p):
                    checkpoint_saved(p)

"""Hugging Face `Trainer` under eltctl: save on SIGTERM, report, resume.

Two lines in the script::

    from eltctl_runtime.integrations.hf import EltctlCallback, last_checkpoint

    trainer = Trainer(..., callbacks=[EltctlCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

with `output_dir` in `ELTCTL_CHECKPOINT_DIR` (`integrations.common.checkpoint_dir`).
On SIGTERM every rank finishes its optimizer step, the ranks agree on the stop
at that step's end, the Trainer saves `checkpoint-<step>` as it does at
`save_steps` (model, optimizer, scheduler, RNG, trainer_state.json last), and
the script exits 143 without running what follows `train()`. Each completed
checkpoint is reported to the supervisor (`checkpoint_saved`), each step and
logged loss to `eltctl_runtime.report`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from transformers import TrainerCallback

from .common import STOPPED_EXIT, StopSignal, agree, checkpoint_saved, report

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# The Trainer writes this file last into a checkpoint directory (Trainer._save_checkpoint).
_COMPLETE_MARK = "trainer_state.json"


def last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete `checkpoint-<step>` directory in `output_dir` (one with
    trainer_state.json: a save cut short by SIGKILL has none), else None: pass it
    to `trainer.train(resume_from_checkpoint=...)`."""
    d = Path(output_dir)
    if not d.is_dir():
        return None
    found = []
    for entry in d.iterdir():
        m = _CHECKPOINT.match(entry.name)
        if m and (entry / _COMPLETE_MARK).is_file():
            found.append((int(m.group(1)), str(entry)))
    return max(found)[1] if found else None


class EltctlCallback(TrainerCallback):
    """See the module docstring. Add it to every rank's Trainer."""

    def __init__(self) -> None:
        self._signal = StopSignal()
        self._stopping = False
        self._samples = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._signal.install()
        # The samples before a resume at this size (the steps taken at other sizes
        # are not recorded); the rate eltctl derives from the count is exact.
        self._samples = state.global_step * _samples_per_step(args)

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._samples += _samples_per_step(args)
            report(step=state.global_step, samples=self._samples)
        if agree(self._signal.requested, args.device):
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            report(step=state.global_step, loss=float(logs["loss"]))

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if (path / _COMPLETE_MARK).is_file():
                checkpoint_saved(path)
        if self._stopping:
            self._signal.restore()
            raise SystemExit(STOPPED_EXIT)

    def on_train_end(self, args, state, control, **kwargs):
        self._signal.restore()


def _samples_per_step(args) -> int:
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)

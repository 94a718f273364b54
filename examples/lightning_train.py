"""A PyTorch Lightning script that eltctl's restart mode runs without losing steps.

A small MLP learns a synthetic regression. It is an ordinary Lightning script
(torchrun's environment, its own ModelCheckpoint) plus eltctl's lines:
`EltctlCallback()` (saves at once on SIGTERM, reports progress and each saved
checkpoint), `trainer_kwargs()` (every process its own node, so any placement
of ranks over hosts is valid) and `last_checkpoint()` (resume from the newest
checkpoint). Under eltctl::

    [job]
    mode = "restart"
    command = ["python", "lightning_train.py", "--max-steps", "2000"]

Alone: `torchrun --nproc-per-node 2 examples/lightning_train.py`. Checkpoints go
to $ELTCTL_CHECKPOINT_DIR (else --output-dir). Rank 0 prints `resumed at step N
world W restart R` when it resumes and `step N world W restart R loss L` after
every optimizer step.
"""

from __future__ import annotations

import argparse
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from eltctl_runtime.integrations.common import checkpoint_dir, torchrun_world
from eltctl_runtime.integrations.lightning import EltctlCallback, last_checkpoint, trainer_kwargs


class Regressor(L.LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class StepLog(Callback):
    """The script's own step log (rank 0), the record that no step is redone or skipped."""

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep
        self.rank, self.world, self.restart = torchrun_world()

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero and trainer.global_step:
            print(f"resumed at step {trainer.global_step} world {self.world} restart {self.restart}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            loss = float(outputs["loss"])
            print(f"step {trainer.global_step} world {self.world} restart {self.restart} loss {loss:.4f}", flush=True)
        if self.sleep:
            time.sleep(self.sleep)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="per rank")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--save-steps", type=int, default=50)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--output-dir", default="lightning-checkpoints")
    args = ap.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, 16, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=args.batch, shuffle=True)
    out = checkpoint_dir(args.output_dir)
    log = StepLog(args.step_sleep)
    trainer = L.Trainer(
        max_steps=args.max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[log, EltctlCallback(out), ModelCheckpoint(dirpath=out, every_n_train_steps=args.save_steps)],
        **trainer_kwargs(),
    )
    trainer.fit(Regressor(args.hidden), data, ckpt_path=last_checkpoint(out))
    if log.rank == 0:
        print("training finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

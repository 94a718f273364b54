"""A Hugging Face `Trainer` script that eltctl's restart mode runs without losing steps.

A tiny GPT-2 built from a config (no download) learns a synthetic sequence task.
It is an ordinary Trainer script (torchrun's environment, its own checkpoints)
plus eltctl's two lines: `EltctlCallback()` (saves at once on SIGTERM, reports
progress and each saved checkpoint) and `last_checkpoint()` (resume from the
newest complete checkpoint). Under eltctl::

    [job]
    mode = "restart"
    command = ["python", "hf_trainer.py", "--max-steps", "2000"]

Alone: `torchrun --nproc-per-node 2 examples/hf_trainer.py`. Checkpoints go to
$ELTCTL_CHECKPOINT_DIR (else --output-dir). Rank 0 prints `resumed at step N
world W restart R` when it resumes and `step N world W restart R loss L` after
every optimizer step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from eltctl_runtime.integrations.common import checkpoint_dir, torchrun_world
from eltctl_runtime.integrations.hf import EltctlCallback, last_checkpoint


class Sequences(torch.utils.data.Dataset):
    """Sequences counting up from a random start (mod the vocabulary): easy to learn."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1)
        starts = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (starts + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepLog(TrainerCallback):
    """The script's own step log (rank 0), the record that no step is redone or skipped."""

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep
        self.rank, self.world, self.restart = torchrun_world()

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and state.global_step:
            print(f"resumed at step {state.global_step} world {self.world} restart {self.restart}", flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # logging_steps=1: once per optimizer step, before any save of that step
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step} world {self.world} restart {self.restart} loss {logs['loss']:.4f}",
                  flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.sleep:
            time.sleep(self.sleep)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--save-steps", type=int, default=50)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--output-dir", default="hf-checkpoints")
    args = ap.parse_args()

    vocab, length = 64, 16
    config = GPT2Config(vocab_size=vocab, n_positions=length, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    out = checkpoint_dir(args.output_dir)
    targs = TrainingArguments(
        output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-3, save_steps=args.save_steps, save_total_limit=2, logging_steps=1,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=0, ddp_find_unused_parameters=False,
        use_cpu=not torch.cuda.is_available(), fp16=torch.cuda.is_available(),
    )
    log = StepLog(args.step_sleep)
    trainer = Trainer(model=model, args=targs, train_dataset=Sequences(args.samples, length, vocab),
                      callbacks=[log, EltctlCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(out))
    if log.rank == 0:
        print("training finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

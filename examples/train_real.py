"""A real training loop on the elastic API: BatchNorm, a warmup + cosine
learning-rate schedule, global gradient clipping, a GradScaler and extra state.

Runs with Python and torch alone (no torchvision), under the environment
contract of runtime/README.md, like examples/train.py: start more copies to
grow the job, SIGTERM one to make it leave. What differs from a plain torch
loop is marked (*):

- the scheduler and the GradScaler travel with the model and optimizer (to
  joiners, into checkpoints, back on restore), so the learning rate at every
  step is that of a run at fixed size;
- the scheduler steps only when `job.step()` returns a loss (a committed step);
- clipping and loss scaling are the job's: it clips the all-reduced gradient
  and unscales it after the all-reduce.

The GradScaler is enabled on CPU as well as on CUDA (it works on float32
training too: it scales the loss and skips a step whose gradients are not
finite); `--bf16` adds bf16 autocast, `--fp16` fp16 autocast (on CUDA), which
need nothing from the job.
`--progress` lines are `step generation world_size time loss lr skipped
fingerprint`: the LR the step was taken with, 1 if the GradScaler skipped it,
and at the first step of each generation the state's fingerprint (else `-`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import eltctl_runtime as elt

IN, OUT = 16, 4


def make_model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, OUT),
    )


def make_dataset(n_samples: int, noise: float = 0.5) -> TensorDataset:
    """A teacher network plus noise: the loss has a floor (noise**2) that a
    trained student reaches whatever the order of its steps."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n_samples, IN, generator=g)
    w1, w2 = torch.randn(IN, 32, generator=g) / IN**0.5, torch.randn(32, OUT, generator=g) / 32**0.5
    y = torch.tanh(x @ w1) @ w2 * 2 + noise * torch.randn(n_samples, OUT, generator=g)
    return TensorDataset(x, y)


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * t))
    return factor


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--schedule-steps", type=int, default=None,
                    help="length of the LR schedule (default --steps); give it when the run is stopped early")
    ap.add_argument("--warmup", type=int, default=10, help="steps of linear warmup")
    ap.add_argument("--batch", type=int, default=64, help="global batch size (constant whatever the world size)")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--no-scaler", action="store_true", help="no GradScaler")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward pass")
    ap.add_argument("--fp16", action="store_true", help="fp16 autocast for the forward pass (what the GradScaler is for)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--num-workers", type=int, default=0, help="data worker processes (0: load on the training thread)")
    ap.add_argument("--checkpoint-every", type=int, default=None, help="steps")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per step (tests)")
    ap.add_argument("--result", type=Path, default=None, help="write final step, losses and state hash here (JSON)")
    ap.add_argument("--progress", type=Path, default=None,
                    help="append 'step generation world_size time loss lr skipped fingerprint' lines")
    args = ap.parse_args(argv)

    config = elt.RuntimeConfig.from_env()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {config.worker_id} %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    device_type = "cuda" if config.device is elt.Device.CUDA else "cpu"
    model = make_model(args.hidden, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.schedule_steps or args.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, total))
    scaler = None if args.no_scaler else torch.amp.GradScaler(device_type)
    dataset = make_dataset(args.samples)

    job = elt.ElasticJob(  # (*)
        model, optimizer, dataset, global_batch_size=args.batch, seed=args.seed, max_steps=args.steps,
        epochs=args.epochs, micro_batch_size=args.micro_batch, checkpoint_every_steps=args.checkpoint_every,
        config=config, bucket_mb=args.bucket_mb, num_workers=args.num_workers,
        prefetch_steps=max(2, args.num_workers),
        extra_state={"scheduler": scheduler}, max_grad_norm=args.max_grad_norm, grad_scaler=scaler,
    )
    loss, generation = None, None
    progress = args.progress.open("a", buffering=1) if args.progress else None
    with job:  # (*)
        for x, y in job:
            if args.step_sleep:
                time.sleep(args.step_sleep)
            with torch.autocast(device_type, dtype=torch.float16 if args.fp16 else torch.bfloat16,
                                enabled=args.bf16 or args.fp16):
                out = model(x)
            step_loss = job.step(nn.functional.mse_loss(out.float(), y))  # (*)
            if step_loss is None:
                continue  # a micro-batch, or a step dropped by a crash: no scheduler step
            lr = optimizer.param_groups[0]["lr"]  # the LR this step was taken with
            scheduler.step()  # (*) once per committed step
            loss = step_loss
            if progress:
                c = job.last_commit  # the step as committed (before a resize that followed it)
                fp = job.fingerprint() if c.generation != generation else "-"  # after each change
                generation = c.generation
                progress.write(f"{c.step} {c.generation} {c.world_size} {c.time:.6f} {c.loss:.8g} {lr:.10g} "
                               f"{int(c.skipped)} {fp}\n")
        if args.result:
            args.result.write_text(json.dumps({
                "worker": config.worker_id, "step": job.step_count, "loss": loss,
                "eval_loss": evaluate(model, dataset), "rank": job.rank, "world_size": job.world_size,
                "generation": job.generation, "epoch": job.epoch, "fingerprint": job.fingerprint(),
                "left": job.left, "lr": optimizer.param_groups[0]["lr"],
            }))
    return 0


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TensorDataset) -> float:
    """Mean loss over the whole dataset with the agreed BatchNorm statistics (eval mode)."""
    was = model.training
    model.eval()
    x, y = dataset.tensors
    device = next(model.parameters()).device
    loss = float(nn.functional.mse_loss(model(x.to(device)), y.to(device)))
    model.train(was)
    return loss


if __name__ == "__main__":
    sys.exit(main())

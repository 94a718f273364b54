"""An ordinary torchrun DDP script: it knows nothing of eltctl.

Run it with `torchrun --nproc-per-node 2 examples/ddp_restart.py`, or under eltctl
with `[job] mode = "restart"`. It rendezvous through env:// (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE), shards a synthetic data set with a
DistributedSampler, and keeps its own checkpoint in `--checkpoint-dir` (default:
$ELTCTL_CHECKPOINT_DIR, else ./checkpoints): rank 0 saves every `--save-every`
steps and when it gets SIGTERM, and every rank resumes from it at start.

Rank 0 prints one line per step: `step N world W restart R loss L`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset

stop_requested = False


def on_sigterm(*_: object) -> None:
    global stop_requested
    stop_requested = True


def save(path: str, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, "ckpt.pt.tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, os.path.join(path, "ckpt.pt"))
    print(f"saved step {step}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--checkpoint-dir", default=os.environ.get("ELTCTL_CHECKPOINT_DIR", "checkpoints"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)

    use_cuda = torch.cuda.is_available() and "LOCAL_RANK" in os.environ
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, 16, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))

    step = 0
    path = os.path.join(args.checkpoint_dir, "ckpt.pt")
    if os.path.exists(path):
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step = saved["step"]
        if rank == 0:
            print(f"resumed at step {step} world {world} restart {restart}", flush=True)
    ddp = DDP(model)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    per_epoch = max(1, len(sampler) // args.batch)

    def stop(last: int) -> int:
        if rank == 0:
            save(args.checkpoint_dir, model, opt, last)
        return 0

    while step < args.steps:
        if stop_requested:
            return stop(step)
        epoch, k = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        idx = list(sampler)[k * args.batch:(k + 1) * args.batch]
        xb, yb = data[idx]
        try:
            loss = nn.functional.mse_loss(ddp(xb.to(device)), yb.to(device))
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here
        except RuntimeError:
            if stop_requested:  # a peer stopped first: the state is still that of `step`
                return stop(step)
            raise
        opt.step()
        step += 1
        if rank == 0:
            print(f"step {step} world {world} restart {restart} loss {loss.item():.4f}", flush=True)
            if step % args.save_every == 0:
                save(args.checkpoint_dir, model, opt, step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if rank == 0:
        save(args.checkpoint_dir, model, opt, step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

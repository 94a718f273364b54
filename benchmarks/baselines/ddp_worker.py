"""One worker of the baseline jobs: plain DDP on the example model, as torchrun users write it.

Run under torchrun (elastic, `--mode elastic`) or started directly with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (`--mode fixed`, the
plain-DDP reference). Same model, data and loss as eltctl's example
(examples/toy.py), global batch 64 split over the ranks, SGD.

Elastic mode follows the usual torchrun pattern: rank 0 saves a checkpoint every
`--ckpt-every` steps (torch.save to a temp file, then rename); every (re)started
worker loads the newest one and redoes the steps since.

Every completed step appends one JSON line to `<log-dir>/worker-<pid>.jsonl`:
{"t": wall time, "step": step number (1-based), "world": world size, "rank": rank,
"pid": pid, "restart": TORCHELASTIC_RESTART_COUNT}. One file per process, so no
two writers share a file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 64


def load_toy():
    spec = importlib.util.spec_from_file_location("eltctl_example_toy", REPO / "examples" / "toy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def local_slice(step: int, rank: int, world: int, n_samples: int) -> tuple[list[int], int]:
    """The sample indices of this rank for a step: the global batch of the step, split as evenly as possible."""
    start = (step * GLOBAL_BATCH) % n_samples
    idx = [(start + i) % n_samples for i in range(GLOBAL_BATCH)]
    base, extra = divmod(GLOBAL_BATCH, world)
    lo = rank * base + min(rank, extra)
    hi = lo + base + (1 if rank < extra else 0)
    return idx[lo:hi], hi - lo


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("elastic", "fixed"), required=True)
    ap.add_argument("--log-dir", type=Path, required=True)
    ap.add_argument("--ckpt-dir", type=Path)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--max-steps", type=int, default=1_000_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--pg-timeout", type=float, default=1800.0)
    ap.add_argument("--io-ms", type=float, default=None,
                    help="fixed mode: read the data as records (examples/toy.py RecordDataset: I/O wait + decode)")
    ap.add_argument("--loader-workers", type=int, default=None,
                    help="fixed mode: load through DataLoader(num_workers=N) with a DistributedSampler")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    toy = load_toy()
    model = toy.make_model()
    data = toy.make_dataset()
    n = len(data)

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    step = 0
    ckpt = args.ckpt_dir / "checkpoint.pt" if args.ckpt_dir else None
    if args.mode == "elastic" and ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]

    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.ckpt_dir is not None:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fd = os.open(args.log_dir / f"worker-{os.getpid()}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    batches = None
    if args.loader_workers is not None:  # the usual DDP input pipeline
        from torch.utils.data import DataLoader, DistributedSampler

        records = toy.RecordDataset(data, io_ms=args.io_ms or 0.0) if args.io_ms is not None else data
        loader = DataLoader(records, batch_size=GLOBAL_BATCH // world, num_workers=args.loader_workers,
                            sampler=DistributedSampler(records, num_replicas=world, rank=rank, seed=0),
                            persistent_workers=args.loader_workers > 0)

        def endless():
            epoch = 0
            while True:
                loader.sampler.set_epoch(epoch)
                yield from loader
                epoch += 1

        batches = endless()
    try:
        while step < args.max_steps:
            idx, local_n = local_slice(step, rank, world, n)
            x, y = data[idx] if batches is None else next(batches)
            # DDP averages gradients over ranks; weight by the local share so that
            # uneven splits still give the gradient of the global batch mean.
            loss = toy.loss_fn(ddp, (x, y)) * (local_n * world / GLOBAL_BATCH)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            line = {"t": time.time(), "step": step, "world": world, "rank": rank, "pid": os.getpid(), "restart": restart}
            os.write(fd, (json.dumps(line) + "\n").encode())
            if args.mode == "elastic" and ckpt is not None and rank == 0 and step % args.ckpt_every == 0:
                tmp = ckpt.with_name(f".tmp-{os.getpid()}-{ckpt.name}")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, ckpt)
    finally:
        os.close(fd)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One worker of the sharded baseline: DDP + torch's ZeroRedundancyOptimizer (AdamW), the
usual torchrun way (benchmarks/sharded.py --baseline zero-torchrun).

Same command line and step log as ddp_worker.py (so benchmarks/_baselines.py drives it
unchanged): `--mode elastic --log-dir D --ckpt-dir D --ckpt-every N --threads T`. The model
is benchmarks/sharded.py's: an MLP of ELTCTL_ZERO_LAYERS (12) Linear(W, W) layers, W =
ELTCTL_BENCH_WIDTH (2048): about 50 M parameters; ELTCTL_ZERO_BATCH (4) samples per rank.

ZeroRedundancyOptimizer shards the AdamW state over a fixed world and cannot change it:
on every membership change torchrun restarts every worker, and each loads the newest
checkpoint. Checkpointing follows the documented pattern: every `--ckpt-every` steps all
ranks call `consolidate_state_dict(to=0)` (the whole optimizer state gathered on rank 0),
rank 0 saves model + state (temp file, rename); a (re)started worker loads it
(`load_state_dict` repartitions it for the new world) and redoes the steps since.

Every completed step appends {"t", "step", "world", "rank", "pid", "restart"} to
`<log-dir>/worker-<pid>.jsonl` (as ddp_worker.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH = int(os.environ.get("ELTCTL_BENCH_WIDTH", "2048"))
LAYERS = int(os.environ.get("ELTCTL_ZERO_LAYERS", "12"))
BATCH = int(os.environ.get("ELTCTL_ZERO_BATCH", "4"))


def _broadcast_object(obj, src_rank, group=dist.group.WORLD, device=torch.device("cpu")):
    """torch's zero_redundancy_optimizer._broadcast_object without numpy (this venv has none)
    and without its element-by-element torch.ByteTensor(bytearray) copy: the same two
    broadcasts, so the baseline's checkpoint is, if anything, faster than stock."""
    import io

    if dist.get_rank() == src_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)
        dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=device), src=src_rank, group=group)
        dist.broadcast(data, src=src_rank, group=group)
        return obj
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(length, src=src_rank, group=group)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src_rank, group=group)
    import ctypes

    data = data.cpu()  # its bytes without numpy and without a per-byte iteration (bytes(storage) iterates)
    raw = memoryview((ctypes.c_char * data.numel()).from_address(data.data_ptr())).cast("B")
    return torch.load(io.BytesIO(raw), map_location=device, weights_only=False)


def main() -> int:
    import torch.distributed.optim.zero_redundancy_optimizer as zro

    zro._broadcast_object = _broadcast_object

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("elastic",), required=True)
    ap.add_argument("--log-dir", type=Path, required=True)
    ap.add_argument("--ckpt-dir", type=Path, required=True)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=1_000_000)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.01)

    step = 0
    ckpt = args.ckpt_dir / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        del state
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fd = os.open(args.log_dir / f"worker-{os.getpid()}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while step < args.max_steps:
            g = torch.Generator().manual_seed(step * 1000 + rank)
            x = torch.randn(BATCH, WIDTH, generator=g)
            loss = ddp(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            line = {"t": time.time(), "step": step, "world": world, "rank": rank, "pid": os.getpid(),
                    "restart": restart}
            os.write(fd, (json.dumps(line) + "\n").encode())
            if step % args.ckpt_every == 0:
                opt.consolidate_state_dict(to=0)  # collective: the full state on rank 0
                if rank == 0:
                    tmp = ckpt.with_name(f".tmp-{os.getpid()}-{ckpt.name}")
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
                    os.replace(tmp, ckpt)
                    opt._all_state_dicts = []  # free rank 0's gathered copy until the next checkpoint
    finally:
        os.close(fd)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

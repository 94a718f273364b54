"""One rank of a sharded-checkpoint test (tests/runtime/checkpoint/test_checkpoint_sharded.py), run as
its own process: trains a small mixed-dtype model with sharded AdamW state on a gloo group
(FileStore), writes a sharded checkpoint with checkpoint.save_sharded, and (rank 0) saves the
gathered full optimizer state and the model as the reference.

    python ckpt_shard_worker.py STORE CKPT_DIR OUT RANK WORLD SHARD REPLICAS HOSTS STEPS [torn]

`torn`: the writer kills itself (SIGKILL) just before the step directory's rename."""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from eltctl_runtime.checkpoint.store import CheckpointStore
from eltctl_runtime.train.zero import checkpoint
from eltctl_runtime.train.zero.layout import Member, shard_layout
from eltctl_runtime.train.zero.sharded import ShardedGradients

ROWS = 12


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 8).double()
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).float()).double()


def make_opt(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=0.01)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(ROWS, 6, generator=g, dtype=torch.float64),
            torch.randn(ROWS, 3, generator=g, dtype=torch.float64))


def main() -> int:
    import faulthandler

    faulthandler.dump_traceback_later(400, exit=True)  # a hung rank says where
    store_path, ckpt_dir, out, rank, world, shard, replicas, hosts, steps = sys.argv[1:10]
    torn = sys.argv[10:] == ["torn"]
    rank, world, replicas, steps = int(rank), int(world), int(replicas), int(steps)
    hosts = hosts.split(",")
    torch.set_num_threads(1)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=300)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("g", dist.FileStore(store_path, world)), rank, world, opts)
    model = Net()
    opt = make_opt(model)
    params = list(model.parameters())
    members = [Member(f"w{r}", hosts[r]) for r in range(world)]
    lay = shard_layout(params, opt, members, replicas, bucket_mb=0.0002)
    sg = ShardedGradients(params, opt, lay, rank, shard)
    sg.bind()
    with sg.attached():
        for t in range(steps):
            sg.begin(pg)
            x, y = batch(t)
            rows = torch.tensor_split(torch.arange(ROWS), world)[rank]
            (((model(x[rows]) - y[rows]) ** 2).sum() / ROWS).backward()
            sg.finish()
            sg.step()
            sg.zero_grad()
    store = CheckpointStore(Path(ckpt_dir), keep=3) if rank == 0 else None
    if torn and store is not None:
        def die(*_a, **_k):
            os.kill(os.getpid(), signal.SIGKILL)
        store._commit = die  # every file is in the temp directory; the rename never happens
    state = {"model": model.state_dict(), "optimizer": None, "extra_state": {},
             "progress": {"step": steps, "epoch": 0}}
    checkpoint.save_sharded(steps, state, sg, pg, hosts=hosts, directory=ckpt_dir, store=store, writer=0)
    full = sg.full_state_dict()  # collective: the reference
    if store is not None:
        store.close()
        if store.last_error:
            print(store.last_error, file=sys.stderr)
            return 1
        torch.save({"optimizer": full, "model": model.state_dict()}, out)
    pg.barrier().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ranks of the sharded-state tests (test_zero_*.py): a toy model of mixed dtypes, its
optimizers, one rank's Worker, and the replicated run every sharded run must equal
(one process training the global batch with the plain optimizer)."""

from __future__ import annotations

import threading

import torch

from eltctl_runtime.member import collectives
from eltctl_runtime.train.zero import Member, ShardedGradients, ShardLayout

F32, F64 = "torch.float32", "torch.float64"
ROWS = 12
RTOL = 1e-5


def members(*hosts: str) -> list[Member]:
    return [Member(f"w{i}", h) for i, h in enumerate(hosts)]


_INIT = threading.Lock()  # the ranks are threads: the global RNG that initialises layers is shared


class Net(torch.nn.Module):
    """Mixed dtypes: a float64 layer, then a float32 one."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with _INIT:
            torch.manual_seed(seed)
            self.a = torch.nn.Linear(6, 8).double()
            self.b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).float()).double()


def make_opt(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":  # two param groups: no decay on biases
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=0.01)
    params = model.parameters()
    if kind == "adam":  # L2 weight decay (added to the gradient) and the running maximum
        return torch.optim.Adam(params, lr=0.01, weight_decay=0.05, amsgrad=True)
    if kind == "rmsprop":  # every state tensor it has: square_avg, momentum_buffer, grad_avg
        # eps 1: its momentum buffer sums g / (sqrt(v) + eps), at the first step sign(g) / 0.1
        # with a small eps, so a gradient element summed to near zero (float32 rounding of a
        # cancelling sum) flips it: at the default eps replicated training itself, its batch
        # split in 3 micro-batches, ends 6e-5 apart (relative) in that buffer of this model.
        # With eps 1 the buffer is as exact as the gradients' reduction order.
        return torch.optim.RMSprop(params, lr=0.01, eps=1.0, momentum=0.5, centered=True, weight_decay=0.01)
    if kind == "adamax":
        return torch.optim.Adamax(params, lr=0.02, weight_decay=0.01)
    if kind == "radam":  # its rectified update starts at step 6 (default betas): the 9-step tests reach it
        return torch.optim.RAdam(params, lr=0.01, weight_decay=0.01, decoupled_weight_decay=True)
    if kind == "adadelta":
        return torch.optim.Adadelta(params, lr=1.0, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


# The supported optimizers other than AdamW and SGD (tested at fewer world sizes)
OTHER_KINDS = ["adam", "rmsprop", "adamax", "radam", "adadelta"]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, 6, generator=g, dtype=torch.float64), torch.randn(ROWS, 3, generator=g,
                                                                                dtype=torch.float64)


def loss_of(model, rows: torch.Tensor, step: int) -> torch.Tensor:
    x, y = batch(step)
    return ((model(x[rows]) - y[rows]) ** 2).sum() / ROWS  # rank shares add up to the global mean


def replicated(kind: str, steps: int, clip: float | None = None, scale: bool = False, inf_at: int = -1):
    model = Net()
    opt = make_opt(kind, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if scale else None
    for t in range(steps):
        loss = loss_of(model, torch.arange(ROWS), t)
        (scaler.scale(loss) if scaler else loss).backward()
        if t == inf_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        if scaler:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return model, opt, scaler


class Worker:
    """One rank: its model, the script's optimizer, its sharded path."""

    def __init__(self, kind: str, shard: str, seed: int = 0, scale: bool = False,
                 reduce_scatter: bool | None = None, p2p_gather: bool | None = None) -> None:
        self.reduce_scatter = reduce_scatter
        self.p2p_gather = p2p_gather
        self.model = Net(seed)
        self.opt = make_opt(kind, self.model)
        self.params = list(self.model.parameters())
        self.shard = shard
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if scale else None
        self.sg: ShardedGradients | None = None

    def path(self, lay: ShardLayout, me: str) -> ShardedGradients:
        sg = ShardedGradients(self.params, self.opt, lay, lay.rank_of(me), self.shard, self.reduce_scatter,
                              self.p2p_gather)
        sg.bind()
        return sg

    def train(self, pg, steps: range, clip: float | None = None, inf_at: int = -1) -> list:
        sg = self.sg
        results = []
        rank, world = pg.rank(), pg.size()
        with sg.attached():
            for t in steps:
                sg.begin(pg)
                loss = loss_of(self.model, torch.tensor_split(torch.arange(ROWS), world)[rank], t)
                if t == inf_at and rank == world - 1:
                    loss = loss * float("inf")
                (self.scaler.scale(loss) if self.scaler else loss).backward()
                sg.finish()
                results.append(sg.step(clip, self.scaler))
                sg.zero_grad()
        return results


def assert_params_match(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=1e-7, msg=name)


def assert_state_matches(full: dict, ref: dict) -> None:
    assert full["param_groups"] == ref["param_groups"]
    assert full["state"].keys() == ref["state"].keys()
    for i, entry in ref["state"].items():
        assert full["state"][i].keys() == entry.keys()
        for k, v in entry.items():
            torch.testing.assert_close(full["state"][i][k], v, rtol=RTOL, atol=1e-7, msg=lambda m, i=i, k=k: f"{i}/{k}: {m}")


def dist_settled(sg: ShardedGradients) -> bool:
    return collectives.settled(list(sg.reductions))

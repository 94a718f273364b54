"""Which optimizers shard, and what state they keep per parameter.

The optimizer the script built is kept for its hyperparameters (a scheduler's
changes to lr are copied into the shard optimizer at every step) and never
stepped. AdamW, Adam, SGD, RMSprop, Adamax, RAdam and Adadelta are supported: their
updates are elementwise and their state per parameter is tensors shaped as it and a
step count, so a shard steps exactly as the replicated optimizer steps those elements.
Others are refused (`check_optimizer`).
"""

from __future__ import annotations

import torch

SHARD_MODES = ("optimizer", "gradients")
# Optimizers whose update is elementwise and whose state per parameter is tensors shaped as it
# (made at the first step) and a step count: a shard's step is the replicated step of its elements.
SUPPORTED_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD,
                        "RMSprop": torch.optim.RMSprop, "Adamax": torch.optim.Adamax, "RAdam": torch.optim.RAdam,
                        "Adadelta": torch.optim.Adadelta}
# Why the nearest others are not: what the refusal says.
_WHY_NOT = {"Adagrad": "its state is made when it is built, whole on every rank",
            "NAdam": "its state holds a per-parameter product (mu_product) beside the step count",
            "ZeroRedundancyOptimizer": "it shards the state itself; give the job the optimizer it wraps"}


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless the optimizer is one whose shards step alike."""
    if type(optimizer) not in SUPPORTED_OPTIMIZERS.values():
        name = type(optimizer).__name__
        why = f" ({_WHY_NOT[name]})" if name in _WHY_NOT else ""
        raise ValueError(f"sharded optimizer state supports {', '.join(SUPPORTED_OPTIMIZERS)} (exactly those "
                         f"classes, not subclasses); got {name}{why}. Use shard=None for other optimizers")
    for group in optimizer.param_groups:
        for flag in ("fused", "differentiable", "capturable"):
            if group.get(flag):
                raise ValueError(f"sharded optimizer state does not support {flag}=True: build the "
                                 f"{type(optimizer).__name__} without it")


def state_names(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    """The elementwise state tensors a supported optimizer keeps per parameter of `group`
    (as its _init_group makes them)."""
    kind = type(optimizer)
    if kind in (torch.optim.AdamW, torch.optim.Adam):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    if kind is torch.optim.RAdam:
        return ("exp_avg", "exp_avg_sq")
    if kind is torch.optim.Adamax:
        return ("exp_avg", "exp_inf")
    if kind is torch.optim.Adadelta:
        return ("square_avg", "acc_delta")
    if kind is torch.optim.RMSprop:
        return (("square_avg",) + (("momentum_buffer",) if group.get("momentum", 0) > 0 else ())
                + (("grad_avg",) if group.get("centered") else ()))
    return ("momentum_buffer",) if group.get("momentum", 0) else ()


def counts_steps(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer keeps a step count per parameter (every supported one but SGD)."""
    return type(optimizer) is not torch.optim.SGD


def step_tensor(step: int) -> torch.Tensor:
    """A step count as torch's optimizers keep it (not capturable, not fused): a 0-dim
    float32 tensor, float64 where that is the default dtype."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(step), dtype=dtype)

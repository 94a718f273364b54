"""The example model and data shared by the example, the tests and the benchmarks.

A regression MLP of about 3.2 M parameters on a synthetic data set made from a
fixed random "teacher" network, so every run with the same seed sees the same
data, with no download. `hidden` and `n_samples` scale it (the checkpoint
benchmark scales it to ~100 MB of state).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

IN_FEATURES = 64
OUT_FEATURES = 16


def make_model(hidden: int = 1024, layers: int = 3, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    dims = [IN_FEATURES] + [hidden] * layers
    mods: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        mods += [nn.Linear(a, b), nn.ReLU()]
    mods.append(nn.Linear(dims[-1], OUT_FEATURES))
    model = nn.Sequential(*mods)
    with torch.no_grad():  # deterministic init independent of the global RNG
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(1, p.shape[-1]) ** 0.5))
    return model


def make_dataset(n_samples: int = 8192, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, IN_FEATURES, generator=g)
    w1 = torch.randn(IN_FEATURES, 128, generator=g) / IN_FEATURES**0.5
    w2 = torch.randn(128, OUT_FEATURES, generator=g) / 128**0.5
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(n_samples, OUT_FEATURES, generator=g)
    return TensorDataset(x, y)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)

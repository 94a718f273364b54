"""The example model and data shared by the example, the tests and the benchmarks.

A regression MLP of about 3.2 M parameters on a synthetic data set made from a
fixed random "teacher" network, so every run with the same seed sees the same
data, with no download. `RecordDataset` serves the same samples as if read
from files (a wait per sample and a CPU decode), for the input pipeline. `hidden` and `n_samples` scale it (the checkpoint
benchmark scales it to ~100 MB of state).
"""

from __future__ import annotations

import ctypes
import random
import time
import zlib

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

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


class RecordDataset(Dataset):
    """The samples of a TensorDataset as records read from storage, the way a
    real data set costs: reading one waits `io_ms` (time.sleep, as a disk or
    network read does) and decodes it on the CPU (zlib, a checksum, bytes to
    tensors; about 45 us per sample here with `record_kb=4` of payload, like a
    small encoded image). Returns (x, y) equal to the TensorDataset's, so a
    run on either trains alike. `bad_index`: that record is corrupt and reading
    it raises (tests of the error path)."""

    def __init__(self, base: TensorDataset, io_ms: float = 1.0, record_kb: int = 4,
                 bad_index: int | None = None) -> None:
        x, y = base.tensors
        self._split = x.shape[1]
        self._io_s = io_ms / 1000.0
        self._bad = bad_index
        rng = random.Random(7)  # text-like filler: compresses about 2:1, as encoded media does not, but close
        words = [bytes(rng.choice(b"abcdefghij") for _ in range(rng.randint(2, 8))) for _ in range(200)]
        pool = b" ".join(rng.choice(words) for _ in range(16_384))
        n = record_kb * 1024
        rows = torch.cat([x, y], dim=1).to(torch.float32).contiguous()
        width = rows.shape[1] * 4
        self._records = []
        for i in range(len(base)):
            raw = ctypes.string_at(rows.data_ptr() + i * width, width)  # hosts have no numpy
            off = (i * 7919) % (len(pool) - n)
            body = raw + pool[off : off + n]
            self._records.append((zlib.compress(body, 6), zlib.crc32(body), len(raw)))

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int):
        if self._io_s:
            time.sleep(self._io_s)
        blob, crc, n = self._records[i]
        body = zlib.decompress(blob)
        if i == self._bad or zlib.crc32(body) != crc:
            raise ValueError(f"record {i} is corrupt (checksum mismatch)")
        v = torch.frombuffer(bytearray(body[:n]), dtype=torch.float32)
        return v[: self._split].clone(), v[self._split :].clone()

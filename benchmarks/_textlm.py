"""A byte-level language model over real text that every machine has: the Python
standard library's own sources (benchmarks/network.py trains it on the shaped bed).

The corpus is the `.py` files under the interpreter's stdlib directory
(`sysconfig.get_paths()["stdlib"]`, without `site-packages`), concatenated in sorted
order of their relative paths, truncated to the first `max_bytes`: the same bytes on
every run of the same Python. The driver builds it once and hands the workers a file,
so every rank reads the same text whatever interpreter it runs.

A sample is a window of `context` bytes and the byte that follows it (the target).
Windows start every `stride` bytes of the training part; one block of the corpus in
every 20 is held out (`Windows`), and the loss on a fixed set of its windows is the
figure the modes are compared by.

The model is a few-layer MLP over an embedding of the window (`LMShape`): embedding,
flatten, `layers` hidden layers of `hidden` units with GELU, logits over 256 bytes.
`SHAPES["small"]` trains on a 2-core CPU in minutes; `SHAPES["5m"]` (about 4.5 M
parameters, 18 MB of fp32 gradients) makes a 1 Gbit/s link matter at a CPU's step
time; `SHAPES["50m"]` has about 51 M
parameters (about 200 MB of fp32 gradients, issue 51's size).

The pure parts (corpus order, windows, sizes) import no torch; the dataset and the
model import it when built.
"""

from __future__ import annotations

import bisect
import math
import os
import sysconfig
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable

VOCAB = 256  # bytes


@dataclass(frozen=True)
class LMShape:
    """The model's size: bytes of context, embedding width, hidden width, hidden layers."""

    context: int
    embed: int
    hidden: int
    layers: int

    def __post_init__(self) -> None:
        if min(self.context, self.embed, self.hidden, self.layers) < 1:
            raise ValueError(f"every size of a model must be at least 1: {self}")

    @property
    def parameters(self) -> int:
        """The parameter count of `make_model(self)` (weights and biases)."""
        n = VOCAB * self.embed                                   # embedding
        n += self.context * self.embed * self.hidden + self.hidden  # first layer
        n += (self.layers - 1) * (self.hidden * self.hidden + self.hidden)
        n += self.hidden * VOCAB + VOCAB                          # logits
        return n


SHAPES = {
    "small": LMShape(context=32, embed=16, hidden=256, layers=2),       # ~0.27 M parameters
    "5m": LMShape(context=64, embed=32, hidden=1024, layers=3),         # ~4.5 M: ~18 MB; a CPU step of ~0.1 s
    "50m": LMShape(context=64, embed=64, hidden=4096, layers=3),        # ~51 M: ~205 MB of fp32 gradients
}

# AdamW's learning rate per model (benchmarks/network.py's --lr default). The 50m model's
# 4096-wide layers learn far faster at 3e-4: one process, global batch 64, held-out loss
# from 5.545 after 100 / 200 / 300 steps: 2.99 / 2.83 / 2.60 at 3e-4, 3.08 / 3.02 / 2.88
# at 1e-3; at 3e-3, world 4, 2.98 only after 500 steps (docs/network.md, session 46).
LEARNING_RATES = {"small": 3e-3, "5m": 3e-3, "50m": 3e-4}


# --- the corpus (pure parts, then the one that reads files) -------------------------

def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


SKIPPED_DIRS = ("site-packages", "dist-packages", "__pycache__")


def corpus_order(relative_paths: Iterable[str]) -> list[str]:
    """The sources in corpus order: `.py` files, sorted, none under site-packages
    (what a machine installed there differs between machines)."""
    return sorted(p for p in relative_paths if p.endswith(".py") and not set(Path(p).parts) & set(SKIPPED_DIRS))


def concatenate(chunks: Iterable[bytes], max_bytes: int) -> bytes:
    """The chunks joined, cut at `max_bytes` (reads no more chunks than it needs)."""
    if max_bytes < 1:
        raise ValueError(f"the corpus needs at least one byte, not max_bytes={max_bytes}")
    out, size = [], 0
    for chunk in chunks:
        out.append(chunk[: max_bytes - size])
        size += len(out[-1])
        if size >= max_bytes:
            break
    return b"".join(out)


def build_corpus(max_bytes: int, root: Path | None = None) -> bytes:
    """The first `max_bytes` of the stdlib's sources in corpus order."""
    root = root or stdlib_dir()
    rel = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIPPED_DIRS]  # not walked at all: they can be large
        rel += [os.path.relpath(os.path.join(d, f), root) for f in files]
    data = concatenate(((root / p).read_bytes() for p in corpus_order(rel)), max_bytes)
    if len(data) < max_bytes:
        raise ValueError(f"the stdlib sources under {root} hold {len(data)} bytes, fewer than the "
                         f"{max_bytes} asked for: ask for fewer (--corpus-mb)")
    return data


# --- samples ----------------------------------------------------------------------

@dataclass(frozen=True)
class Windows:
    """Where the samples of a corpus of `size` bytes lie (pure).

    The corpus is cut into blocks of `block` bytes; every `heldout_every`-th block
    (the last of each group) is held out, so the held-out text is spread over the whole
    corpus rather than being its last files (in sorted order, the codec tables of
    `encodings/`). Training windows start every `stride` bytes inside each run of
    training blocks; held-out windows every `context` bytes inside each held-out block.
    A window spans context + 1 bytes (the inputs and the target that follows) and never
    crosses from one part into the other."""

    size: int
    context: int
    stride: int = 1
    block: int = 16384
    heldout_every: int = 20

    def __post_init__(self) -> None:
        if self.stride < 1 or self.context < 1:
            raise ValueError(f"stride and context must be at least 1: {self}")
        if self.block <= self.context + 1 or self.heldout_every < 2:
            raise ValueError(f"need block > context + 1 and heldout_every >= 2: {self}")
        if self.train_samples < 1 or not self._heldout:
            raise ValueError(f"a corpus of {self.size} bytes is too small for windows of {self.context + 1} "
                             f"bytes with every {self.heldout_every}th block of {self.block} held out: "
                             "use a larger corpus")

    def _runs(self, held: bool) -> list[tuple[int, int]]:
        """[start, end) byte ranges of consecutive blocks of one part."""
        runs: list[tuple[int, int]] = []
        for b in range(-(-self.size // self.block)):
            if (b % self.heldout_every == self.heldout_every - 1) != held:
                continue
            start, end = b * self.block, min(self.size, (b + 1) * self.block)
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], end)
            else:
                runs.append((start, end))
        return runs

    @cached_property
    def _train(self) -> tuple[list[tuple[int, int]], list[int]]:
        """The training runs and the cumulative window counts after each."""
        runs, cum, total = self._runs(held=False), [], 0
        for start, end in runs:
            span = end - start - (self.context + 1)
            total += span // self.stride + 1 if span >= 0 else 0
            cum.append(total)
        return runs, cum

    @cached_property
    def _heldout(self) -> list[int]:
        return [o for start, end in self._runs(held=True)
                for o in range(start, end - self.context, self.context)]

    @property
    def train_samples(self) -> int:
        cum = self._train[1]
        return cum[-1] if cum else 0

    def train_offset(self, i: int) -> int:
        if not 0 <= i < self.train_samples:
            raise IndexError(f"training window {i} of {self.train_samples}")
        runs, cum = self._train
        r = bisect.bisect_right(cum, i)
        return runs[r][0] + (i - (cum[r - 1] if r else 0)) * self.stride

    @property
    def heldout_samples(self) -> int:
        return len(self._heldout)

    def heldout_offsets(self, n: int) -> list[int]:
        """`n` held-out windows' offsets, evenly spread over the held-out part (all of
        them if it has no more than `n`)."""
        every = self._heldout
        if n >= len(every):
            return list(every)
        return [every[j * len(every) // n] for j in range(n)]


def halved(start_loss: float | None, end_loss: float | None) -> bool | None:
    """Whether training went far enough to halve its starting loss (None: no figures)."""
    if start_loss is None or end_loss is None or not math.isfinite(end_loss):
        return None
    return end_loss <= start_loss / 2


# --- torch parts (built in the workers) ----------------------------------------------

def make_dataset(corpus: bytes, windows: Windows):
    """A map-style dataset: sample i is (the window's `context` bytes, the next byte)."""
    import torch

    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)

    class ByteWindows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return windows.train_samples

        def __getitem__(self, i: int):
            o = windows.train_offset(i)
            return data[o:o + windows.context].long(), data[o + windows.context].long()

    return ByteWindows()


def heldout_batch(corpus: bytes, windows: Windows, n: int):
    """(inputs, targets) of the first `n` held-out windows, one tensor each."""
    import torch

    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    offs = windows.heldout_offsets(n)
    x = torch.stack([data[o:o + windows.context] for o in offs]).long()
    y = torch.stack([data[o + windows.context] for o in offs]).long()
    return x, y


def make_model(shape: LMShape, seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Embedding(VOCAB, shape.embed), nn.Flatten(),
                               nn.Linear(shape.context * shape.embed, shape.hidden), nn.GELU()]
    for _ in range(shape.layers - 1):
        layers += [nn.Linear(shape.hidden, shape.hidden), nn.GELU()]
    layers.append(nn.Linear(shape.hidden, VOCAB))
    return nn.Sequential(*layers)


def rank_setup(spec: dict) -> tuple[bytes, LMShape, Windows, object]:
    """What a rank of benchmarks/network.py builds from its spec before it trains (the
    corpus file, shape, stride, seed and torch threads of the driver's plan): the
    corpus, the shape, the windows and the model, the same on every rank and mode."""
    import torch

    torch.set_num_threads(spec["threads"])
    corpus = Path(spec["corpus"]).read_bytes()
    shape = LMShape(**spec["shape"])
    windows = Windows(len(corpus), shape.context, spec["stride"])
    return corpus, shape, windows, make_model(shape, spec["seed"])


def loss_fn(model, batch):
    import torch.nn.functional as F

    x, y = batch
    return F.cross_entropy(model(x), y)


def evaluate(model, batch, chunk: int = 256) -> float:
    """The mean cross-entropy (nats per byte) of `model` on a held-out batch."""
    import torch
    import torch.nn.functional as F

    x, y = batch
    total = 0.0
    was = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(y), chunk):
            total += float(F.cross_entropy(model(x[i:i + chunk]), y[i:i + chunk], reduction="sum"))
    model.train(was)
    return total / len(y)

"""Low-rank gradients with error feedback (PowerSGD: Vogels, Karimireddy and Jaggi,
2019; the algorithm of torch's DDP `powerSGD_hook`, written for this seam).

`ElasticJob(..., compress="powersgd", compress_rank=4)` builds a `LowRankPath`: the
replicated path (gradients.py) for everything it does not compress, plus, for each
float32 gradient matrix big enough that low rank pays (`plan_matrices`: 2+ dims as
rows x the rest, rank < min(rows, cols), at least MIN_ELEMENTS elements, at least
MIN_RATE times fewer elements on the wire), two thin factors instead of the matrix::

    M  = G + E                 this rank's gradient plus its residual from the last step
    P  = M Q                   Q (cols x r): the last step's, warm start (one power iteration per step)
    P  = orth(sum_ranks P)     all-reduce, then an orthonormal basis (QR), identical on every rank
    Qr = M^T P                 this rank's part
    E' = M - P Qr^T            the new residual: what of M the basis missed (kept only if the step commits)
    Q  = sum_ranks Qr          all-reduce
    G  = P Q^T                 the decompressed SUM (the job scales each rank's loss, so the sum is the mean)

Bytes on the wire per matrix: (rows + cols) * r * 4 instead of rows * cols * 4.
The compression runs in `finish`, after backward (simple, and correct whatever
order backward produced the gradients in): the uncompressed buckets still go while
backward runs, and P is computed before their last wait. The control tail
(tail.py) stays exact float32 in the replicated path's own all-reduce.

Every rank decompresses the same gradient: P and Q are all-reduced (identical bytes on
every rank) and everything after is a deterministic function of them, as the optimizer
step already is. The residual E is this rank's own; Q is the same on every rank.

Elastic life (docs/network.md, "Low-rank gradients"):
- A new generation (`bind`: join, leave, crash, restore) resets E to zero and Q to
  the same seeded values on every rank (SEED): a joiner has no residual to receive and
  a leaver's is lost (at most one step's compression error of its share).
- A step that does not commit (dropped, redone after an out-of-memory, skipped by the
  GradScaler for inf/NaN) leaves E and Q as before it: the new ones are kept aside and
  adopted in `step`, the last call of a committing step.
- Checkpoints do not hold E or Q (a restore is a new generation: reset).
- A world of one compresses nothing (no network to spare; E stays zero).
- E is held in the gradients' scaled units (GradScaler): when the scaler changes its
  scale, E is rescaled with it.

Memory: three float32 copies of the compressed gradients (the gradient, E, the pending
E') plus the small factors.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..member import collectives
from ..member.collectives import Aborted
from .gradients import TAIL_DTYPE, ReplicatedPath, StepTiming, all_finite, clip_global_norm_

COMPRESSORS = ("powersgd",)  # ElasticJob(compress=)
DEFAULT_RANK = 4  # ElasticJob(compress_rank=) when compress is set: torch's hook uses 1-4 for most models
MIN_ELEMENTS = 4096  # smaller matrices go uncompressed: their all-reduce costs latency, not bytes
MIN_RATE = 2.0  # compress only where the factors are at least this many times smaller (torch: min_compression_rate)
SEED = 0x5EED  # Q's start at every generation, the same on every rank


@dataclass(frozen=True)
class Matrix:
    """One compressed gradient: parameter `index`, as rows x cols, at `offset` of the
    compressed gradients' buffer, its P at `p_offset` and its Q at `q_offset`."""

    index: int
    rows: int
    cols: int
    offset: int
    p_offset: int
    q_offset: int


def check_settings(compress: str | None, compress_rank: int | None, *, shard: str | None,
                   grad_dtype: str | None, reduce_each_micro_batch: bool) -> int | None:
    """The rank to compress to (None: no compression), or a ValueError naming what to change (pure)."""
    if compress is None:
        if compress_rank is not None:
            raise ValueError(f"compress_rank={compress_rank!r} applies to compress='powersgd'; "
                             "set compress='powersgd' or drop compress_rank")
        return None
    if compress not in COMPRESSORS:
        raise ValueError(f"compress must be None or one of {', '.join(map(repr, COMPRESSORS))}, got {compress!r}")
    rank = DEFAULT_RANK if compress_rank is None else compress_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"compress_rank must be a positive int (the factors' columns, e.g. 4), got {compress_rank!r}")
    if shard is not None:
        raise ValueError(f"compress={compress!r} applies to replicated training: drop shard={shard!r} "
                         "or compress=")
    if grad_dtype not in (None, "fp32"):
        raise ValueError(f"compress={compress!r} sends float32 factors: drop grad_dtype={grad_dtype!r} or compress=")
    if reduce_each_micro_batch:
        raise ValueError(f"compress={compress!r} reduces once per step: drop reduce_each_micro_batch=True "
                         "(it applies to shard='gradients')")
    return rank


def plan_matrices(shapes: Sequence[tuple[int, ...]], kinds: Sequence[str], rank: int,
                  min_elements: int = MIN_ELEMENTS, min_rate: float = MIN_RATE) -> tuple[Matrix, ...]:
    """Which parameters are compressed and where their gradient, P and Q live (pure):
    float32, 2+ dims (rows = the first, cols = the product of the rest), rank < min(rows,
    cols), rows * cols >= min_elements and rows * cols >= min_rate * (rows + cols) * rank."""
    chosen = []
    for i, (shape, kind) in enumerate(zip(shapes, kinds)):
        if kind != str(torch.float32) or len(shape) < 2:
            continue
        rows, cols = shape[0], 1
        for d in shape[1:]:
            cols *= d
        n = rows * cols
        if rank < min(rows, cols) and n >= min_elements and n >= min_rate * (rows + cols) * rank:
            chosen.append((i, rows, cols))
    return place(chosen, rank)


def place(chosen: Sequence[tuple[int, int, int]], rank: int) -> tuple[Matrix, ...]:
    """(index, rows, cols) laid out one after another in the three buffers (pure)."""
    out, off, p_off, q_off = [], 0, 0, 0
    for i, rows, cols in chosen:
        out.append(Matrix(i, rows, cols, off, p_off, q_off))
        off, p_off, q_off = off + rows * cols, p_off + rows * rank, q_off + cols * rank
    return tuple(out)


class PowerSGD:
    """The compressor's arithmetic and state over `matrices` (module docstring): the
    committed residual E and Q, the pending ones of the step in flight, P and Q's wire
    buffers. `reduce(tensor)` sums a tensor over the ranks in place (and waits)."""

    def __init__(self, matrices: Sequence[Matrix], rank: int) -> None:
        self.matrices = tuple(matrices)
        self.rank = rank
        last = self.matrices[-1] if self.matrices else None
        self.numel = last.offset + last.rows * last.cols if last else 0
        self.p_numel = last.p_offset + last.rows * rank if last else 0
        self.q_numel = last.q_offset + last.cols * rank if last else 0
        self.wire_bytes = (self.p_numel + self.q_numel) * TAIL_DTYPE.itemsize  # float32 factors
        self._err = self._err_next = self._q = self._q_next = self._p = torch.empty(0)
        self.pending = False  # a step's E' and Q are computed, not yet committed

    def reset(self, device: torch.device) -> None:
        """A new generation: E zero, Q seeded alike on every rank (drawn on the CPU)."""
        self._err = torch.zeros(self.numel, device=device)
        self._err_next = torch.zeros(self.numel, device=device)
        self._q = torch.randn(self.q_numel, generator=torch.Generator().manual_seed(SEED)).to(device)
        self.forget_wire()
        self.pending = False

    def forget_wire(self) -> None:
        """P's and Q's wire buffers anew: a collective that never finished may still write into the old."""
        device = self._err.device
        self._p = torch.empty(self.p_numel, device=device)
        self._q_next = torch.empty(self.q_numel, device=device)

    def _views(self, m: Matrix, flat: torch.Tensor) -> torch.Tensor:
        return flat[m.offset:m.offset + m.rows * m.cols].view(m.rows, m.cols)

    def _p_of(self, m: Matrix) -> torch.Tensor:
        return self._p[m.p_offset:m.p_offset + m.rows * self.rank].view(m.rows, self.rank)

    def _q_of(self, m: Matrix, flat: torch.Tensor) -> torch.Tensor:
        return flat[m.q_offset:m.q_offset + m.cols * self.rank].view(m.cols, self.rank)

    def prepare(self, grads: torch.Tensor) -> None:
        """Local work before any collective: M = G + E in place in `grads`; P = M Q."""
        self.pending = False
        with torch.no_grad():
            grads.add_(self._err)
            for m in self.matrices:
                torch.mm(self._views(m, grads), self._q_of(m, self._q), out=self._p_of(m))

    def exchange(self, grads: torch.Tensor, reduce: Callable[[torch.Tensor], None]) -> None:
        """The two all-reduces; `grads` (holding M) ends as the decompressed sum; E' and Q pending."""
        with torch.no_grad():
            reduce(self._p)
            for m in self.matrices:
                p = self._p_of(m)
                p.copy_(torch.linalg.qr(p, mode="reduced").Q)
                big = self._views(m, grads)
                q = self._q_of(m, self._q_next)
                torch.mm(big.T, p, out=q)
                torch.addmm(big, p, q.T, beta=1, alpha=-1, out=self._views(m, self._err_next))
            reduce(self._q_next)
            for m in self.matrices:
                torch.mm(self._p_of(m), self._q_of(m, self._q_next).T, out=self._views(m, grads))
        self.pending = True

    def commit(self, adopt: bool = True, scale_ratio: float = 1.0) -> None:
        """The step committed: its E' and Q become the ones the next step starts from
        (adopt False: a step the GradScaler skipped keeps the old ones); E is then
        multiplied by `scale_ratio`, the GradScaler's new scale over the old."""
        if adopt and self.pending:
            self._err, self._err_next = self._err_next, self._err
            self._q, self._q_next = self._q_next, self._q
        if scale_ratio != 1.0:
            self._err.mul_(scale_ratio)
        self.pending = False

    def residual(self) -> torch.Tensor:
        """The committed residual E (read-only use: tests and figures)."""
        return self._err


class LowRankPath(ReplicatedPath):
    """The replicated path with its big float32 gradient matrices sent as low-rank
    factors with error feedback (module docstring); the rest, and the control tail,
    go through ReplicatedPath's buckets unchanged."""

    def __init__(self, params: list[torch.Tensor], bucket_mb: float, rank: int = DEFAULT_RANK,
                 device: torch.device = torch.device("cpu"), min_elements: int = MIN_ELEMENTS) -> None:
        matrices = plan_matrices([tuple(p.shape) for p in params], [str(p.dtype) for p in params], rank,
                                 min_elements)
        compressed = {m.index for m in matrices}
        plain = [i for i in range(len(params)) if i not in compressed]
        super().__init__([params[i] for i in plain], bucket_mb, device=device)
        self._all = params
        self._inner = {i: k for k, i in enumerate(plain)}  # index among params -> ReplicatedPath's index
        self.lowrank = PowerSGD(matrices, rank)
        self._grad_flat: torch.Tensor | None = None  # the compressed parameters' .grad are views of it
        self._lr_works: list = []  # the low-rank collective in flight (drop looks at it)

    @property
    def matrices(self) -> tuple[Matrix, ...]:
        return self.lowrank.matrices

    def bind(self, pg, rank: int, members: Sequence[str], abort: threading.Event) -> None:
        """A new generation: E and Q reset alike on every rank (module docstring)."""
        super().bind(pg, rank, members, abort)
        self.lowrank.reset(self.device)
        self._lr_works = []
        if self._grad_flat is None or self._grad_flat.device != self.device:
            self._grad_flat = torch.zeros(self.lowrank.numel, device=self.device)

    def begin(self, tail_size: int) -> None:
        super().begin(tail_size)
        flat = self._grad_flat
        with torch.no_grad():
            for m in self.matrices:
                p = self._all[m.index]
                view = flat[m.offset:m.offset + m.rows * m.cols]
                if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                    continue
                view = view.view_as(p)
                if p.grad is None:
                    view.zero_()
                else:  # the script replaced .grad (zero_grad)
                    view.copy_(p.grad)
                p.grad = view
        self.lowrank.pending = False

    def grad_ready(self, index: int, p: torch.Tensor) -> None:
        inner = self._inner.get(index)
        if inner is not None:  # a compressed gradient waits for finish
            super().grad_ready(inner, p)

    def finish(self, abort: threading.Event) -> torch.Tensor:
        """The uncompressed buckets and the tail (ReplicatedPath.finish), then the
        low-rank exchange; the step's timing covers both, its bytes what was sent."""
        t0 = time.perf_counter()
        compressing = bool(self.matrices) and len(self.members) > 1  # a world of one: nothing to send
        if compressing:
            self.lowrank.prepare(self._grad_flat)  # local compute while the buckets still go
        tail = super().finish(abort)
        sent = self.last_step_timing.bytes
        if compressing:
            self.lowrank.exchange(self._grad_flat, lambda t: self._reduce(t, abort))
            sent += self.lowrank.wire_bytes
        self.last_step_timing = StepTiming(time.perf_counter() - t0, sent)
        return tail

    def _reduce(self, t: torch.Tensor, abort: threading.Event) -> None:
        try:
            work = collectives.allreduce_async(self.pg, t)
        except Exception as e:  # noqa: BLE001 - a broken group: the step is dropped
            raise Aborted(f"a low-rank all-reduce could not be launched: {e}", backend_error=True) from e
        self._lr_works = [work]
        collectives.wait_work(work, abort)
        self._lr_works = []

    def _grads(self) -> list[torch.Tensor]:
        return [f[:n] for f, n in zip(self._flats or (), self.layout.lengths)] + [self._grad_flat]

    def clip_grad_norm_(self, max_norm: float, abort: threading.Event) -> float:
        return clip_global_norm_(self._grads(), max_norm)

    def step(self, optimizer: torch.optim.Optimizer, scaler: Any, abort: threading.Event) -> bool:
        """The optimizer step, then this step's E' and Q become the committed ones
        (unless the GradScaler skips it: inf/NaN, identical on every rank)."""
        if scaler is None:
            optimizer.step()
            self.lowrank.commit()
            return False
        finite = all_finite(self._grads())
        before = float(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        self.lowrank.commit(adopt=finite, scale_ratio=float(scaler.get_scale()) / before)
        return not finite

    def zero(self) -> None:
        super().zero()
        if self._grad_flat is not None:
            self._grad_flat.zero_()

    def drop(self) -> None:
        super().drop()
        self.lowrank.pending = False
        if not collectives.settled(self._lr_works):
            self.lowrank.forget_wire()
        self._lr_works = []


def lowrank_path(params: list[torch.Tensor], bucket_mb: float, rank: int) -> LowRankPath:
    """ElasticJob's low-rank path (job._gradient_path, after check_settings)."""
    return LowRankPath(params, bucket_mb, rank)

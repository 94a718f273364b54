"""One global step as ElasticJob runs it: what is in flight between the batch handed
to the script and the commit (`InFlight`), and how the reduced gradients are applied
(`OptimizerStep`: unscale, clip to the global norm, the script's hook, the optimizer
step, each through the gradient path so every rank decides alike), and how an aborted
generation stops the script's forward pass early (`forward_abortable`).

A new `InFlight` is made at each step's start (a few fields; the step reads them, its
commit writes the audit line from them); the job's step itself, its control tail
(tail.py) and its boundary (boundary.py) are job.py's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..member import collectives
from ..member.collectives import Aborted


class InFlight:
    """The step in flight: this rank's indices, the step's global sample count, the
    global indices (for the audit log only), the loss summed over this rank's
    micro-batches, the size of the micro-batch the script holds, and the reduction
    rounds this rank pads (reduce_each_micro_batch: _agree_rounds)."""

    __slots__ = ("indices", "global_count", "global_indices", "loss_sum", "mb_count", "in_step", "pad")

    def __init__(self, indices: list[int], global_count: int, global_indices: list[int]) -> None:
        self.indices = indices
        self.global_count = global_count
        self.global_indices = global_indices
        self.loss_sum = 0.0
        self.mb_count = 0
        self.in_step = False  # the script holds a batch of this step: job.step() is due
        self.pad = 0

    def agree_rounds(self, pg: Any, n: int, abort: threading.Event, device: Any) -> None:
        """reduce_each_micro_batch: every rank runs as many reduction rounds as the rank
        with the most micro-batches in this step (ranks' shares and micro-batch limits
        differ: speed-balanced shares, a host's max_micro_batch, an out-of-memory redo);
        this rank, with `n`, reduces `pad` empty rounds before its last. One small
        all-reduce per step; Aborted: the group broke."""
        most = collectives.allreduce(pg, torch.tensor([n], dtype=torch.int64, device=device), abort,
                                     dist.ReduceOp.MAX)
        self.pad = int(most[0]) - n

    def pad_rounds(self, grads: Any) -> float:
        """Before the last micro-batch's backward: the rounds this rank has no micro-batch
        for, reduced from zeros. Returns the seconds they took (not this rank's compute
        time: its pace, balance.py)."""
        t0 = time.perf_counter()
        for _ in range(self.pad):
            grads.empty_round()
        self.pad = 0
        return time.perf_counter() - t0


NOTHING_IN_FLIGHT = InFlight([], 0, [])


class OptimizerStep:
    """Applying a step's reduced gradients (module docstring)."""

    def __init__(self, optimizer: Any, *, scaler: Any, max_grad_norm: float | None,
                 before: Callable[[Any], None] | None) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        self._optimizer = optimizer
        self.scaler = scaler
        self._max_grad_norm = max_grad_norm
        self._before = before
        self.grad_norm: float | None = None  # the global norm of the last step before clipping

    @property
    def hooked(self) -> bool:
        """The script's before_optimizer_step hook is set (a joiner cannot catch up past it: catchup.py)."""
        return self._before is not None

    def run(self, job: Any, grads: Any, abort: Any) -> bool:
        """Unscale, clip, the hook (called with `job`), the optimizer step, all through the
        gradient path `grads`, so every rank decides alike (the global norm, an inf/NaN in
        any rank's gradients). Returns True if the GradScaler skipped the step. Raises
        collectives.Aborted where a sharded path's collectives broke."""
        scaler = self.scaler
        if scaler is not None:
            grads.unscale_(scaler, self._optimizer)
        if self._max_grad_norm is not None:
            self.grad_norm = grads.clip_grad_norm_(self._max_grad_norm, abort)
        if self._before is not None:
            self._before(job)
        skipped = grads.step(self._optimizer, scaler, abort)
        if self._max_grad_norm is not None and getattr(grads, "grad_norm", None) is not None:
            self.grad_norm = grads.grad_norm  # sharded: the norm summed over the shards in its step
        return skipped


@contextlib.contextmanager
def forward_abortable(abort: threading.Event, reason: Callable[[], str]) -> Iterator[None]:
    """While the job runs the script's loss function in the last micro-batch (the form
    `job.step(lambda: ...)`): an aborted generation stops the forward pass at the next
    module call, as the job's gradient hook stops backward (a step it dooms would otherwise
    run through the rest of forward and the start of backward before a gradient hook saw
    it). A global forward pre-hook, registered for the call only, so that the script's
    modules carry no hook of the job's (a model pickled or deep-copied meanwhile would
    take it along). `reason()`: why the generation was aborted (the control thread's)."""

    def pre_hook(_module, _args) -> None:
        if abort.is_set():
            raise Aborted(f"the generation was aborted during forward ({reason()})")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()

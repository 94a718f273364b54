"""A round's averaging on the wire (local steps, local.py): the buffer holds
sum_i s_i delta_i (the body), then sum_i s_i and, while joiners catch up, their slots
(the trailer). `ElasticJob(sync="local", sync_every=H)` all-reduces it whole, in its own
dtype (float32; float64 where a parameter is). With `grad_dtype="bf16"` the body travels
as a bfloat16 copy, half the bytes of a round, and the trailer as float32 beside it (two
all-reduces, launched together): the sample counts and the slots stay exact (bfloat16
holds integers exactly only up to 256).

In bf16 the body's values keep 8 significant bits on the wire and the backend sums them
in bfloat16, as the synchronous bf16 path does (gradients.py); the sums come back into
the float32 buffer, so the mean delta, the outer step and the outer optimizer's state
stay float32, and identical on every rank (every rank casts the same summed bits back).
The rounding is what Streaming DiLoCo's quantized outer gradients do at 4 bits; its
cost in loss is measured in docs/network.md.

A planned leave's averaging (an owner's yield: the leaver's partial round, on the wire
while the survivors train on) travels in bfloat16 unless `grad_dtype="fp32"` was asked
for (`leave_dtype`): the leaver holds its device until its part of that all-reduce is
done, so half the bytes give the owner the device back sooner (measured in
docs/network.md); it is one round per leave, rounded once.
"""

from __future__ import annotations

import threading

import torch

from ..member import collectives


def leave_dtype(grad_dtype: str | None) -> torch.dtype | None:
    """How a planned leave's averaging travels (module docstring): bfloat16, or whole
    (None) where the job asked for float32 (`grad_dtype="fp32"`)."""
    return None if grad_dtype == "fp32" else torch.bfloat16


class RoundWire:
    """How a round's averaging buffer goes on the wire (module docstring); `dtype` None:
    whole, else the body as `dtype` (torch.bfloat16)."""

    __slots__ = ("dtype", "_body")

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self._body: torch.Tensor | None = None  # the body's wire copy, kept between rounds

    def bytes(self, flat: torch.Tensor, numel: int) -> int:
        """The bytes one rank puts into the all-reduce(s) of `flat` (body `numel` long)."""
        if self.dtype is None:
            return flat.numel() * flat.element_size()
        return numel * self.dtype.itemsize + (flat.numel() - numel) * flat.element_size()

    def launch(self, pg, flat: torch.Tensor, numel: int) -> list:
        """Launch the all-reduce(s) of `flat` on `pg`; their works, in launch order (every
        rank launches the same ones in the same order). `land` once they completed."""
        if self.dtype is None:
            return [collectives.allreduce_async(pg, flat)]
        if self._body is None or self._body.numel() != numel or self._body.device != flat.device:
            self._body = torch.empty(numel, dtype=self.dtype, device=flat.device)
        with torch.no_grad():
            self._body.copy_(flat[:numel])
        return [collectives.allreduce_async(pg, self._body), collectives.allreduce_async(pg, flat[numel:])]

    def land(self, flat: torch.Tensor, numel: int) -> None:
        """The works `launch` returned completed: the body's sums back into `flat`."""
        if self.dtype is not None:
            with torch.no_grad():
                flat[:numel].copy_(self._body)

    def allreduce(self, pg, flat: torch.Tensor, numel: int, abort: threading.Event | None) -> None:
        """The whole averaging, waited for: `flat` holds the sums after it. Aborted (the
        group broke, the generation was aborted) with `flat`'s body perhaps unsummed."""
        for work in self.launch(pg, flat, numel):
            collectives.wait_work(work, abort)
        self.land(flat, numel)

    def forget(self) -> None:
        """An all-reduce that never finished may still write into the body: a new one next."""
        self._body = None

    def adopt(self, body: torch.Tensor) -> None:
        """A body allocated ahead (LeaveMemory), where none is held yet."""
        if self._body is None and self.dtype is not None:
            self._body = body


class LeaveMemory:
    """The host memory a planned leave's launch writes into (local.py's LocalPath.launch:
    this rank's parameters at the round's end, and the averaging's bfloat16 body),
    allocated and touched on a helper thread from the job's first step on, so that a
    leave's boundary does not fault it in: for the 50 M-parameter model that was 300 MB
    and 0.8-0.9 s of each member's boundary on two shared cores. CPU only (a device's
    caching allocator has it at once); kept for the job's life, as an overlapped
    averaging keeps them (1.5x the parameters' bytes)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._started = False
        self._got: tuple[list[torch.Tensor], torch.Tensor | None] | None = None

    def ready(self, params: list[torch.Tensor], wire: RoundWire,
              device: torch.device) -> tuple[bool, list[torch.Tensor] | None]:
        """Start the helper at the first call. (done, the round's-end parameters once: the
        launch's `ends`); `wire` (the leave's) adopts the body then. Where the helper
        failed, nothing is handed over and the launch allocates as before. Off the CPU:
        (True, None), nothing allocated."""
        if device.type != "cpu":
            return True, None
        if not self._started:
            self._started = True
            shapes = [(p.shape, p.dtype) for p in params]
            numel, body_dtype = sum(p.numel() for p in params), wire.dtype

            def touch() -> None:
                try:  # zeros: written, so every page is faulted in here
                    ends = [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes]
                    body = torch.zeros(numel, dtype=body_dtype) if body_dtype is not None else None
                    self._got = (ends, body)
                finally:
                    self._done.set()

            threading.Thread(target=touch, name="eltctl-leave-memory", daemon=True).start()
        if not self._done.is_set():
            return False, None
        got, self._got = self._got, None
        if got is None:
            return True, None
        if got[1] is not None:
            wire.adopt(got[1])
        return True, got[0]

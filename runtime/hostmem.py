"""Host memory handed from one layout of the sharded state to the next (CPU only).

torch's CPU allocator gives a block of a megabyte or more back to the OS when it is
freed, and the next such block is faulted in afresh, a page (4 KiB) at a time, the kernel
zeroing each. A reshard allocated the new layout's buffers (the chunk gradients, the
backups' copies, the optimizer state's sections that the move fills) fresh, inside the
pause, while the old layout's pre-step copy, about as big and dead between steps, sat
idle beside them. Pages the OS hands out fresh cost 1.5 us each at best; on this
project's 2-core VMs, where they come back from the host, 5-10 us (measured: the new
state of a ZeRO-1 join 3 -> 4 with two replicas, 200 MB per member, took 1.4-1.6 s to
fill fresh and 0.02-0.04 s carved out of memory the rank held). Freed pages the OS hands
out again soon after are cheap: what a reshard frees (the old layout's state and
buffers) serves the new layout's first step well, and must not be held back for it.

A `Recycler` holds the byte ranges of buffers that died and carves new buffers out of
them, best fit; what does not fit is allocated as before. The sharded path gives it the
old layout's pre-step copy (one allocation, ShardedGradients._spare) as a reshard
starts, or a joiner's memory touched while it waited to be admitted
(ShardedPath.prepare_join); the new layout's bind and move take from it; once the move
is done it is released (`release`), and the old layout's buffers are let go of at the
same moment. Releasing hands back the pages of what nobody took (a carved buffer keeps
its whole allocation mapped, so the unused rest of it goes back with madvise instead of
staying resident). A rank holds no more memory than before, and less at a reshard's
peak: the new state is carved out of the old pre-step copy instead of being allocated
beside it.

The contract: give only buffers this process allocated (never a memory-mapped file's)
that nothing reads or writes any more; carved buffers are views of them.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

# Below this a buffer is not worth keeping (torch's CPU allocator reuses small blocks itself).
MIN_BYTES = 1 << 20
ALIGN = 64  # every carved buffer starts on a cache line, as torch's own allocations do
_MADV_DONTNEED = 4  # Linux


def _madvise():
    """libc's madvise on Linux (None elsewhere: the unused rest then stays mapped until freed)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise  # the process's own libc (no ldconfig run)
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


class Recycler:
    """Dead host buffers, carved into new ones (module docstring). Not thread-safe: one
    rank's main thread gives and takes."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []  # uint8 views of dead memory, disjoint
        self.given = 0  # bytes handed in
        self.taken = 0  # bytes carved out (served without a fresh allocation)
        self.fresh = 0  # bytes that did not fit and were allocated afresh

    def give(self, *tensors: torch.Tensor | None) -> None:
        """Buffers nothing uses any more (see the contract above). Skipped: None, other
        devices, expanded or non-contiguous views, small ones, and any that overlaps one
        already given (a view of the same memory must not be carved twice)."""
        for t in tensors:
            if t is None or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
                continue
            nbytes = t.numel() * t.element_size()
            if nbytes < MIN_BYTES:
                continue
            lo = t.data_ptr()
            if any(lo < f.data_ptr() + f.numel() and f.data_ptr() < lo + nbytes for f in self._free):
                continue
            self._free.append(t.detach().reshape(-1).view(torch.uint8))
            self.given += nbytes

    @property
    def free_bytes(self) -> int:
        return sum(f.numel() for f in self._free)

    def empty(self, n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """An uninitialised 1-D tensor of `n` elements: carved out of the smallest given
        range it fits in, or allocated (torch.empty) where none does or off the CPU."""
        if torch.device(device).type != "cpu":
            return torch.empty(n, dtype=dtype, device=device)
        need = n * torch.empty((), dtype=dtype).element_size()
        best, at = None, 0
        for i, f in enumerate(self._free):
            skip = -f.data_ptr() % ALIGN
            if f.numel() >= skip + need and (best is None or f.numel() < self._free[best].numel()):
                best, at = i, skip
        if best is None or need == 0:
            self.fresh += need
            return torch.empty(n, dtype=dtype)
        f = self._free[best]
        piece = f[at:at + need].view(dtype)
        rest = f[at + need:]
        if rest.numel() >= MIN_BYTES:
            self._free[best] = rest
        else:
            del self._free[best]
            self._drop([rest])
        self.taken += need
        return piece

    def zeros(self, n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.empty(n, dtype, device).zero_()

    def release(self) -> None:
        """Let go of every range nobody took: their pages go back to the OS now (a range
        that is the rest of a carved buffer's allocation would otherwise stay resident
        as long as that buffer lives)."""
        free, self._free = self._free, []
        self._drop(free)

    @staticmethod
    def _drop(ranges: list[torch.Tensor]) -> None:
        if _MADVISE is None:
            return
        page = mmap.PAGESIZE
        for f in ranges:
            lo = -(-f.data_ptr() // page) * page  # whole pages inside the range only: a page it
            hi = (f.data_ptr() + f.numel()) // page * page  # shares with a carved buffer stays
            if hi > lo:
                _MADVISE(lo, hi - lo, _MADV_DONTNEED)

    def stats(self) -> dict[str, int]:
        return {"recycled_bytes": self.taken, "fresh_bytes": self.fresh}

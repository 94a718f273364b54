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
old layout's pre-step copy (one allocation, Stepper._spare) as a reshard
starts, and memory touched ahead: a joiner's, touched before it asks to be admitted
(ShardedPath.prepare_join), or a member's, touched while the job holds a queued joiner
back for it (ShardedPath.ready_for_join); the new layout's bind and move take from it; once the move
is done it is released (`release`), and the old layout's buffers are let go of at the
same moment. Releasing hands back the pages of what nobody took (a carved buffer keeps
its whole allocation mapped, so the unused rest of it goes back with madvise instead of
staying resident). A rank holds no more memory than before, and less at a reshard's
peak: the new state is carved out of the old pre-step copy instead of being allocated
beside it.

What is allocated afresh (a Recycler's misses, the sharded path's buffers where it has
no recycler, the pre-step copy, the replicated path's gradient buffers) comes from
`empty`, which asks the kernel for transparent huge pages for it: on Linux with THP in
`madvise` mode (the common default) a 400 MB buffer is then faulted in 700 times instead
of 102,400. An admin who turns THP off (`never`) turns this off too.

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

_MADV_HUGEPAGE = 14  # Linux
HUGE = 1 << 21  # a transparent huge page (x86-64, arm64 with 4 KiB pages)
HUGE_MIN_BYTES = 4 << 20  # below this a buffer is left to 4 KiB pages


def empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A new uninitialised 1-D host buffer of `n` elements, its first touch faulted in
    2 MiB pages where the kernel's transparent huge pages are on for regions that ask
    (`madvise` mode, as on this project's VMs; `always` does it anyway). Fresh 4 KiB pages
    cost a fault each (400 MB: 102,400 faults and 0.13 s here on an idle machine, 700
    faults and 0.06-0.07 s in 2 MiB pages), and a reshard's buffers and the first step's
    pre-step copy after it are fresh (about 165,000 faults in a SIGKILL's pause at world
    4). Only the whole huge pages inside the buffer are advised, before anything touches
    them; elsewhere (no madvise, a kernel that refuses) it is a plain torch.empty."""
    t = torch.empty(n, dtype=dtype)
    nbytes = n * t.element_size()
    if _MADVISE is not None and nbytes >= HUGE_MIN_BYTES:
        lo = -(-t.data_ptr() // HUGE) * HUGE
        hi = (t.data_ptr() + nbytes) // HUGE * HUGE
        if hi > lo:
            _MADVISE(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return t


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
            return empty(n, dtype)
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

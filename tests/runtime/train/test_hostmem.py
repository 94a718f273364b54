"""Host memory handed from one layout to the next (train/zero/hostmem.py): what a Recycler
carves out of the buffers it is given, what it refuses, and that releasing it hands the
pages nobody took back to the OS without touching what was carved."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from eltctl_runtime.train.zero import hostmem
from eltctl_runtime.train.zero.hostmem import ALIGN, MIN_BYTES, Recycler

MB = 1 << 20


def span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def inside(t: torch.Tensor, base: torch.Tensor) -> bool:
    lo, hi = span(t)
    blo, bhi = span(base)
    return blo <= lo and hi <= bhi


def test_buffers_are_carved_out_of_what_was_given_best_fit_aligned_and_disjoint():
    small, large = torch.empty(3 * MB, dtype=torch.uint8), torch.empty(8 * MB, dtype=torch.uint8)
    rec = Recycler()
    rec.give(large, small)
    a = rec.empty(MB // 4, torch.float32)  # 1 MB: the smallest range it fits in
    b = rec.empty(MB // 8, torch.float64)  # 1 MB, another dtype
    c = rec.empty(3 * MB // 4, torch.float32)  # 3 MB: only the large one has that left
    assert inside(a, small) and inside(b, small) and inside(c, large)
    assert all(t.data_ptr() % ALIGN == 0 for t in (a, b, c))
    spans = sorted(span(t) for t in (a, b, c))
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))  # no byte handed out twice
    assert (a.dtype, a.numel(), b.dtype, b.numel()) == (torch.float32, MB // 4, torch.float64, MB // 8)
    assert rec.stats() == {"recycled_bytes": 5 * MB, "fresh_bytes": 0}


def test_what_does_not_fit_is_allocated_fresh_and_counted():
    given = torch.empty(2 * MB, dtype=torch.uint8)
    rec = Recycler()
    rec.give(given)
    t = rec.empty(MB, torch.float32)  # 4 MB
    assert not inside(t, given) and t.numel() == MB
    assert rec.stats() == {"recycled_bytes": 0, "fresh_bytes": 4 * MB}
    z = rec.zeros(MB // 4, torch.float32)
    assert inside(z, given) and int(z.count_nonzero()) == 0


def test_small_expanded_overlapping_and_foreign_device_buffers_are_not_taken():
    base = torch.empty(4 * MB, dtype=torch.uint8)
    rec = Recycler()
    rec.give(base[: MIN_BYTES // 2],  # too small to be worth keeping
             torch.empty(1).expand(MB),  # an expanded view: one element of memory
             torch.empty(2 * MB, dtype=torch.uint8)[::2],  # not contiguous
             None)
    assert rec.free_bytes == 0
    rec.give(base[MB:3 * MB])
    rec.give(base[2 * MB:], base)  # both overlap what it holds: a byte must never be carved twice
    assert rec.free_bytes == 2 * MB
    if torch.cuda.is_available():
        rec.give(torch.empty(2 * MB, dtype=torch.uint8, device="cuda"))
        assert rec.free_bytes == 2 * MB


@pytest.mark.skipif(not sys.platform.startswith("linux") or hostmem._MADVISE is None,
                    reason="pages are handed back with Linux's madvise")
def test_release_hands_back_the_pages_nobody_took_and_keeps_what_was_carved():
    page = mmap.PAGESIZE
    base = torch.full((16 * MB,), 7, dtype=torch.uint8)
    rec = Recycler()
    rec.give(base)
    kept = rec.empty(3 * MB + 5, torch.uint8)  # ends inside a page
    assert inside(kept, base)
    rec.release()
    assert rec.free_bytes == 0
    assert bool((kept == 7).all())  # what was carved is untouched, its last page included
    end = span(kept)[1] - base.data_ptr()
    first_whole_page = -(-(base.data_ptr() + end) // page) * page - base.data_ptr()
    last_whole_page = (base.data_ptr() + base.numel()) // page * page - base.data_ptr()
    assert bool((base[end:first_whole_page] == 7).all())  # the page it shares with the carved buffer stays
    assert int(base[first_whole_page:last_whole_page].count_nonzero()) == 0  # handed back: zero pages again
    assert bool((base[last_whole_page:] == 7).all())  # a page only partly in the range is not


def _path(shard: str = "optimizer", replicas: int = 2):
    from eltctl_runtime.train.zero import sharded_path

    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))  # 2 MB of parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return sharded_path(shard, model, opt, list(model.parameters()), bucket_mb=1.0, replicas=replicas)


class AdmittedOnceTouched:
    """The joiner's stop event: not set while it touches its memory, set when it waits."""

    def is_set(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> bool:
        return True


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def _huge_kib_around(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold `t` (/proc/self/smaps; the advice splits
    the mapping at the first and last whole huge page)."""
    lo_t, hi_t = span(t)
    total, inside_t = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside_t = lo < hi_t and lo_t < hi
        elif inside_t and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("madvise", "always"),
                    reason="transparent huge pages are off (or not Linux)")
def test_a_large_host_buffer_is_faulted_in_huge_pages():
    """hostmem.empty advises the whole 2 MiB pages inside a large buffer before anything
    touches it, so its first touch costs a fault per 2 MiB; in the kernel's `madvise` mode
    torch's own allocations stay in 4 KiB pages."""
    big = hostmem.empty(64 * MB // 4, torch.float32)
    assert big.numel() == 64 * MB // 4 and big.dtype == torch.float32
    big.fill_(1.0)
    assert _huge_kib_around(big) >= 32 * 1024  # most of it, whatever the alignment left over
    if _thp_mode() == "madvise":
        plain = torch.empty(64 * MB, dtype=torch.uint8)
        plain.fill_(1)
        assert _huge_kib_around(plain) == 0  # what the advice changed, not the kernel's default



@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_a_joiner_admitted_in_time_keeps_the_memory_its_first_layout_needs(shard):
    from eltctl_runtime.train.zero import ShardedGradients

    path = _path(shard)
    path.prepare_join(3, AdmittedOnceTouched())
    lay = path.layout_of(["a", "b", "c"])
    need = ShardedGradients(path.params, path.optimizer, lay, 2, shard).host_bytes()
    # at least the parameters' padded buffer (ZeRO-1: and the gradients') and the held state
    n = sum(lay.padded(g) for g in range(len(lay.groups))) * 4
    assert need > (2 if shard == "optimizer" else 1) * n
    assert path.joiner_memory is not None and path.joiner_memory.free_bytes == need
    new = path.new_path(lay, 2)  # its first path carves out of it
    assert new.recycler.free_bytes == need and path.joiner_memory is None


def test_a_joiner_kept_waiting_gives_the_memory_back(monkeypatch):
    import threading

    from eltctl_runtime.train.zero import prepare

    monkeypatch.setattr(prepare, "JOINER_MEMORY_HOLD_S", 0.05)
    path = _path()
    path.prepare_join(3, threading.Event())  # never admitted: it gives up after the hold
    assert path.joiner_memory is None


def test_a_member_with_no_layout_yet_is_ready_for_a_joiner_at_once():
    """ready_for_join touches a member's next layout's memory only where it has a layout
    (a path not bound yet has nothing to move): no helper thread, no memory held."""
    path = _path()
    assert path.ready_for_join(3) and not path.preparing

"""The mirror's pure decisions, tested by tables: the back-off schedule, what retention
deletes, the order to try restore candidates in, the lag, and comparing checksums.
(Which host a checkpoint path belongs to is `eltctl.hosts.layout.checkpoint_host`.)"""

from __future__ import annotations

from typing import Iterable, Sequence

from eltctl.mirror.values import Located


def backoff_delay(attempt: int, *, base: float = 2.0, cap: float = 60.0) -> float:
    """Seconds to wait before retry `attempt` (1 = first retry): base * 2^(attempt-1), capped."""
    if attempt < 1:
        return 0.0
    return min(cap, base * (2 ** min(attempt - 1, 30)))


def retention_plan(present: Iterable[int], keep: int, verified: int) -> list[int]:
    """Mirrored steps to delete once `verified` has just been copied and verified.

    The newest `keep` steps stay, and so does `verified` whatever its rank; nothing
    newer than `verified` is deleted (a newer copy is not known to be good), so the
    last good checkpoint is never deleted before a newer one has been verified.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    ordered = sorted(set(present) | {verified}, reverse=True)
    kept = set(ordered[:keep]) | {verified}
    return sorted(s for s in ordered if s not in kept and s < verified)


def restore_order(candidates: Iterable[Located]) -> list[Located]:
    """The order to try checkpoints in: newest step first; for one step a host's copy
    before the mirror's (no transfer, or a shorter one), then by host name."""
    return sorted(candidates, key=lambda c: (-c.step, c.on_mirror, c.where))


def lag(newest_committed: int | None, newest_mirrored: int | None) -> int | None:
    """How many steps the mirror is behind the newest committed checkpoint (None: unknown)."""
    if newest_committed is None:
        return None
    if newest_mirrored is None:
        return newest_committed
    return max(0, newest_committed - newest_mirrored)


def compare_sums(expected: Sequence[tuple[str, int, str]], sums: dict[str, str]) -> str | None:
    """None if every file has its manifest's sha256, else what differs."""
    for name, _size, sha in expected:
        got = sums.get(name)
        if got is None:
            return f"{name} is missing"
        if got != sha:
            return f"{name} sha256 {got[:12]}... differs from the manifest's {sha[:12]}..."
    return None

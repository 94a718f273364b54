"""Retention on the mirror: delete what `retention_plan` says, sweep dead copies' leftovers."""

from __future__ import annotations

import shlex
import uuid

from eltctl.mirror.decisions import retention_plan
from eltctl.mirror.places import LIST_TIMEOUT, list_place, run_checked
from eltctl.mirror.values import Place
from eltctl_runtime.checkpoint import format as ckpt

STALE_TMP_MINUTES = 120  # `.tmp-*` on the mirror older than this are leftovers of a dead copy


async def apply_retention(place: Place, keep: int, verified: int) -> list[int]:
    """Delete what `retention_plan` says (renamed to `.tmp-*` first) and sweep stale temps."""
    present = [c.step for c in await list_place(place)]
    doomed = retention_plan(present, keep, verified)
    parts = [f"cd {shlex.quote(place.directory)} || exit 0"]
    for step in doomed:
        name = ckpt.step_dirname(step)
        gone = f"{ckpt.TMP_PREFIX}expired-{name}-{uuid.uuid4().hex[:12]}"
        parts.append(f"mv -- {name} {gone} && rm -rf -- {gone}")
    parts.append(f"find . -maxdepth 1 -name '{ckpt.TMP_PREFIX}*' -mmin +{STALE_TMP_MINUTES} "
                 f"-exec rm -rf -- {{}} + 2>/dev/null; exit 0")
    await run_checked(place.transport, "; ".join(parts), "retention", LIST_TIMEOUT)
    return doomed

"""Restore before a start with no survivor: choose the newest valid checkpoint and deliver it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

from eltctl.mirror.job import Mirror
from eltctl.mirror.target import MirrorTarget, TargetKind
from eltctl.mirror.values import MIRROR_LABEL, Place, RestoreChoice


@dataclass(frozen=True)
class RestorePlan:
    """What `prepare_restore` did: the checkpoint chosen, and where it now lies ready."""

    choice: RestoreChoice | None
    ready: tuple[str, ...]  # hosts whose checkpoint directory now holds it, verified
    failed: tuple[tuple[str, str], ...]  # (host, why it could not be delivered there)
    skipped: tuple[str, ...] = ()  # places and candidates passed over (also when nothing was chosen)


async def prepare_restore(hosts: Sequence[Place], mirror: Mirror | None,
                          others: Sequence[Place] = ()) -> RestorePlan:
    """Before a start with no survivor: choose the newest valid checkpoint among the hosts'
    (`hosts`, about to run workers, and `others`, reachable hosts of the job that will not
    run one now: the last worker may have left from one of them, for its owner, writing the
    newest checkpoint there) and the mirror's, and deliver it into the checkpoint directory
    of every host in `hosts`, so that whichever becomes rank 0 restores it (`latest_valid()`).

    Without a mirror only the hosts' own copies are candidates.
    """
    chooser = mirror or Mirror(MirrorTarget(TargetKind.DIRECTORY, "/nonexistent"), "-")
    skipped: list[str] = []
    choice = await chooser.choose_restore([*hosts, *others], use_mirror=mirror is not None, skipped=skipped)
    if choice is None:
        return RestorePlan(None, (), (), tuple(skipped))
    if choice.where == MIRROR_LABEL:
        assert mirror is not None
        source = await mirror.place()
    else:
        source = next(h for h in (*hosts, *others) if h.label == choice.where)
    results = await asyncio.gather(*(chooser.deliver(choice, source, h) for h in hosts), return_exceptions=True)
    ready, failed = [], []
    for h, r in zip(hosts, results):
        if isinstance(r, BaseException):
            failed.append((h.label, str(r)))
        else:
            ready.append(h.label)
    return RestorePlan(choice, tuple(ready), tuple(failed))

"""`eltctl checkpoints`: every checkpoint of the job on every host and on the mirror."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from eltctl.errors import HostError
from eltctl.hosts.fleet import Fleet
from eltctl.hosts.transport import Transport
from eltctl.inventory import Host, Inventory
from eltctl.mirror.job import Mirror
from eltctl.mirror.places import host_place, list_place
from eltctl.mirror.values import MIRROR_LABEL, Located, MirrorError


@dataclass(frozen=True)
class CheckpointListing:
    """What `eltctl checkpoints` shows: every checkpoint found, and the places that failed."""

    checkpoints: tuple[Located, ...]
    errors: tuple[tuple[str, str], ...]  # (where, why it could not be listed)
    mirror: str | None  # the target, or None when no mirror is configured

    def as_json(self) -> dict[str, Any]:
        return {"mirror": self.mirror, "checkpoints": [c.as_json() for c in self.checkpoints],
                "errors": [{"where": w, "error": e} for w, e in self.errors]}


async def list_all(inventory: Inventory, *, verify: bool = True, timeout: float | None = None) -> CheckpointListing:
    """The job's checkpoints on every inventory host (over a Fleet) and on the mirror."""
    job = inventory.job.name
    found: list[Located] = []
    errors: list[tuple[str, str]] = []
    mirror = Mirror.from_inventory(inventory)

    async def one_host(_host: Host, t: Transport) -> list[Located]:
        return await list_place(await host_place(t, job), verify=verify)

    async def on_mirror() -> None:
        assert mirror is not None
        try:
            found.extend(await mirror.list_mirrored(verify=verify))
        except (MirrorError, HostError) as exc:
            errors.append((MIRROR_LABEL, str(exc)))
        finally:
            await mirror.close()

    async with Fleet(inventory) as fleet:
        tasks = [fleet.each(None, one_host, timeout=timeout)]
        if mirror is not None:
            tasks.append(on_mirror())
        outcomes = (await asyncio.gather(*tasks))[0]
    for name, outcome in outcomes.items():
        if outcome.ok:
            found.extend(outcome.value or [])
        else:
            errors.append((name, str(outcome.error)))
    order = {h.name: i for i, h in enumerate(inventory.hosts)}
    found.sort(key=lambda c: (-c.step, c.on_mirror, order.get(c.where, 0)))
    return CheckpointListing(tuple(found), tuple(errors), str(mirror.target) if mirror else None)

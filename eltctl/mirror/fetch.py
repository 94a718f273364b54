"""A checkpoint brought to the control machine: `eltctl checkpoints export`.

`fetch_checkpoint` finds the job's newest checkpoint (or a given step) among the
hosts' and the mirror's, streams its directory here as a tar archive over the
connection that reaches it (nothing is written on the host), unpacks it under a
directory of the caller's and verifies every file against its manifest, as a
restore does. A copy that fails to verify is passed over for the next place that
holds the same step, then for older steps (unless a step was asked for), and the
reasons are returned with the choice.
"""

from __future__ import annotations

import asyncio
import shlex
import tarfile
from dataclasses import dataclass
from pathlib import Path

from eltctl.errors import HostError
from eltctl.hosts.fleet import Fleet
from eltctl.inventory import Host, Inventory
from eltctl.mirror.job import Mirror
from eltctl.mirror.places import host_place, list_place
from eltctl.mirror.values import MIRROR_LABEL, Located, MirrorError, Place
from eltctl_runtime.checkpoint import format as ckpt

CHUNK = 1 << 20


@dataclass(frozen=True)
class Fetched:
    """A verified local copy of one checkpoint, where it came from, and what was passed over."""

    step: int
    where: str  # host name or "mirror"
    path: Path  # the local step-NNNNNNNN directory
    skipped: tuple[str, ...] = ()


async def _stream_to_file(place: Place, step: int, out: Path) -> int:
    """`tar -cf -` of the step directory on `place`, written to `out`; the bytes received."""
    name = ckpt.step_dirname(step)
    stream = await place.transport.open_stream(f"tar -cf - -C {shlex.quote(place.directory)} {shlex.quote(name)}")
    total = 0
    try:
        with open(out, "wb") as f:
            while chunk := await stream.read(CHUNK):
                f.write(chunk)
                total += len(chunk)
        status, err = await stream.wait()
    except BaseException:
        stream.kill()
        raise
    if status != 0:
        raise MirrorError(f"reading {place.step_path(step)} on {place.label} failed: {err.strip()[-300:] or status}")
    return total


def _unpack(archive: Path, dest: Path, step: int) -> Path:
    """Extract the archive (regular files and directories only, nothing outside `dest`)
    and verify the step directory against its manifest."""
    with tarfile.open(archive, "r:") as tar:
        tar.extractall(dest, filter="data")
    step_dir = dest / ckpt.step_dirname(step)
    try:
        ckpt.check_dir(step_dir)
    except ckpt.InvalidCheckpoint as e:
        raise MirrorError(f"the copy does not verify: {e}") from e
    return step_dir


async def fetch_checkpoint(inventory: Inventory, dest: Path, *, step: int | None = None,
                           source: str | None = None, timeout: float | None = None) -> Fetched:
    """Bring the newest (or `step`'s) verified checkpoint of the job into `dest`.

    `source` limits the search to one host name or "mirror". Raises MirrorError
    when nothing suitable is found; its message lists what was tried."""
    job = inventory.job.name
    mirror = Mirror.from_inventory(inventory) if source in (None, MIRROR_LABEL) else None
    hosts = [h for h in inventory.hosts if source in (None, h.name)]
    if source not in (None, MIRROR_LABEL) and not hosts:
        raise MirrorError(f"no host named {source!r} in the inventory",
                          hint="give a host name of the inventory, or 'mirror'")
    if source == MIRROR_LABEL and mirror is None:
        raise MirrorError("the inventory has no mirror", hint="set [storage] mirror, or name a host")
    problems: list[str] = []
    found: list[tuple[Located, Place]] = []
    async with Fleet(hosts, ssh=inventory.ssh) as fleet:
        async def one_host(_host: Host, t) -> list[tuple[Located, Place]]:
            place = await host_place(t, job)
            return [(c, place) for c in await list_place(place, verify=False)]

        outcomes = await fleet.each(hosts, one_host, timeout=timeout)
        for name, outcome in outcomes.items():
            if outcome.ok:
                found.extend(outcome.value or [])
            else:
                problems.append(f"{name}: {outcome.error}")
        try:
            if mirror is not None:
                try:
                    place = await mirror.place()
                    found.extend((c, place) for c in await mirror.list_mirrored(verify=False))
                except (MirrorError, HostError) as e:
                    problems.append(f"{MIRROR_LABEL}: {e}")
            if step is not None:
                found = [(c, p) for c, p in found if c.step == step]
            # newest first; for one step, the mirror first (it outlives the hosts), then inventory order
            order = {h.name: i for i, h in enumerate(inventory.hosts)}
            found.sort(key=lambda cp: (-cp[0].step, not cp[0].on_mirror, order.get(cp[0].where, 0)))
            skipped: list[str] = []
            for located, place in found:
                work = dest / f".fetch-{located.where}-{located.step}"
                work.mkdir(parents=True, exist_ok=True)
                archive = work / "checkpoint.tar"
                try:
                    await asyncio.wait_for(_stream_to_file(place, located.step, archive), timeout)
                    path = await asyncio.to_thread(_unpack, archive, work, located.step)
                except (MirrorError, HostError, OSError, tarfile.TarError, asyncio.TimeoutError) as e:
                    skipped.append(f"step {located.step} on {located.where}: {e or type(e).__name__}")
                    continue
                finally:
                    archive.unlink(missing_ok=True)
                return Fetched(located.step, located.where, path, tuple(skipped))
        finally:
            if mirror is not None:
                await mirror.close()
    what = f"step {step}" if step is not None else "a checkpoint"
    where = f" on {source}" if source else ""
    tried = problems + (skipped if found else [])
    raise MirrorError(f"no verified copy of {what} of job {job!r} found{where}"
                      + ("".join(f"\n  {t}" for t in tried)),
                      hint="`eltctl checkpoints` lists what exists and whether it verifies")

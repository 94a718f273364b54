"""Shell on a place: listing, reading and verifying the checkpoints of one directory
(a host's checkpoint directory, or the mirror's job directory) over its transport."""

from __future__ import annotations

import shlex
from dataclasses import replace
from typing import Sequence

from eltctl.hosts import programs
from eltctl.hosts.ops import host_paths
from eltctl.hosts.transport import RunResult, Transport
from eltctl.mirror.decisions import compare_sums
from eltctl.mirror.manifests import manifest_files, parse_listing, parse_sums
from eltctl.mirror.values import Located, MirrorError, Place
from eltctl_runtime.checkpoint import format as ckpt

LIST_TIMEOUT = 60.0
HASH_TIMEOUT = 1800.0
# The copy runs on a training host: at the lowest CPU priority it takes only what
# training leaves idle, so mirroring cannot slow the steps down (the issue's "never
# blocks a training step" also in CPU time).
NICE = "nice -n 19"


def _q(s: str) -> str:
    return shlex.quote(s)


async def run_checked(t: Transport, command: str, what: str, timeout: float) -> RunResult:
    result = await t.run(command, timeout=timeout)
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip() or f"exit {result.exit_status}")
        raise MirrorError(f"{what} on {t.host.name} failed: {detail.splitlines()[-1][:300]}")
    return result


async def list_place(place: Place, *, verify: bool = False) -> list[Located]:
    """The committed checkpoints of one place, newest first; with verify, checksums recomputed there."""
    cmd = (f"cd {_q(place.directory)} 2>/dev/null || exit 0; for d in step-*; do "
           f"[ -d \"$d\" ] || continue; printf '\\n@@ELTCTL@@ %s\\n' \"$d\"; "
           f"cat \"$d/{ckpt.MANIFEST_FILE}\" 2>/dev/null; done; exit 0")
    found = await run_checked(place.transport, cmd, "listing checkpoints", LIST_TIMEOUT)
    listing = parse_listing(found.stdout, place)
    if not verify:
        return listing
    return [await verify_located(place, c) if c.verified is None else c for c in listing]


async def verify_located(place: Place, c: Located) -> Located:
    """`c` with `verified` set: sha256 of every file recomputed where it lies."""
    names = [name for name, _s, _h in c.files]
    cmd = copy_hash_command(place.transport.host.python, None, c.path, names)
    result = await place.transport.run(cmd, timeout=HASH_TIMEOUT)
    problem = compare_sums(c.files, parse_sums(result.stdout))
    if problem is None and not result.ok:
        problem = (result.stderr.strip() or f"sha256sum exit {result.exit_status}").splitlines()[-1]
    return replace(c, verified=problem is None, problem=problem)


async def read_located(place: Place, step: int) -> Located:
    """The manifest of one checkpoint of a place; MirrorError(source_gone) if it is not there."""
    return (await read_manifest(place, step))[0]


async def read_manifest(place: Place, step: int) -> tuple[Located, str]:
    """read_located, and the manifest's text."""
    name = ckpt.step_dirname(step)
    result = await place.transport.run(f"cat {_q(place.step_path(step))}/{ckpt.MANIFEST_FILE}", timeout=LIST_TIMEOUT)
    if not result.ok:
        raise MirrorError(f"checkpoint of step {step} is not on {place.label} any more "
                          f"({(result.stderr.strip() or 'no manifest').splitlines()[-1][:200]})", source_gone=True)
    s, created, files = manifest_files(result.stdout, name)
    return Located(s, place.label, place.step_path(step), created, sum(f[1] for f in files), files), result.stdout


def with_manifest(c: Located, text: str) -> Located:
    """`c` as the manifest text `text` describes it (its files and their hashes); raises
    MirrorError when that text is not a manifest of `c`'s step."""
    step, created, files = manifest_files(text, ckpt.step_dirname(c.step))
    return replace(c, step=step, created=created, size=sum(f[1] for f in files), files=files)


def copy_hash_command(python: str, src: str | None, dst: str, names: Sequence[str]) -> str:
    """Shell: copy src into the new directory dst (src None: only hash dst), fsync the
    files and print `sha256  name` per file; the hashing is the mirror_copy program's
    (`sums`) where the host has Python, else `sha256sum`."""
    quoted = " ".join(map(_q, names))
    copy = f"{NICE} cp -R -- {_q(src)} {_q(dst)} && " if src else ""
    py = f"{NICE} {programs.command(python, 'mirror_copy', 'sums', dst, *names)}"
    plain = f"cd {_q(dst)} && {{ sync -- {quoted} 2>/dev/null; {NICE} sha256sum -- {quoted}; }}"
    return f"{copy}if command -v {_q(python)} >/dev/null 2>&1; then {py}; else {plain}; fi"


async def host_place(t: Transport, job: str) -> Place:
    """A job's checkpoint directory on one host (`layout.HostPaths.checkpoint_dir`)."""
    return Place(t.host.name, t, (await host_paths(t, job)).checkpoint_dir)

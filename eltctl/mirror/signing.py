"""Mirrored manifests carry a MAC: who wrote a checkpoint on shared storage.

The mirror is storage other people reach (an NFS directory, a storage host), so a
checkpoint found there proves nothing by itself: its files match its manifest, but
anyone can write a manifest. When the controller has mirrored a checkpoint and
verified the copy, it writes `manifest.mac` beside the manifest: the hex
HMAC-SHA256, keyed with the job's secret (runtime/auth.py, made at the job's first
`up`), of the job's name and the manifest's text. Restore takes a mirrored
checkpoint only when that MAC verifies (`hmac.compare_digest`); one that fails is
skipped with a problem naming the step and what to do, and the next candidate is
tried, as for a checkpoint whose files do not verify.

Two cases a MAC cannot settle, decided here (docs/checkpoints.md):

- a checkpoint mirrored before this change (no `manifest.mac`), or while the job's
  secret was another (the state directory, so the secret, was removed: a new one is
  made at the next `up`): refused too, unless the inventory says
  `[storage] trust_unsigned = true`, which restores such checkpoints (the MAC is then
  only reported). Set it for the one restore, then remove it: a new checkpoint is
  mirrored with the new secret's MAC.
- a MAC written but the checkpoint published without one (the controller died
  between the two): refused as unsigned; the older checkpoints still restore.

The hosts' own checkpoint directories are not signed: they are private to the job's
account (0700) on machines the job already trusts.
"""

from __future__ import annotations

import hashlib
import hmac
import shlex

from eltctl.mirror.places import LIST_TIMEOUT, read_manifest, run_checked
from eltctl.mirror.values import Located, Place

MAC_FILE = "manifest.mac"
_DOMAIN = b"eltctl-manifest\0"


def manifest_mac(secret: bytes, job: str, manifest_text: str) -> str:
    """The MAC of a manifest's text for `job` (64 hex digits)."""
    msg = _DOMAIN + job.encode() + b"\0" + manifest_text.encode("utf-8")
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def mac_problem(secret: bytes, job: str, manifest_text: str, mac_text: str | None, step: int,
                where: str) -> str | None:
    """Why a mirrored checkpoint is refused (None: its MAC verifies)."""
    if mac_text is None or not mac_text.strip():
        return (f"step {step} on the {where} has no {MAC_FILE}: it was mirrored before eltctl signed "
                "mirrored checkpoints, or written by someone else; to restore it anyway set [storage] "
                "trust_unsigned = true for one `up`, or move it away")
    if not hmac.compare_digest(mac_text.strip().encode(), manifest_mac(secret, job, manifest_text).encode()):
        return (f"step {step} on the {where}: the MAC in {MAC_FILE} does not verify with this job's secret: "
                "someone else wrote it, or the job's state directory (its secret) was removed since it was "
                "mirrored; if you trust the mirror, set [storage] trust_unsigned = true for one `up`; "
                "otherwise move it away")
    return None


async def write_mac(place: Place, step: int, secret: bytes, job: str) -> None:
    """Write `manifest.mac` for the checkpoint of `step` as it now lies at `place`
    (atomically: a temporary file renamed into place)."""
    _located, text = await read_manifest(place, step)
    mac = manifest_mac(secret, job, text)
    directory = place.step_path(step)
    tmp, final = shlex.quote(f"{directory}/.{MAC_FILE}.tmp"), shlex.quote(f"{directory}/{MAC_FILE}")
    await run_checked(place.transport, f"printf '%s\\n' {mac} > {tmp} && mv -- {tmp} {final}",
                      f"signing the manifest of step {step}", LIST_TIMEOUT)


async def read_mac(place: Place, step: int) -> tuple[str, str | None]:
    """(the manifest's text, the text of its `manifest.mac` or None when there is none)."""
    _located, text = await read_manifest(place, step)
    result = await place.transport.run(f"cat {shlex.quote(place.step_path(step) + '/' + MAC_FILE)}",
                                       timeout=LIST_TIMEOUT)
    return text, (result.stdout if result.ok else None)


async def checked(place: Place, c: Located, secret: bytes, job: str) -> str | None:
    """Why the mirrored checkpoint `c` is refused (None: its MAC verifies)."""
    return (await checked_text(place, c, secret, job))[0]


async def checked_text(place: Place, c: Located, secret: bytes, job: str) -> tuple[str | None, str]:
    """(why the mirrored checkpoint `c` is refused or None, the manifest's text checked).
    The manifest is read once: what restore copies is checked against the hashes in
    these bytes (eltctl.mirror.copy), so a manifest swapped after the check is refused."""
    text, mac = await read_mac(place, c.step)
    return mac_problem(secret, job, text, mac, c.step, place.label), text

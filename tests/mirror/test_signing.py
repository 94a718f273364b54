"""Mirrored manifests carry a MAC keyed with the job's secret: restore refuses a
mirrored checkpoint whose MAC is missing or fails, with a message naming the step and
the fix, unless `[storage] trust_unsigned` says to trust it. Real files, the local
transport, no SSH."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest

from eltctl.hosts.local import LocalTransport
from eltctl.inventory import Host
from eltctl.mirror import Mirror, MirrorTarget, Place, TargetKind
from eltctl.mirror.values import MirrorError
from eltctl.mirror.signing import MAC_FILE, mac_problem, manifest_mac
from eltctl_runtime.checkpoint import format as ckpt
from tests.mirror.test_copy import commit

JOB = "signed"
SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))


def transport(label: str) -> LocalTransport:
    return LocalTransport(Host(name=label, address="local", python=sys.executable), default_timeout=60)


def mirror_of(root: Path, secret: bytes | None, trust: bool = False) -> Mirror:
    async def connect():
        return transport("mirror")

    return Mirror(MirrorTarget(TargetKind.DIRECTORY, str(root)), JOB, keep=5, connector=connect, secret=secret,
                  trust_unsigned=trust)


def test_the_mac_binds_the_job_and_the_manifest():
    mac = manifest_mac(SECRET, JOB, '{"step": 1}')
    assert len(mac) == 64 and mac != manifest_mac(OTHER, JOB, '{"step": 1}')
    assert mac != manifest_mac(SECRET, "other-job", '{"step": 1}') != manifest_mac(SECRET, JOB, '{"step": 2}')
    assert mac_problem(SECRET, JOB, '{"step": 1}', mac + "\n", 1, "mirror") is None
    assert "no manifest.mac" in mac_problem(SECRET, JOB, "{}", None, 1, "mirror")
    assert "does not verify" in mac_problem(SECRET, JOB, "{}", mac, 1, "mirror")


def test_restore_refuses_a_mirrored_checkpoint_whose_mac_fails(tmp_path):
    host_dir, root = tmp_path / "host", tmp_path / "mirror"
    host = Place("h1", transport("h1"), str(host_dir))
    mirror = mirror_of(root, SECRET)
    commit(host_dir, 5, b"five")
    asyncio.run(mirror.mirror_checkpoint(host, 5))
    mirrored = root / JOB / ckpt.step_dirname(5)
    assert (mirrored / MAC_FILE).read_text().strip() == manifest_mac(
        SECRET, JOB, (mirrored / ckpt.MANIFEST_FILE).read_text())
    shutil.rmtree(host_dir)  # the hosts lost theirs: only the mirror can restore

    # someone who can write the mirror directory adds newer checkpoints: one with a MAC
    # made without the secret, one with none (as an eltctl before signing mirrored them)
    commit(root / JOB, 9, b"weights of someone else")
    (root / JOB / ckpt.step_dirname(9) / MAC_FILE).write_text("0" * 64 + "\n")
    commit(root / JOB, 7, b"seven")

    choice = asyncio.run(mirror.choose_restore([host]))
    assert (choice.step, choice.where) == (5, "mirror")
    refused = [s for s in choice.skipped if s.startswith("step ")]
    assert len(refused) == 2
    assert "step 9 on the mirror" in refused[0] and "does not verify with this job's secret" in refused[0]
    assert "step 7 on the mirror has no manifest.mac" in refused[1] and "trust_unsigned" in refused[1]


def test_a_lost_secret_refuses_all_unless_trusted_explicitly(tmp_path):
    host_dir, root = tmp_path / "host", tmp_path / "mirror"
    host = Place("h1", transport("h1"), str(host_dir))
    commit(host_dir, 3, b"three")
    asyncio.run(mirror_of(root, SECRET).mirror_checkpoint(host, 3))
    shutil.rmtree(host_dir)
    # the state directory was removed: the next `up` made a new secret
    assert asyncio.run(mirror_of(root, OTHER).choose_restore([host])) is None
    trusted = asyncio.run(mirror_of(root, OTHER, trust=True).choose_restore([host]))
    assert (trusted.step, trusted.where) == (3, "mirror")


def test_a_checkpoint_swapped_after_its_mac_was_checked_is_never_restored(tmp_path):
    """The manifest is read once: its MAC is checked on those bytes, and what is copied
    is checked against the hashes in THOSE bytes, not in a second read of the file."""
    host_dir, root = tmp_path / "host", tmp_path / "mirror"
    host = Place("h1", transport("h1"), str(host_dir))
    mirror = mirror_of(root, SECRET)
    commit(host_dir, 5, b"five")
    asyncio.run(mirror.mirror_checkpoint(host, 5))
    shutil.rmtree(host_dir)  # only the mirror can restore
    mirrored = root / JOB / ckpt.step_dirname(5)
    commit(tmp_path / "evil", 5, b"weights of someone else")
    evil = tmp_path / "evil" / ckpt.step_dirname(5)

    async def restore():
        choice = await mirror.choose_restore([host])
        assert (choice.step, choice.where) == (5, "mirror")
        # between the MAC check and the copy, someone who can write the mirror swaps the
        # checkpoint: other weights, and a manifest whose hashes match them
        for name in (ckpt.STATE_FILE, ckpt.MANIFEST_FILE):
            shutil.copy(evil / name, mirrored / name)
        return await mirror.deliver(choice, await mirror.place(), host)

    with pytest.raises(MirrorError, match="does not verify|differs"):
        asyncio.run(restore())
    assert not (host_dir / ckpt.step_dirname(5)).exists()

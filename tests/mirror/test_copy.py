"""One checkpoint copied between places on this machine, through nothing but the
`Transport` contract: the relay path (neither side shared) streams `tar` through
`open_stream`, the shared path runs the mirror_copy program once. No SSH, no torch."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from eltctl.hosts.local import LocalTransport
from eltctl.inventory import Host
from eltctl.mirror import MirrorError, Place, copy_checkpoint, list_place
from eltctl_runtime.checkpoint import format as ckpt


class ContractOnly:
    """A transport that has exactly what `Transport` names, nothing to reach past."""

    def __init__(self, inner: LocalTransport) -> None:
        self.host = inner.host
        self._inner = inner
        self.streams = 0

    async def run(self, command, *, timeout=None, input=None):
        return await self._inner.run(command, timeout=timeout, input=input)

    async def open_stream(self, command):
        self.streams += 1
        return await self._inner.open_stream(command)

    def local_address(self):
        return None

    async def close(self):
        await self._inner.close()


def commit(directory: Path, step: int, data: bytes) -> None:
    """A committed checkpoint as the runtime writes it (the manifest by hand)."""
    d = directory / ckpt.step_dirname(step)
    d.mkdir(parents=True)
    (d / ckpt.STATE_FILE).write_bytes(data)
    manifest = {"format": ckpt.FORMAT, "version": ckpt.FORMAT_VERSION, "step": step, "created": 1.5,
                "files": {ckpt.STATE_FILE: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
    (d / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest))


def place(label: str, directory: Path, *, shared: bool = False) -> Place:
    host = Host(name=label, address="local", python=sys.executable)
    return Place(label, ContractOnly(LocalTransport(host, default_timeout=60)), str(directory), shared=shared)


@pytest.mark.parametrize("shared", [False, True], ids=["relay", "shared-directory"])
def test_a_checkpoint_is_copied_verified_and_published(tmp_path, shared):
    data = os.urandom(3 * (1 << 20) + 17)  # more than one relay chunk
    commit(tmp_path / "host", 7, data)
    src, dst = place("h1", tmp_path / "host"), place("mirror", tmp_path / "mirror", shared=shared)

    copied = asyncio.run(copy_checkpoint(src, 7, dst))

    assert copied.verified and copied.where == "mirror" and copied.path == dst.step_path(7)
    assert (Path(dst.step_path(7)) / ckpt.STATE_FILE).read_bytes() == data
    assert dst.transport.streams == (0 if shared else 1) and src.transport.streams == (0 if shared else 1)
    assert [p.name for p in (tmp_path / "mirror").iterdir()] == [ckpt.step_dirname(7)]  # no .tmp-* left
    listed = asyncio.run(list_place(dst, verify=True))
    assert [(c.step, c.verified) for c in listed] == [(7, True)]


def test_a_vanished_source_is_reported_as_gone(tmp_path):
    src, dst = place("h1", tmp_path / "host"), place("mirror", tmp_path / "mirror")
    with pytest.raises(MirrorError) as err:
        asyncio.run(copy_checkpoint(src, 7, dst))
    assert err.value.source_gone

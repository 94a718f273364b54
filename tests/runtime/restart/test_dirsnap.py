"""Restart mode's snapshots as tars (runtime/dirsnap.py): a crafted tar is refused
whole, with or without the stdlib's `tarfile.data_filter` (its absence is the code
path chosen by the `data_filter` argument), and a sound one round-trips."""

from __future__ import annotations

import io
import os
import stat
import tarfile

import pytest

from eltctl_runtime.restart.snapshots import UnsafeSnapshot, pack_dir, unpack_dir

FILTERS = pytest.mark.parametrize("data_filter", [None, getattr(tarfile, "data_filter", None)],
                                  ids=["without-data_filter", "with-data_filter"])


def tar_of(*members: tuple[str, str, str | bytes]) -> bytes:
    """(kind, name, content or link target) -> an uncompressed tar; kind: file, dir, sym, hard, chr, fifo."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for kind, name, body in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                data = body if isinstance(body, bytes) else body.encode()
                ti.size = len(data)
                ti.mode = 0o4777  # setuid and world-writable: cleaned on the way in
                tar.addfile(ti, io.BytesIO(data))
                continue
            ti.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE,
                       "chr": tarfile.CHRTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            if kind in ("sym", "hard"):
                ti.linkname = body
            tar.addfile(ti)
    return buf.getvalue()


@FILTERS
@pytest.mark.parametrize("members, bad, why", [
    ([("file", "/tmp/eltctl-evil", "x")], "/tmp/eltctl-evil", "absolute path"),
    ([("file", "../evil", "x")], "../evil", "'..'"),
    ([("file", "ok/../../evil", "x")], "ok/../../evil", "'..'"),
    ([("sym", "out", "/etc")], "out", "absolute path"),
    ([("dir", "d", ""), ("sym", "d/up", "../../..")], "d/up", "outside"),
    ([("sym", "inside", "sub"), ("file", "inside/x", "x")], "inside/x", "under the link"),
    ([("hard", "h", "../../etc/passwd")], "h", "outside"),
    ([("chr", "dev", "")], "dev", "device"),
    ([("fifo", "pipe", "")], "pipe", "FIFO"),
    ([("sym", "here", "."), ("sym", "up", "here/..")], "up", "outside"),  # lexically inside, really its parent
    ([("sym", "up", "here/.."), ("sym", "here", "."), ("file", "last", "x")], "up", "outside"),  # either order
    ([("sym", "loop", "loop2"), ("sym", "loop2", "loop")], "loop", "outside"),  # never resolves
    ([("sym", "esc", ".."), ("hard", "h", "esc/passwd")], "esc", "outside"),
])
def test_a_crafted_snapshot_is_refused_whole(tmp_path, data_filter, members, bad, why):
    dst = tmp_path / "box" / "script"
    dst.mkdir(parents=True)
    (dst / "ckpt.pt").write_text("mine")
    data = tar_of(("file", "first.pt", "fine"), *members)
    with pytest.raises(UnsafeSnapshot, match="refusing to unpack") as err:
        unpack_dir(data, dst, data_filter=data_filter)
    assert why in str(err.value) and f"holds {bad!r}" in str(err.value), str(err.value)
    assert sorted(p.name for p in (tmp_path / "box").iterdir()) == ["script"]  # nothing extracted beside it
    assert [p.name for p in dst.iterdir()] == ["ckpt.pt"] and (dst / "ckpt.pt").read_text() == "mine"
    assert not (tmp_path / "evil").exists()


@FILTERS
def test_a_snapshot_that_is_not_a_tar_is_refused(tmp_path, data_filter):
    with pytest.raises(UnsafeSnapshot, match="not a readable tar"):
        unpack_dir(b"\x00garbage" * 200, tmp_path / "d", data_filter=data_filter)


@FILTERS
def test_a_sound_snapshot_round_trips_with_its_links_and_clean_modes(tmp_path, data_filter):
    data = tar_of(("dir", "sub", ""), ("file", "sub/a.pt", b"\x00\x01" * 10), ("sym", "latest", "sub/a.pt"),
                  ("sym", "sub/same", "./a.pt"), ("hard", "b.pt", "sub/a.pt"))
    dst = tmp_path / "d"
    unpack_dir(data, dst, data_filter=data_filter)
    assert (dst / "latest").read_bytes() == (dst / "b.pt").read_bytes() == b"\x00\x01" * 10
    assert os.readlink(dst / "sub" / "same") == "./a.pt"
    mode = stat.S_IMODE((dst / "sub" / "a.pt").stat().st_mode)
    assert not mode & (stat.S_ISUID | stat.S_IWGRP | stat.S_IWOTH), oct(mode)
    again = tmp_path / "again"
    unpack_dir(pack_dir(dst), again, data_filter=data_filter)
    assert sorted(str(p.relative_to(again)) for p in again.rglob("*")) == [
        "b.pt", "latest", "sub", "sub/a.pt", "sub/same"]

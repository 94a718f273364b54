"""eltctl/hosts/programs/mirror_copy.py, run as the hosts run it (`python -c <source> ...`), on real files.

- copy: the files land, verified against the SOURCE manifest's sums, under the final
  name; no `.tmp-*` is left;
- a valid copy already there is kept (not rewritten), an invalid one replaced;
- a source that rotted after its commit: exit 4, nothing published, the copy of that
  step already on the mirror untouched, the temporary directory gone;
- a source gone: exit 3, `source_gone`;
- publish: a directory filled by someone else is hashed, checked and renamed;
- the hashing pipeline gives hashlib's digest for empty, small and multi-chunk files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eltctl.hosts.programs import mirror_copy

SOURCE = Path(mirror_copy.__file__).read_text(encoding="utf-8")
STEP = "step-00000007"


def make_source(root: Path, files: dict[str, bytes]) -> tuple[Path, dict]:
    src = root / "host" / STEP
    src.mkdir(parents=True)
    entries = {}
    for name, data in files.items():
        (src / name).write_bytes(data)
        entries[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = json.dumps({"step": 7, "files": entries}).encode()
    (src / "manifest.json").write_bytes(manifest)
    expected = {"files": [[n, e["size"], e["sha256"]] for n, e in sorted(entries.items())],
                "manifest_name": "manifest.json", "manifest": hashlib.sha256(manifest).hexdigest()}
    return src, expected


def run(mode: str, src: Path | str, parent: Path, expected: dict, tmp: str = ".tmp-x-mirror-1"):
    r = subprocess.run([sys.executable, "-c", SOURCE, mode, str(src), str(parent), STEP, tmp, json.dumps(expected)],
                       capture_output=True, text=True, timeout=60)
    out = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
    return r.returncode, out, r.stderr


FILES = {"state.pt": os.urandom(3 * mirror_copy.CHUNK + 123), "extra.bin": b"", "small": b"abc"}


def test_copy_publishes_a_verified_copy_and_leaves_no_temporary(tmp_path):
    src, expected = make_source(tmp_path, FILES)
    parent = tmp_path / "mirror" / "job"
    code, out, err = run("copy", src, parent, expected)
    assert code == 0, err
    assert out["ok"] and not out["kept"]
    assert out["bytes"] == sum(map(len, FILES.values())) + (src / "manifest.json").stat().st_size
    assert sorted(os.listdir(parent)) == [STEP]
    for name, data in FILES.items():
        assert (parent / STEP / name).read_bytes() == data
        assert out["sums"][name] == hashlib.sha256(data).hexdigest()


def test_a_valid_copy_is_kept_and_an_invalid_one_replaced(tmp_path):
    src, expected = make_source(tmp_path, FILES)
    parent = tmp_path / "m"
    assert run("copy", src, parent, expected)[0] == 0
    inode = (parent / STEP / "state.pt").stat().st_ino
    code, out, _ = run("copy", src, parent, expected, tmp=".tmp-x-mirror-2")
    assert code == 0 and out["kept"]
    assert (parent / STEP / "state.pt").stat().st_ino == inode  # not rewritten
    (parent / STEP / "small").write_bytes(b"abd")  # the mirror's copy rots
    code, out, _ = run("copy", src, parent, expected, tmp=".tmp-x-mirror-3")
    assert code == 0 and not out["kept"]
    assert (parent / STEP / "small").read_bytes() == b"abc"
    assert sorted(os.listdir(parent)) == [STEP]
    (parent / STEP / "state.pt").unlink()  # a file of the mirror's copy lost
    code, out, _ = run("copy", src, parent, expected, tmp=".tmp-x-mirror-5")
    assert code == 0 and not out["kept"]
    assert (parent / STEP / "state.pt").read_bytes() == FILES["state.pt"]
    assert sorted(os.listdir(parent)) == [STEP]


def test_a_rotten_source_is_refused_and_the_last_good_copy_stays(tmp_path):
    src, expected = make_source(tmp_path, FILES)
    parent = tmp_path / "m"
    assert run("copy", src, parent, expected)[0] == 0
    (parent / STEP / "small").write_bytes(b"abd")  # make the mirror copy need replacing ...
    good = (parent / STEP / "state.pt").read_bytes()
    data = bytearray(FILES["state.pt"])
    data[len(data) // 2] ^= 0xFF  # ... and the source rotted after its commit
    (src / "state.pt").write_bytes(bytes(data))
    code, out, _ = run("copy", src, parent, expected, tmp=".tmp-x-mirror-4")
    assert code == 4 and not out["ok"]
    assert "state.pt sha256" in out["problem"]
    assert sorted(os.listdir(parent)) == [STEP]  # no temporary left, the old copy not removed
    assert (parent / STEP / "state.pt").read_bytes() == good


def test_a_changed_manifest_is_refused(tmp_path):
    src, expected = make_source(tmp_path, FILES)
    (src / "manifest.json").write_bytes((src / "manifest.json").read_bytes() + b" ")
    code, out, _ = run("copy", src, tmp_path / "m", expected)
    assert code == 4 and "manifest.json of the copy differs" in out["problem"]
    assert os.listdir(tmp_path / "m") == []


def test_a_source_gone_is_reported_as_such(tmp_path):
    src, expected = make_source(tmp_path, FILES)
    code, out, _ = run("copy", tmp_path / "nowhere", tmp_path / "m", expected)
    assert code == 3 and out["source_gone"]
    os.remove(src / "small")
    code, out, _ = run("copy", src, tmp_path / "m", expected)
    assert code == 3 and out["source_gone"] and "small" in out["problem"]
    assert os.listdir(tmp_path / "m") == []


def test_publish_checks_and_renames_a_filled_directory(tmp_path):
    src, expected = make_source(tmp_path, FILES)
    parent = tmp_path / "m"
    tmp = parent / ".tmp-relay"
    tmp.mkdir(parents=True)
    for p in src.iterdir():
        (tmp / p.name).write_bytes(p.read_bytes())
    code, out, err = run("publish", "-", parent, expected, tmp=".tmp-relay")
    assert code == 0, err
    assert sorted(os.listdir(parent)) == [STEP]
    tmp.mkdir()
    (tmp / "small").write_bytes(b"abc")  # a truncated relay: files missing
    code, out, _ = run("publish", "-", parent, expected, tmp=".tmp-relay")
    assert code == 4 and "missing" in out["problem"]
    assert sorted(os.listdir(parent)) == [STEP]


def test_bad_names_are_refused(tmp_path):
    r = subprocess.run([sys.executable, "-c", SOURCE, "copy", "/x", str(tmp_path), STEP, "../evil", "{}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "bad names" in r.stderr


@pytest.mark.parametrize("size", [0, 1, mirror_copy.CHUNK - 1, mirror_copy.CHUNK, 5 * mirror_copy.CHUNK + 7])
def test_hash_pipeline_matches_hashlib(tmp_path, size):
    data = os.urandom(size)
    p = tmp_path / "f"
    p.write_bytes(data)
    assert mirror_copy.hash_file(str(p)) == (hashlib.sha256(data).hexdigest(), size)
    digest, total = mirror_copy.copy_file(str(p), str(tmp_path / "g"))
    assert (digest, total) == (hashlib.sha256(data).hexdigest(), size)
    assert (tmp_path / "g").read_bytes() == data


def test_sums_prints_sha256sum_lines_and_leaves_out_what_is_missing(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "b").write_bytes(b"")
    r = subprocess.run([sys.executable, "-c", SOURCE, "sums", str(tmp_path), "a", "b", "gone"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{hashlib.sha256(b'abc').hexdigest()}  a",
                                     f"{hashlib.sha256(b'').hexdigest()}  b"]


def test_an_os_error_is_answered_with_its_errno_not_a_traceback(tmp_path):
    # The controller sorts failures by errno: a mirror path that is not a directory
    # (an unmounted share replaced by a file) is permanent, not worth retrying.
    src, expected = make_source(tmp_path, FILES)
    (tmp_path / "mirror").write_text("not a directory\n")
    code, out, err = run("copy", src, tmp_path / "mirror" / "job", expected)
    assert code == 5 and out is not None, err
    assert out["ok"] is False and out["errno"] == "ENOTDIR" and "NotADirectoryError" in out["problem"]
    assert "Traceback" not in err


def probe(parent: Path, tmp: str = ".tmp-check-h1", user: str | None = None):
    argv = [sys.executable, "-c", SOURCE, "probe", str(parent), tmp]
    if user is not None:
        import pwd
        entry = pwd.getpwnam(user)
        argv = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups", *argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_probe_leaves_a_written_and_renamed_file_for_the_controller(tmp_path):
    code, out, err = probe(tmp_path)
    assert code == 0 and out["ok"], err
    assert (tmp_path / ".tmp-check-h1" / "probe").read_bytes() == b"eltctl mirror probe\n"
    assert not (tmp_path / ".tmp-check-h1" / ".probe").exists()
    assert out["uid"] == os.getuid() and out["user"]


def test_in_a_group_shared_mirror_what_is_made_is_group_writable(tmp_path):
    shared = tmp_path / "job"
    shared.mkdir()
    shared.chmod(0o2770)
    assert probe(shared)[0] == 0
    made = shared / ".tmp-check-h1"
    assert made.stat().st_mode & 0o7777 == 0o2770
    assert (made / "probe").stat().st_mode & 0o777 == 0o660
    src, expected = make_source(tmp_path, FILES)
    code, out, err = run("copy", src, shared, expected)
    assert code == 0, err
    assert (shared / STEP).stat().st_mode & 0o2070 == 0o2070
    assert all((shared / STEP / n).stat().st_mode & 0o060 == 0o060 for n in FILES)


@pytest.mark.skipif(os.geteuid() != 0, reason="running as another account needs root")
def test_probe_as_an_account_that_cannot_write_says_eacces(tmp_path):
    from tests.testbed.procs import FOREIGN_USER, ensure_foreign_user

    if ensure_foreign_user() is None:
        pytest.skip("no foreign user")
    tmp_path.chmod(0o755)
    private = tmp_path / "job"
    private.mkdir(mode=0o700)  # the controller's own, as `claim_job_dir` made it before
    code, out, _err = probe(private, user=FOREIGN_USER)
    assert code == 5 and out["errno"] == "EACCES" and out["user"] == FOREIGN_USER

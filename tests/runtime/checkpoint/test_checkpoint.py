"""Checkpoints on real files: commit, retention, restore past damage, write failures, the async writer."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from eltctl_runtime.checkpoint.format import CheckpointError, CheckpointInfo, InvalidCheckpoint, expired_steps, parse_step_dirname, step_dirname, tmp_owner_pid, verify_dir
from eltctl_runtime.checkpoint.store import CheckpointStore, snapshot
from runtime_cluster import flip_middle_byte

LONG = 120.0  # generous bound on any wait; nothing here asserts on timing


def small_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "step": step, "tag": f"s{step}", "blob": b"\x00\x01"}


def big_state(nbytes: int) -> dict:
    return {"w": torch.ones(nbytes // 4, dtype=torch.float32)}


def dir_names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# ---------------------------------------------------------------------------
# Pure decisions


@pytest.mark.parametrize(
    "steps, keep, expired",
    [
        ([], 3, []),
        ([10], 1, []),
        ([10, 20, 30], 3, []),
        ([10, 20, 30, 40], 3, [10]),
        ([40, 10, 30, 20, 50], 2, [10, 20, 30]),
        ([5, 5, 7], 1, [5]),
    ],
)
def test_retention_keeps_the_highest_steps(steps, keep, expired):
    assert expired_steps(steps, keep) == expired


def test_retention_refuses_keep_zero():
    with pytest.raises(ValueError):
        expired_steps([1, 2], 0)


@pytest.mark.parametrize(
    "name, step",
    [
        ("step-00001234", 1234),
        ("step-123456789", 123456789),
        (step_dirname(7), 7),
        (".tmp-step-00000007-12-abc", None),
        ("step-", None),
        ("step-12a", None),
        ("manifest.json", None),
    ],
)
def test_step_directory_names(name, step):
    assert parse_step_dirname(name) == step


@pytest.mark.parametrize(
    "name, pid",
    [
        (".tmp-step-00000007-4242-0123456789ab", 4242),
        (".tmp-expired-step-00000003-17-abcdef012345", 17),
        (".tmp-something", None),
    ],
)
def test_temp_directory_owner(name, pid):
    assert tmp_owner_pid(name) == pid


def test_snapshot_refuses_what_weights_only_load_cannot_read():
    with pytest.raises(TypeError, match=r"state\['opt'\]\[0\] is a object"):
        snapshot({"opt": [object()]})
    with pytest.raises(TypeError, match="dict key"):
        snapshot({(1, 2): torch.zeros(1)})


# ---------------------------------------------------------------------------
# Round trip and layout


def test_model_and_optimizer_round_trip_through_weights_only_load(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "sampler": {"epoch": 2, "cursor": 1234},
        "shape": torch.Size([2, 3]),
        "dtype": torch.float16,
        "pair": (1, 2.5),
        "raw": b"bytes",
        "none": None,
    }
    store = CheckpointStore(tmp_path / "ckpt", keep=2)
    info = store.save(42, state)

    assert info.step == 42
    assert info.path == tmp_path / "ckpt" / "step-00000042"
    assert dir_names(info.path) == ["manifest.json", "state.pt"]
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert manifest["format"] == "eltctl-checkpoint" and manifest["version"] == 1
    assert manifest["step"] == 42 and manifest["created"] == info.created
    assert manifest["files"]["state.pt"] == {"size": info.size, "sha256": info.sha256}
    assert info.size == (info.path / "state.pt").stat().st_size

    assert store.list() == [info]
    assert store.verify(info)
    got_info, got = store.latest_valid()
    assert got_info == info
    assert got["sampler"] == {"epoch": 2, "cursor": 1234}
    assert got["shape"] == torch.Size([2, 3]) and got["dtype"] is torch.float16
    assert got["pair"] == (1, 2.5) and got["raw"] == b"bytes" and got["none"] is None
    for k, v in model.state_dict().items():
        assert torch.equal(got["model"][k], v)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(got["opt"])  # a real optimizer accepts it back
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])


def test_empty_or_missing_directory_has_no_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path / "never-created")
    assert store.list() == []
    assert store.latest_valid() is None
    assert not (tmp_path / "never-created").exists()  # reading creates nothing


def test_snapshot_is_the_state_at_the_call_not_at_the_write(tmp_path):
    w = torch.zeros(1000)
    with CheckpointStore(tmp_path) as store:
        store.save_async(1, {"w": w})
        w.add_(1.0)  # the next training step mutates parameters in place
        assert store.wait(LONG)
    _, got = store.latest_valid()
    assert torch.equal(got["w"], torch.zeros(1000))


def test_the_newest_k_are_kept(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        store.save(step, small_state(step))
    assert [i.step for i in store.list()] == [40, 30]
    assert dir_names(tmp_path) == ["step-00000030", "step-00000040"]


def test_saving_a_step_again_replaces_it(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(5, {"v": torch.tensor([1.0])})
    second = store.save(5, {"v": torch.tensor([2.0])})
    assert store.list() == [second]
    assert dir_names(tmp_path) == ["step-00000005"]
    _, got = store.latest_valid()
    assert got["v"].item() == 2.0


# ---------------------------------------------------------------------------
# Restore falls back past damaged checkpoints


def _three_checkpoints(tmp_path: Path) -> tuple[CheckpointStore, list[CheckpointInfo]]:
    store = CheckpointStore(tmp_path, keep=3)
    infos = [store.save(step, small_state(step)) for step in (100, 200, 300)]
    return store, infos


def test_truncated_newest_is_skipped_for_the_previous(tmp_path, caplog):
    store, infos = _three_checkpoints(tmp_path)
    newest = infos[-1]
    os.truncate(newest.state_file, newest.size // 2)

    assert not store.verify(newest)
    assert verify_dir(newest.path) is None
    with caplog.at_level(logging.WARNING, logger="eltctl_runtime.checkpoint"):
        info, state = store.latest_valid()
    assert info.step == 200 and state["step"] == 200
    assert "step 300" in caplog.text and "truncated" in caplog.text


def test_one_flipped_byte_in_the_newest_is_skipped_for_the_previous(tmp_path, caplog):
    store, infos = _three_checkpoints(tmp_path)
    newest = infos[-1]
    with open(newest.state_file, "r+b") as f:
        f.seek(newest.size // 2)
        b = f.read(1)
        f.seek(newest.size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    assert newest.state_file.stat().st_size == newest.size  # same size: only the hash can tell

    assert not store.verify(newest)
    with caplog.at_level(logging.WARNING, logger="eltctl_runtime.checkpoint"):
        info, state = store.latest_valid()
    assert info.step == 200
    assert torch.equal(state["w"], small_state(200)["w"])
    assert "sha256" in caplog.text


def test_a_restore_takes_the_newest_up_while_hashing_it_and_a_flipped_byte_fails_its_confirm(tmp_path, caplog):
    """latest_for_restore (the job's restore) loads the newest checkpoint while its files
    are hashed: the state comes back with a check to confirm before it is used. A flipped
    byte (same size: only the hash can tell) loads, then fails confirm() naming the file;
    latest_valid, asked then, checks first and gives the one before."""
    store, infos = _three_checkpoints(tmp_path)
    info, state, check = store.latest_for_restore()
    assert info.step == 300 and state["step"] == 300 and check is not None
    check.confirm()  # intact: no error

    flip_middle_byte(infos[-1].state_file)
    info, state, check = store.latest_for_restore()
    assert info.step == 300 and check is not None  # taken up before the hashes are known
    with pytest.raises(InvalidCheckpoint, match=r"state\.pt sha256"):
        check.confirm()
    with caplog.at_level(logging.WARNING, logger="eltctl_runtime.checkpoint"):
        info, state = store.latest_valid()
    assert info.step == 200 and torch.equal(state["w"], small_state(200)["w"])
    assert "step 300" in caplog.text and "sha256" in caplog.text


def test_a_restore_checks_first_where_nothing_older_is_there_or_the_newest_is_truncated(tmp_path):
    """With no older checkpoint to fall back on, the only one is checked before it is
    loaded (a damaged one must not reach the model: None, as latest_valid); a newest of
    the wrong size is skipped at once, without being loaded."""
    store = CheckpointStore(tmp_path / "one", keep=3)
    only = store.save(100, small_state(100))
    info, state, check = store.latest_for_restore()
    assert info.step == 100 and check is None
    flip_middle_byte(only.state_file)
    assert store.latest_for_restore() is None

    store, infos = _three_checkpoints(tmp_path / "three")
    os.truncate(infos[-1].state_file, infos[-1].size // 2)
    info, state, check = store.latest_for_restore()
    assert info.step == 200 and state["step"] == 200 and check is None  # checked before loading


def test_a_checkpoint_of_several_files_is_hashed_file_by_file_and_names_the_bad_one(tmp_path):
    """check_dir hashes a checkpoint's files side by side (a sharded one has state.pt and a
    shard file per chunk): each file is still checked against its own manifest entry, and
    the one that differs is named; one that cannot be read is an invalid checkpoint too."""
    from eltctl_runtime.checkpoint.format import FORMAT, FORMAT_VERSION, InvalidCheckpoint, check_dir

    def manifest() -> None:
        (d / "manifest.json").write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "step": 7,
                                                     "created": 1.0, "files": files}))

    d = tmp_path / "step-7"
    d.mkdir()
    payloads = {f"part-{i}.bin": os.urandom(3 << 20) for i in range(5)}
    for name, data in payloads.items():
        (d / name).write_bytes(data)
    files = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in payloads.items()}
    files["state.pt"] = files["part-0.bin"]
    (d / "state.pt").write_bytes(payloads["part-0.bin"])
    manifest()
    assert check_dir(d).step == 7
    with open(d / "part-3.bin", "r+b") as f:  # same size: only its hash tells
        f.seek(1 << 20)
        f.write(bytes([payloads["part-3.bin"][1 << 20] ^ 1]))
    with pytest.raises(InvalidCheckpoint, match=r"part-3\.bin sha256 .* differs"):
        check_dir(d)
    (d / "part-3.bin").write_bytes(payloads["part-3.bin"])
    assert check_dir(d).step == 7
    (d / "part-2.bin").unlink()
    (d / "part-2.bin").mkdir()  # there, of the listed size, but not readable as a file
    files["part-2.bin"]["size"] = (d / "part-2.bin").stat().st_size
    manifest()
    with pytest.raises(InvalidCheckpoint, match=r"part-2\.bin cannot be read"):
        check_dir(d)


def test_two_damaged_newest_fall_back_to_the_oldest(tmp_path):
    store, infos = _three_checkpoints(tmp_path)
    (infos[2].path / "manifest.json").write_text("{not json")
    (infos[1].path / "state.pt").unlink()
    info, state = store.latest_valid()
    assert info.step == 100 and state["tag"] == "s100"


def test_a_payload_that_hashes_right_but_does_not_load_is_skipped(tmp_path):
    # A writer bug or a foreign file: the manifest matches, torch.load refuses.
    store, infos = _three_checkpoints(tmp_path)
    newest = infos[-1]
    newest.state_file.write_bytes(b"this is not a torch file")
    m = json.loads((newest.path / "manifest.json").read_text())
    m["files"]["state.pt"] = {"size": 24, "sha256": hashlib.sha256(b"this is not a torch file").hexdigest()}
    (newest.path / "manifest.json").write_text(json.dumps(m))
    assert verify_dir(newest.path) is not None
    info, _ = store.latest_valid()
    assert info.step == 200


def test_leftover_temp_directories_are_ignored_then_removed(tmp_path):
    store = CheckpointStore(tmp_path)
    good = store.save(1, small_state(1))
    # A crashed writer's leftover that even looks complete, from a process now gone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = tmp_path / f".tmp-step-00000002-{dead.pid}-0123456789ab"
    shutil.copytree(good.path, leftover)
    # A live writer's temp directory (another process) must be left alone.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        busy = tmp_path / f".tmp-step-00000003-{live.pid}-0123456789ab"
        busy.mkdir()

        assert [i.step for i in store.list()] == [1]
        info, _ = store.latest_valid()
        assert info == good
        assert not leftover.exists()
        assert busy.exists()
        store.save(4, small_state(4))
        assert busy.exists()
        assert dir_names(tmp_path) == [busy.name, "step-00000001", "step-00000004"]
    finally:
        live.kill()
        live.wait()


def test_a_copied_directory_verifies_on_its_own(tmp_path):
    store = CheckpointStore(tmp_path / "local")
    info = store.save(7, small_state(7))
    mirror = tmp_path / "shared" / info.path.name
    shutil.copytree(info.path, mirror)
    copied = verify_dir(mirror)
    assert copied == CheckpointInfo(7, mirror, info.created, info.size, info.sha256)
    with open(mirror / "state.pt", "ab") as f:
        f.write(b"x")
    assert verify_dir(mirror) is None


def test_a_directory_renamed_to_another_step_is_rejected(tmp_path):
    store = CheckpointStore(tmp_path)
    info = store.save(7, small_state(7))
    os.rename(info.path, tmp_path / "step-00000009")
    assert verify_dir(tmp_path / "step-00000009") is None
    assert store.list() == []


# ---------------------------------------------------------------------------
# Write failures never harm the last good checkpoint


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs, so that a bigger checkpoint hits a real ENOSPC mid-write."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_keeps_the_last_good_checkpoint_and_training_goes_on(tiny_tmpfs, caplog):
    store = CheckpointStore(tiny_tmpfs / "ckpt", keep=1)
    good = store.save(1, big_state(300_000))

    with caplog.at_level(logging.ERROR, logger="eltctl_runtime.checkpoint"):
        store.save_async(2, big_state(2_000_000))  # the caller is not told by an exception
        assert store.wait(LONG)
    assert store.last_error is not None and "step 2" in store.last_error
    assert "No space left" in store.last_error
    assert "No space left" in caplog.text
    assert store.failures == 1
    assert dir_names(tiny_tmpfs / "ckpt") == ["step-00000001"]  # temp dir removed, retention did not run
    assert store.list() == [good] and store.verify(good)

    with pytest.raises(CheckpointError, match="step 3"):
        store.save(3, big_state(2_000_000))
    assert dir_names(tiny_tmpfs / "ckpt") == ["step-00000001"]

    # Space freed by the failed temp dirs: the next checkpoint that fits commits.
    after = store.save(4, {"w": torch.ones(10)})
    assert [i.step for i in store.list()] == [4]  # keep=1: 1 goes only now, after 4 committed
    info, state = store.latest_valid()
    assert info == after and torch.equal(state["w"], torch.ones(10))
    store.close()


def test_a_write_cut_off_by_the_file_size_limit_leaves_the_old_checkpoint(tmp_path):
    # No root needed: RLIMIT_FSIZE makes the kernel fail the write part-way (EFBIG).
    # It is process-wide, so it runs in a child process.
    script = textwrap.dedent(
        f"""
        import json, resource, signal, sys, torch
        from pathlib import Path
        from eltctl_runtime.checkpoint.store import CheckpointStore
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, 512 * 1024))
        store = CheckpointStore(Path({str(tmp_path)!r}), keep=1)
        store.save(1, {{"w": torch.ones(10_000)}})
        store.save_async(2, {{"w": torch.ones(1_000_000)}})
        store.wait()
        store.close()
        print(json.dumps({{"last_error": store.last_error, "failures": store.failures}}))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=LONG)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["failures"] == 1 and "step 2" in out["last_error"]
    assert os.strerror(errno.EFBIG) in out["last_error"] or "too large" in out["last_error"].lower()
    assert dir_names(tmp_path) == ["step-00000001"]
    info, state = CheckpointStore(tmp_path).latest_valid()
    assert info.step == 1 and torch.equal(state["w"], torch.ones(10_000))


# ---------------------------------------------------------------------------
# The background writer


def test_save_async_returns_before_its_write_commits(tmp_path):
    caller = threading.get_ident()
    returned = threading.Event()
    seen: list[tuple] = []

    def on_committed(info: CheckpointInfo) -> None:
        # If save_async waited for the write, `returned` could not be set yet and this times out.
        seen.append((info.step, returned.wait(LONG), threading.get_ident() != caller, verify_dir(info.path) == info))

    store = CheckpointStore(tmp_path, on_committed=on_committed)
    try:
        store.save_async(1, small_state(1))
        returned.set()
        assert store.wait(LONG)
    finally:
        store.close()
    assert seen == [(1, True, True, True)]


def test_a_newer_request_supersedes_the_pending_one_not_the_one_being_written(tmp_path):
    in_callback = threading.Event()
    release = threading.Event()
    committed: list[int] = []

    def on_committed(info: CheckpointInfo) -> None:
        committed.append(info.step)
        if info.step == 1:
            in_callback.set()
            release.wait(LONG)  # holds the writer: step 1 is "in flight"

    store = CheckpointStore(tmp_path, keep=5, on_committed=on_committed)
    try:
        store.save_async(1, small_state(1))
        assert in_callback.wait(LONG)
        store.save_async(2, small_state(2))  # returns although the writer is busy
        store.save_async(3, small_state(3))  # replaces 2, still pending
        assert not store.wait(0.0)  # something is pending or in flight
        release.set()
        assert store.wait(LONG)
    finally:
        release.set()
        store.close()
    assert committed == [1, 3]
    assert store.superseded == 1
    assert [i.step for i in store.list()] == [3, 1]


def test_a_failing_callback_does_not_stop_checkpointing(tmp_path):
    def on_committed(info: CheckpointInfo) -> None:
        raise RuntimeError("mirror is broken")

    with CheckpointStore(tmp_path, on_committed=on_committed) as store:
        store.save_async(1, small_state(1))
        store.wait(LONG)
        store.save_async(2, small_state(2))
    assert [i.step for i in store.list()] == [2, 1]
    assert store.last_error is None


def test_close_writes_the_pending_request_then_refuses_more(tmp_path):
    release = threading.Event()

    def on_committed(info: CheckpointInfo) -> None:
        release.wait(LONG)

    store = CheckpointStore(tmp_path, on_committed=on_committed)
    store.save_async(1, small_state(1))
    store.save_async(2, small_state(2))
    release.set()
    store.close()
    assert store.list()[0].step == 2
    with pytest.raises(RuntimeError, match="closed"):
        store.save_async(3, small_state(3))


def test_synchronous_save_waits_for_the_write_in_flight_and_drops_the_pending(tmp_path):
    in_callback = threading.Event()
    release = threading.Event()
    committed: list[int] = []

    def on_committed(info: CheckpointInfo) -> None:
        committed.append(info.step)
        if info.step == 1:
            in_callback.set()
            release.wait(LONG)

    store = CheckpointStore(tmp_path, keep=5, on_committed=on_committed)
    try:
        store.save_async(1, small_state(1))
        assert in_callback.wait(LONG)
        store.save_async(2, small_state(2))
        threading.Timer(0.2, release.set).start()
        final = store.save(9, small_state(9))  # blocks until 1 is done, then writes 9 here
        assert store.wait(LONG)
    finally:
        release.set()
        store.close()
    assert committed == [1, 9]
    assert final.step == 9 and [i.step for i in store.list()] == [9, 1]


def test_the_constructor_touches_nothing(tmp_path):
    before = threading.active_count()
    CheckpointStore(tmp_path / "x", keep=2)
    assert threading.active_count() == before
    assert not (tmp_path / "x").exists()


def test_a_rank_reading_the_restoring_ranks_very_directory_on_its_machine_is_covered_by_its_hashes(tmp_path):
    """checkpoint.covered_by_restorer: the restoring rank hashes every file of the checkpoint
    (confirmed on every rank before the first step), so a rank that reads the same files
    need not hash them again: one on the same host, or one reading the same directory on
    the same machine under another host name (simulated hosts). A copy at the same path
    elsewhere (here: another directory, or a description from another machine) is not."""
    from eltctl_runtime.checkpoint.load import covered_by_restorer, restore_identity

    d = tmp_path / "step-00000005"
    d.mkdir()
    desc = {"path": str(d), "sha256": "x", "host": "a", **restore_identity(d)}
    assert covered_by_restorer(desc, "a")
    assert covered_by_restorer({"path": str(d), "host": "a"}, "a")  # an older restorer's description
    assert not covered_by_restorer({"path": str(d), "host": "a"}, "b")
    if desc.get("machine"):  # Linux: the boot id is known
        assert covered_by_restorer(desc, "b")
        assert not covered_by_restorer({**desc, "machine": "another-boot"}, "b")
        other = tmp_path / "copy"
        other.mkdir()
        assert not covered_by_restorer({**desc, "path": str(other)}, "b")  # same path name elsewhere: other inode

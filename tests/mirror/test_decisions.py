"""The mirror's pure decisions, by tables: back-off, retention, restore order, lag, targets."""

from __future__ import annotations

import pytest

from eltctl.mirror import (
    Located,
    MirrorError,
    TargetKind,
    backoff_delay,
    compare_sums,
    lag,
    manifest_files,
    parse_target,
    restore_order,
    retention_plan,
)


@pytest.mark.parametrize("attempt, expected", [(0, 0.0), (1, 2.0), (2, 4.0), (3, 8.0), (5, 32.0), (6, 60.0), (100, 60.0)])
def test_backoff_doubles_up_to_the_cap(attempt, expected):
    assert backoff_delay(attempt, base=2.0, cap=60.0) == expected


@pytest.mark.parametrize("present, keep, verified, deleted", [
    ([], 3, 10, []),
    ([10], 1, 10, []),
    ([10, 20], 1, 20, [10]),
    ([10, 20, 30, 40], 2, 40, [10, 20]),
    # a newer step that is present but not (yet) verified is never counted to delete the verified one
    ([10, 20, 30], 1, 10, []),
    ([10, 20, 30], 2, 20, [10]),
    # the verified step is kept even when keep is full of newer ones, and only older go
    ([5, 10, 20, 30], 2, 10, [5]),
    ([1, 2, 3], 5, 3, []),
])
def test_retention_keeps_newest_k_and_never_the_verified_one(present, keep, verified, deleted):
    assert retention_plan(present, keep, verified) == deleted
    assert verified not in retention_plan(present, keep, verified)


def test_retention_refuses_keep_zero():
    with pytest.raises(ValueError):
        retention_plan([1], 0, 1)


def _loc(step, where):
    return Located(step, where, f"/{where}/{step}", 0.0, 1, ())


@pytest.mark.parametrize("candidates, order", [
    ([], []),
    ([("mirror", 10), ("h1", 20)], [("h1", 20), ("mirror", 10)]),
    ([("mirror", 20), ("h1", 10)], [("mirror", 20), ("h1", 10)]),
    # same step: a host's copy first (no transfer), hosts by name, the mirror last
    ([("mirror", 20), ("h2", 20), ("h1", 20)], [("h1", 20), ("h2", 20), ("mirror", 20)]),
])
def test_restore_order_newest_first_hosts_before_mirror(candidates, order):
    got = restore_order([_loc(s, w) for w, s in candidates])
    assert [(c.where, c.step) for c in got] == order


@pytest.mark.parametrize("committed, mirrored, expected", [
    (None, None, None), (100, None, 100), (100, 100, 0), (300, 100, 200), (100, 300, 0)])
def test_lag(committed, mirrored, expected):
    assert lag(committed, mirrored) == expected


@pytest.mark.parametrize("spec, kind, path, address, port, user", [
    ("/mnt/nfs/ckpt", TargetKind.DIRECTORY, "/mnt/nfs/ckpt", None, None, None),
    ("/mnt/nfs/ckpt/", TargetKind.DIRECTORY, "/mnt/nfs/ckpt", None, None, None),
    ("ssh://store/data/ck", TargetKind.SSH, "/data/ck", "store", None, None),
    ("ssh://ann@store:2222/data/ck", TargetKind.SSH, "/data/ck", "store", 2222, "ann"),
])
def test_parse_target(spec, kind, path, address, port, user):
    t = parse_target(spec)
    assert (t.kind, t.path, t.address, t.port, t.user) == (kind, path, address, port, user)
    assert t.job_dir("j") == path + "/j"


@pytest.mark.parametrize("spec", ["relative/dir", "s3://bucket/x", "ssh://host", "ssh://host/"])
def test_parse_target_refuses(spec):
    with pytest.raises(MirrorError):
        parse_target(spec)


def test_compare_sums():
    files = (("state.pt", 3, "a" * 64),)
    assert compare_sums(files, {"state.pt": "a" * 64}) is None
    assert "missing" in compare_sums(files, {})
    assert "differs" in compare_sums(files, {"state.pt": "b" * 64})


@pytest.mark.parametrize("text, problem", [
    ("not json", "not valid JSON"),
    ('{"format": "other"}', "not a version"),
    ('{"format": "eltctl-checkpoint", "version": 1, "step": 7, "created": 1.0, '
     '"files": {"state.pt": {"size": 1, "sha256": "x"}}}', "named for step 5"),
    ('{"format": "eltctl-checkpoint", "version": 1, "step": 5, "created": 1.0, '
     '"files": {"../x": {"size": 1, "sha256": "x"}, "state.pt": {"size": 1, "sha256": "x"}}}', "bad entry"),
])
def test_bad_manifests_are_refused(text, problem):
    with pytest.raises(MirrorError, match=problem):
        manifest_files(text, "step-00000005")


def test_worker_counts_notices_and_a_rewind_restarts_the_count():
    from eltctl.mirror import Mirror, MirrorWorker

    now = [1000.0]
    worker = MirrorWorker(Mirror(parse_target("/nowhere"), "j"), source=None, clock=lambda: now[0])  # type: ignore[arg-type]
    assert worker.status()["lag_steps"] is None and worker.status()["step"] is None
    worker.notify("h1", 20)
    worker.notify("h1", 10)  # older than what is known: ignored
    st = worker.status()
    assert (st["pending"], st["lag_steps"], st["target"]) == (20, 20, "/nowhere")
    worker.rewind(10)  # restarted from step 10 after skipping a bad 20
    worker.notify("h2", 15)
    assert worker.status()["pending"] == 15 and worker.status()["lag_steps"] == 15


@pytest.mark.parametrize("path, host", [
    ("/home/ann/.eltctl/jobs/j/gpu3/checkpoints/step-00001200", "gpu3"),
    ("/home/ann/.eltctl/jobs/j/gpu3/checkpoints", "gpu3"),
    ("/home/ann/.eltctl/jobs/other/gpu3/checkpoints/step-00001200", None),
    ("/mnt/ckpt/j/step-00001200", None),
])
def test_checkpoint_host_from_the_runtime_path(path, host):
    from eltctl.mirror import checkpoint_host

    assert checkpoint_host(path, "j") == host


from eltctl.mirror.decisions import classify, fault_fix  # noqa: E402
from eltctl.mirror.values import FaultKind  # noqa: E402


@pytest.mark.parametrize("message, errno, login, gone, kind", [
    # the host program's answer: its errno decides
    ("mirroring step 100 from h1 to mirror on h1 failed: PermissionError: [Errno 13] Permission denied: "
     "'/m/j/.tmp-step-00000100-mirror-1'", "EACCES", None, False, FaultKind.PERMISSION),
    ("... failed: OSError: [Errno 28] No space left on device", "ENOSPC", None, False, FaultKind.NO_SPACE),
    ("... failed: OSError: [Errno 122] Disk quota exceeded", "EDQUOT", None, False, FaultKind.NO_SPACE),
    ("... failed: OSError: [Errno 30] Read-only file system", "EROFS", None, False, FaultKind.READ_ONLY),
    ("... failed: NotADirectoryError: [Errno 20] Not a directory: '/m/j'", "ENOTDIR", None, False,
     FaultKind.MISSING_PATH),
    # shell tools (a host without Python, the claim, a relay's tar): their words
    ("the mirror directory /m/j on mirror cannot be created or made private: mkdir: cannot create "
     "directory '/m/j': Permission denied", None, None, False, FaultKind.PERMISSION),
    ("writing the copy on mirror failed: tar: state.pt: Cannot write: No space left on device", None, None, False,
     FaultKind.NO_SPACE),
    ("chmod: changing permissions of '/m/j': Operation not permitted", None, None, False, FaultKind.PERMISSION),
    # the ssh:// mirror host's login
    ("mirror: host key not in known_hosts", None, "host-key-unknown", False, FaultKind.HOST_KEY),
    ("mirror: host key changed", None, "host-key-changed", False, FaultKind.HOST_KEY),
    ("mirror: no key accepted", None, "auth", False, FaultKind.AUTH),
    ("mirror: connection refused", None, "unreachable", False, FaultKind.TRANSIENT),
    ("mirror: timed out", None, "timeout", False, FaultKind.TRANSIENT),
    # retried: cut connections, timeouts, what eltctl does not know
    ("the copy from h1 to mirror was cut after 1048576 bytes: ConnectionResetError: reset by peer", None, None,
     False, FaultKind.TRANSIENT),
    ("h1: command timed out after 60 s", None, None, False, FaultKind.TRANSIENT),
    ("the copy of step 7 on mirror does not verify: state.pt sha256 ab... differs", None, None, False,
     FaultKind.TRANSIENT),
    # the SOURCE gone is not the mirror's missing path (the worker drops that step instead)
    ("checkpoint of step 7 is not on h1 any more (No such file or directory)", None, None, True,
     FaultKind.TRANSIENT),
])
def test_mirror_failures_are_sorted_into_retried_and_permanent(message, errno, login, gone, kind):
    got = classify(message, errno=errno, login_error=login, source_gone=gone)
    assert got is kind
    assert got.permanent is (kind is not FaultKind.TRANSIENT)


@pytest.mark.parametrize("kind, directory, words", [
    (FaultKind.PERMISSION, True, ("same uid", "ssh:// mirror", "group-writable", "/m/job")),
    (FaultKind.PERMISSION, False, ("mirror host's account", "/m/job")),
    (FaultKind.NO_SPACE, True, ("free space", "[storage] keep")),
    (FaultKind.MISSING_PATH, True, ("mount it",)),
    (FaultKind.HOST_KEY, False, ("known_hosts",)),
])
def test_each_permanent_failure_has_a_fix(kind, directory, words):
    fix = fault_fix(kind, target="/m", directory=directory, job_dir="/m/job")
    assert fix is not None and all(w in fix for w in words), fix
    assert fault_fix(FaultKind.TRANSIENT, target="/m", directory=directory, job_dir="/m/job") is None

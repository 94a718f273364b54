"""GPU claims (runtime/claims.py): real files, real flocks, real processes.

A claim is held exactly as long as some process holds its file description: the
daemon passes it to the worker and closes its own copy, so a dead worker frees
the GPU and a dead daemon does not. Each account claims through its own file
(`gpu0@account`, mode 0644 in a 1777 directory); the claims of another account are
believed by their owner (issue 49: tests/runtime/test_claims_rules.py has the rules).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from eltctl_runtime import claims
from eltctl_runtime.claims import Claim, ClaimError, Taken
from tests.testbed.procs import ensure_foreign_user

CLAIMS_PY = Path(claims.__file__)


ME = claims.my_account()


def mine(job: str = "a", slot: int = 0) -> Claim:
    return Claim(job=job, user="alice", host="h1", slot=slot, pid=os.getpid(), since=time.time())


def test_a_claim_is_exclusive_and_names_its_holder(tmp_path):
    d = tmp_path / "claims"
    with claims.take(d, "gpu0", mine("a")) as held:
        assert stat.S_IMODE(d.stat().st_mode) == 0o1777
        assert stat.S_IMODE((d / f"gpu0@{ME}").stat().st_mode) == 0o644
        h = claims.holder(d, "gpu0")  # the claim names this account, whatever the caller said
        assert h is not None and (h.job, h.user, h.host, h.slot) == ("a", ME, "h1", 0)
        with pytest.raises(Taken) as exc:
            claims.take(d, "gpu0", mine("b"))
        assert exc.value.holder.job == "a"
        assert f"job a (user {ME}, pid" in str(exc.value)
        # Another slot is free; a reader's look does not take anything.
        assert claims.holder(d, "gpu1") is None
        claims.take(d, "gpu1", mine("b")).close()
        held.record(Claim(job="a", user=ME, host="h1", slot=0, pid=os.getppid(), since=1.0))
        assert claims.holder(d, "gpu0").pid == os.getppid()
    assert claims.holder(d, "gpu0") is None  # released: the file stays, unlocked
    assert claims.holders(d, ["gpu0", "gpu1", "cpu0"]) == {}
    claims.take(d, "gpu0", mine("b")).close()


def test_the_worker_holds_the_claim_for_its_whole_life(tmp_path):
    d = tmp_path / "claims"
    held = claims.take(d, "gpu0", mine("a"))
    worker = subprocess.Popen(["sleep", "60"], pass_fds=(held.fd,), start_new_session=True)
    try:
        held.record(Claim(job="a", user=ME, slot=0, pid=worker.pid, since=time.time()))
        held.close()  # the daemon's copy: the daemon may die now
        assert claims.holder(d, "gpu0").pid == worker.pid
        with pytest.raises(Taken):
            claims.take(d, "gpu0", mine("b"))
    finally:
        worker.kill()
        worker.wait()
    assert claims.holder(d, "gpu0") is None  # no stale claim after the worker's death
    claims.take(d, "gpu0", mine("b")).close()


def test_a_reader_never_makes_a_claim_look_taken(tmp_path):
    d = tmp_path / "claims"
    claims.take(d, "gpu0", mine("a")).close()
    fd = os.open(d / f"gpu0@{ME}", os.O_RDONLY)
    import fcntl
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a reader's instant, stretched
    try:
        with pytest.raises(Taken) as exc:
            claims.take(d, "gpu0", mine("b"), tries=2)
        assert exc.value.holder.job == "a"  # the file's last words: a stale name, read as held
    finally:
        os.close(fd)
    claims.take(d, "gpu0", mine("b")).close()


def test_unreadable_content_is_an_unknown_job():
    assert Claim.from_json(b"") == Claim(job="")
    assert Claim.from_json("[1]") == Claim(job="")
    assert Claim.from_json('{"job": "x", "pid": "7"}') == Claim(job="x")
    assert Claim(job="").describe() == "another eltctl job"


def test_the_claims_directory_comes_from_config_then_environment_then_default(tmp_path):
    assert claims.claims_dir("/a", {claims.ENV: "/b"}) == Path("/a")
    assert claims.claims_dir(None, {claims.ENV: "/b"}) == Path("/b")
    assert claims.claims_dir(None, {}) == Path(claims.DEFAULT_DIR)
    assert claims.slot_file(3) == "gpu3" and claims.slot_file(1, gpu=False) == "cpu1"
    assert claims.own_file("gpu3", "alice") == "gpu3@alice"
    (tmp_path / "file").write_text("")
    with pytest.raises(ClaimError, match="not a directory"):
        claims.take(tmp_path / "file", "gpu0", mine())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_a_second_account_claims_what_the_first_released_and_sees_what_it_holds():
    other = ensure_foreign_user()
    if other is None:
        pytest.skip("no second user on this machine")
    root = Path(tempfile.mkdtemp(prefix="eltclaims-"))
    try:
        os.chmod(root, 0o755)
        shutil.copy(CLAIMS_PY, root / "eltclaims.py")
        d = root / "claims"
        claims.take(d, "gpu0", mine("a")).close()  # released: its file stays, ours
        held = claims.take(d, "gpu1", mine("a"))
        script = ("import os, sys, time; sys.path.insert(0, sys.argv[1]); import eltclaims as c; "
                  "from pathlib import Path; d = Path(sys.argv[2]); "
                  "h = c.take(d, 'gpu0', c.Claim(job='b', pid=os.getpid())); "
                  "print(c.holder(d, 'gpu0').job, c.holder(d, 'gpu1').job); "
                  "c.take(d, 'gpu1', c.Claim(job='b'))")
        out = subprocess.run(["setpriv", f"--reuid={other.pw_uid}", f"--regid={other.pw_gid}", "--clear-groups",
                              sys.executable, "-I", "-c", script, str(root), str(d)],
                             capture_output=True, text=True, timeout=60)
        held.close()
        assert out.stdout.split() == ["b", "a"], out.stdout + out.stderr
        assert "Taken: gpu1 is held by job a" in out.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_daemon_json_may_name_the_claims_directory():
    import json

    from eltctl_runtime.daemon.config import DaemonConfig, DaemonConfigError

    base = {"job": "j", "host": "h1", "store": "127.0.0.1:29400", "job_dir": "/tmp/x", "code_dir": "/tmp/x",
            "command": ["python", "t.py"]}
    assert DaemonConfig.from_json(json.dumps(base)).claims_dir is None  # an older daemon.json
    cfg = DaemonConfig.from_json(json.dumps({**base, "claims_dir": "/dev/shm/gpus"}))
    assert claims.claims_dir(cfg.claims_dir, {claims.ENV: "/elsewhere"}) == Path("/dev/shm/gpus")
    with pytest.raises(DaemonConfigError, match="'claims_dir' must be null or a directory path"):
        DaemonConfig.from_json(json.dumps({**base, "claims_dir": 3}))


def test_demand_reader_reads_fresh_entries_and_rereads_only_replaced_files(tmp_path):
    """The daemon's look at the jobs' demand entries (claims.DemandReader): fresh ones
    only, a temporary or broken file skipped, a file read again once renamed over."""
    import json

    def write(name, doc):
        tmp = tmp_path / f".{name}.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, tmp_path / name)

    now = 10_000.0
    write(f"demand.{ME}.b", {"job": "b", "user": ME, "time": now - 5, "wanted": 1, "every": 1.0})
    write(f"demand.{ME}.x", {"job": "x", "user": ME, "time": now - 3600, "wanted": 4, "every": 1.0})
    (tmp_path / f"demand.{ME}.y").write_text("{not json")
    (tmp_path / f".demand.{ME}.c.123").write_text(json.dumps({"job": "c", "time": now}))
    (tmp_path / "gpu0").write_text("{}")
    reader = claims.DemandReader(tmp_path)
    assert [(e["job"], e["wanted"]) for e in reader.read(now)] == [("b", 1)]
    write(f"demand.{ME}.b", {"job": "b", "user": ME, "time": now, "wanted": 3, "every": 1.0})
    assert [(e["job"], e["wanted"]) for e in reader.read(now)] == [("b", 3)]
    (tmp_path / f"demand.{ME}.b").unlink()
    assert reader.read(now) == []
    assert claims.DemandReader(tmp_path / "missing").read(now) == []

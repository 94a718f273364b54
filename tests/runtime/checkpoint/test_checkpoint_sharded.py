"""Sharded checkpoints (train/zero/checkpoint.py save_sharded, checkpoint/load.py assemble_optimizer): written
by real gloo ranks in their own processes (tests/runtime/checkpoint/ckpt_shard_worker.py), one file
per rank under one manifest, two ranks on the writer's host (each writes its own file)
and one on another (sends its shard to the writer); read back as one plain full state
dict, restored at other world sizes and with shard=None exactly; torn and tampered
writes are never taken."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from eltctl_runtime.checkpoint import format as fmt
from eltctl_runtime.checkpoint import load
from eltctl_runtime.checkpoint.store import CheckpointStore
from eltctl_runtime.train.zero import checkpoint as zckpt
from eltctl_runtime.train.zero.layout import Member, shard_layout
from eltctl_runtime.train.zero.sharded import ShardedGradients

WORKER = Path(__file__).with_name("ckpt_shard_worker.py")
sys.path.insert(0, str(WORKER.parent))
import ckpt_shard_worker as cw  # noqa: E402  (the same model and optimizer as the ranks)

STEPS = 3


def spawn(tmp: Path, ckpt_dir: Path, world: int, shard: str, replicas: int, hosts: str,
          torn: bool = False) -> list[subprocess.Popen]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    store = tmp / f"store-{time.monotonic_ns()}"
    return [subprocess.Popen([sys.executable, str(WORKER), str(store), str(ckpt_dir), str(tmp / "ref.pt"), str(r),
                              str(world), shard, str(replicas), hosts, str(STEPS)] + (["torn"] if torn else []),
                             env=env, stderr=subprocess.PIPE, text=True)
            for r in range(world)]


def reap(procs: list[subprocess.Popen], timeout: float = 400) -> list[int | None]:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # our own child
                p.wait()
    return [p.returncode for p in procs]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Three ranks (hosts a, a, b; ZeRO-1) trained STEPS steps and checkpointed: (step dir, reference)."""
    tmp = tmp_path_factory.mktemp("sharded")
    procs = spawn(tmp, tmp / "ckpts", 3, "optimizer", 1, "a,a,b")
    codes = reap(procs)
    assert codes == [0, 0, 0], [p.stderr.read() for p in procs]
    ref = torch.load(tmp / "ref.pt", weights_only=True)
    return tmp / "ckpts" / fmt.step_dirname(STEPS), ref


def assert_same(got, want, where="state"):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got.keys() if isinstance(got, dict) else got)
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_one_file_per_rank_under_one_manifest_and_the_full_state_comes_back_exactly(written):
    step_dir, ref = written
    names = sorted(p.name for p in step_dir.iterdir())
    assert names == ["manifest.json", "optimizer-00000-of-00003.pt", "optimizer-00001-of-00003.pt",
                     "optimizer-00002-of-00003.pt", "state.pt"]
    m = json.loads((step_dir / "manifest.json").read_text())
    assert set(m["files"]) == set(names) - {"manifest.json"} and m["sharded"]["step"] == STEPS
    assert fmt.check_dir(step_dir).step == STEPS  # every file's sha256
    assert not [p for p in step_dir.parent.iterdir() if p.name.startswith(".tmp-")]  # nothing staged is left
    state = load.load_checkpoint(step_dir.parent)
    assert state["step"] == STEPS
    assert_same(state["optimizer"], ref["optimizer"])
    assert_same(state["model"], ref["model"])


def test_export_writes_the_plain_full_state_dict(written, tmp_path):
    step_dir, ref = written
    done = load.export_checkpoint(step_dir, tmp_path / "model.pt")
    out = torch.load(tmp_path / "model.pt", weights_only=True)
    assert done["step"] == STEPS and set(out) == set(load.EXPORT_KEYS)
    assert_same(out["optimizer"], ref["optimizer"])


def test_restore_with_shard_none_is_the_plain_optimizer_state(written):
    step_dir, ref = written
    model = cw.Net()
    opt = cw.make_opt(model)
    opt.load_state_dict(load.load_checkpoint(step_dir)["optimizer"])
    assert_same(opt.state_dict(), ref["optimizer"])


@pytest.mark.parametrize("how", ["full", "chunks", "collective", "sent"])
@pytest.mark.parametrize("world,shard,replicas", [(2, "gradients", 2), (4, "optimizer", 1)])
def test_restore_at_another_world_size_and_shard_setting(written, world, shard, replicas, how):
    """"full": the rebuilt full state dict, each rank keeping its chunks; "chunks":
    restore_sharded, each rank reading only its chunks' ranges from the shard files;
    "collective": the job's restore_chunks, read on host a, with the ranks on host b
    reading the same (shared) directory: they hash the shard files they read first;
    "sent": restore_chunks where only the last rank has that checkpoint (the others hold
    another one at that path): it sends the full state and every rank takes its chunks."""
    step_dir, ref = written
    full = load.load_checkpoint(step_dir)["optimizer"]
    sha = fmt.read_manifest(step_dir)["files"][fmt.STATE_FILE]["sha256"]
    store = dist.HashStore()
    got, errors, did = {}, [], {}
    init = threading.Lock()

    def rank(r: int) -> None:
        try:
            with init:  # the model's initialisation reads the global RNG
                model = cw.Net()
            opt = cw.make_opt(model)
            params = list(model.parameters())
            lay = shard_layout(params, opt, [Member(f"w{i}", "ab"[i % 2]) for i in range(world)], replicas,
                               bucket_mb=0.0002)
            sg = ShardedGradients(params, opt, lay, r, shard)
            sg.bind()
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=30)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            pg = dist.ProcessGroupGloo(dist.PrefixStore("g", store), r, world, opts)
            if how == "full":
                sg.load_full_state_dict(full)
            elif how == "chunks":
                zckpt.restore_sharded(step_dir, sg)
            else:
                has = how == "collective" or r == world - 1
                did[r] = zckpt.restore_chunks({"path": str(step_dir), "sha256": sha if has else "0" * 64,
                                               "host": "a"}, sg, pg, lay.members[r].host)
            sg.begin(pg)
            got[r] = sg.full_state_dict()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(got) == world
    for sd in got.values():
        assert_same(sd, ref["optimizer"])
    if how == "collective":  # every rank read its own chunks; those on host b verified them first
        assert {r: (d.get("restored_chunks_from_files_s") is not None, d.get("verified_here"))
                for r, d in did.items()} == {r: (True, r % 2 == 1) for r in range(world)}
    if how == "sent":
        assert {r: d.get("restored_full_state_from_rank") for r, d in did.items()} == dict.fromkeys(range(world),
                                                                                                    world - 1)


def test_a_sharded_checkpoint_of_another_optimizer_class_is_refused_naming_both(written):
    """AdamW's state (and hyperparameters) restored into an Adam job: refused before
    anything is loaded, with what to do."""
    step_dir, _ref = written
    model = cw.Net()
    groups = cw.make_opt(model).param_groups
    opt = torch.optim.Adam([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups], lr=0.01)
    params = list(model.parameters())
    sg = ShardedGradients(params, opt, shard_layout(params, opt, [Member("w0", "a")]), 0, "optimizer")
    sg.bind()
    with pytest.raises(ValueError, match="optimizer state is AdamW's, this job's optimizer is Adam: build"):
        zckpt.restore_sharded(step_dir, sg)
    assert not opt.state and not sg.steps_taken()


def test_a_tampered_shard_file_is_rejected(written, tmp_path):
    step_dir, _ref = written
    copy = tmp_path / step_dir.name
    import shutil

    shutil.copytree(step_dir, copy)
    f = copy / "optimizer-00002-of-00003.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(fmt.InvalidCheckpoint, match="optimizer-00002-of-00003.pt sha256"):
        load.load_checkpoint(copy)
    # a rank on another host than the one that restored hashes the shard files it takes chunks from
    model = cw.Net()
    opt = cw.make_opt(model)
    params = list(model.parameters())
    sg = ShardedGradients(params, opt, shard_layout(params, opt, [Member("w0", "b")], 1, bucket_mb=0.0002), 0,
                          "optimizer")
    sg.bind()
    with pytest.raises(fmt.InvalidCheckpoint, match="optimizer-00002-of-00003.pt does not match its sha256"):
        zckpt.load_optimizer_chunks(copy, sg, opt.state_dict()["param_groups"], verify=True)
    f.unlink()
    with pytest.raises(fmt.InvalidCheckpoint, match="optimizer-00002-of-00003.pt is missing"):
        load.export_checkpoint(copy, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_a_writer_killed_before_the_rename_leaves_no_step_directory(tmp_path):
    ckpts = tmp_path / "ckpts"
    procs = spawn(tmp_path, ckpts, 2, "gradients", 2, "a,b", torn=True)
    try:
        procs[0].wait(400)
    finally:
        codes = reap(procs, timeout=30)
    assert codes[0] == -signal.SIGKILL
    left = sorted(p.name for p in ckpts.iterdir())
    assert left and all(n.startswith(".tmp-") for n in left), left  # only temp leftovers, no step-*
    store = CheckpointStore(ckpts)
    assert store.list() == [] and store.latest_valid() is None
    assert list(ckpts.iterdir()) == []  # the writer is dead: its leftovers are swept


def test_the_mirror_reads_every_shard_file_from_the_manifest(written):
    """The mirror copies and verifies what the manifest lists (eltctl/mirror/manifests.py):
    a sharded step directory goes whole, and its MAC (over the manifest) covers every shard."""
    from eltctl.mirror.manifests import manifest_files

    step_dir, _ref = written
    step, _created, files = manifest_files((step_dir / "manifest.json").read_text(), step_dir.name)
    assert step == STEPS
    assert sorted(f[0] for f in files) == sorted(p.name for p in step_dir.iterdir() if p.name != "manifest.json")


def test_staged_files_survive_cleanup_until_written_and_go_with_a_superseded_request(tmp_path):
    """No processes: the store's side of a sharded write."""
    store = CheckpointStore(tmp_path / "c", keep=2)
    with store._cond:  # hold the writer back: both requests wait, the second supersedes the first
        store._writing = True
    a = store.stage(1, "shard00000", {"x": torch.ones(3)})
    store.cleanup()  # a write in flight: nothing is swept (and a staged file is never swept)
    assert a[0].exists()
    store.save_async_files(1, {"progress": {"step": 1, "epoch": 0}}, [("optimizer-00000-of-00001.pt", *a)])
    assert a[0].exists()
    b = store.stage(2, "shard00000", {"x": torch.zeros(3)})
    store.save_async_files(2, {"progress": {"step": 2, "epoch": 0}}, [("optimizer-00000-of-00001.pt", *b)])
    assert not a[0].exists() and b[0].exists()  # the superseded request's file went with it
    with store._cond:
        store._writing = False
        store._cond.notify_all()
    store.close()
    assert store.last_error is None
    (info,) = store.list()
    assert info.step == 2 and fmt.check_dir(info.path)
    assert sorted(p.name for p in info.path.iterdir()) == ["manifest.json", "optimizer-00000-of-00001.pt", "state.pt"]
    assert [p.name for p in (tmp_path / "c").iterdir()] == [info.path.name]

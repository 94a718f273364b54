"""The checkpoint mirror against real sshd hosts, as a shared directory and as ssh://.

Checkpoints are real (runtime/checkpoint.py's CheckpointStore writes them into a
simulated host's `~/.eltctl/jobs/<job>/<host>/checkpoints/`); copies go through the
hosts' sshd (a directory mirror: `cp` on the host; ssh://: a tar stream relayed from
the host to another simulated host). Plans:

- mirror three steps with keep=2: the newest two are on the mirror, verified, loadable;
- a reader listing the mirror while a big copy runs never sees a partial checkpoint;
- the newest mirror copy corrupted, every host lost: restore chooses the previous one,
  delivers it to a fresh host, and the runtime loads it there;
- the mirror away for a while: errors recorded, retries (ssh://: unreachable, retried
  with back-off; a directory that is not there: permanent, shown with its fix, tried
  again when told, as `eltctl up` does), the worker catches up after;
- a newer copy that fails verification never removes the last good one (keep=1);
- the source host dies mid-copy: no step appears on the mirror;
- `eltctl checkpoints --json` lists local and mirrored ones and imports no torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from eltctl.inventory import load_inventory
from eltctl.mirror import (
    MIRROR_LABEL,
    Mirror,
    MirrorError,
    MirrorWorker,
    host_place,
    parse_target,
    prepare_restore,
)
from eltctl.errors import HostError
from eltctl.hosts.fleet import Fleet
from eltctl_runtime.checkpoint.format import verify_dir
from eltctl_runtime.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.sshd

JOB = "mj"
ROOT = Path(__file__).parents[2]


def ckpt_dir(host) -> Path:
    return host.dir / "home" / ".eltctl" / "jobs" / JOB / host.name / "checkpoints"


def commit(host, step: int, *, floats: int = 1000) -> None:
    """Rank 0 on `host` commits checkpoint `step` (a real CheckpointStore write)."""
    store = CheckpointStore(ckpt_dir(host), keep=10)
    store.save(step, {"w": torch.full((floats,), float(step)), "step": step})


def mirror_spec(testbed, kind: str) -> tuple[str, Path]:
    """([storage] mirror, the directory it is on this machine) for a shared dir or ssh://."""
    if kind == "dir":
        path = testbed.dir / "shared-mirror"
        return str(path), path
    m = testbed.add_host("store")
    path = m.dir / "home" / "mirror"
    return f"ssh://{testbed.user}@{m.address}:{m.port}{path}", path


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def step_dirs(path: Path) -> list[str]:
    try:
        return sorted(p for p in os.listdir(path) if p.startswith("step-"))
    except FileNotFoundError:
        return []


def load_tensor(directory: Path):
    found = CheckpointStore(directory).latest_valid()
    assert found is not None
    info, state = found
    return info.step, state


@pytest.fixture(params=["dir", "ssh"])
def kind(request):
    return request.param


def test_mirror_copies_verifies_and_keeps_the_newest(testbed, kind):
    h1 = testbed.add_host("h1")
    spec, where = mirror_spec(testbed, kind)
    inv = load_inventory(testbed.write_inventory())
    for step in (10, 20, 30):
        commit(h1, step)

    async def main():
        mirror = Mirror(parse_target(spec), JOB, keep=2, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            src = await host_place(await fleet.transport(inv.host("h1")), JOB)
            try:
                copied = [await mirror.mirror_checkpoint(src, s) for s in (10, 20, 30)]
                again = await mirror.mirror_checkpoint(src, 30)  # idempotent
                listed = await mirror.list_mirrored(verify=True)
            finally:
                await mirror.close()
        return copied, again, listed

    copied, again, listed = asyncio.run(main())
    assert [c.step for c in copied] == [10, 20, 30] and all(c.verified for c in copied)
    assert again.verified and again.step == 30
    assert [(c.step, c.where, c.verified) for c in listed] == [(30, MIRROR_LABEL, True), (20, MIRROR_LABEL, True)]
    job_dir = where / JOB
    assert sorted(os.listdir(job_dir)) == ["step-00000020", "step-00000030"]  # no .tmp-* left
    assert verify_dir(job_dir / "step-00000030") is not None
    step, state = load_tensor(job_dir)
    assert step == 30 and torch.equal(state["w"], torch.full((1000,), 30.0))


def test_the_mirror_job_directory_is_private_and_must_be_ours(testbed, kind):
    h1 = testbed.add_host("h1")
    spec, where = mirror_spec(testbed, kind)
    inv = load_inventory(testbed.write_inventory())
    commit(h1, 10)
    (where / JOB).mkdir(parents=True, mode=0o755)
    (where / JOB).chmod(0o755)  # left by an older eltctl: tightened

    async def mirror10():
        mirror = Mirror(parse_target(spec), JOB, keep=2, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            try:
                return await mirror.mirror_checkpoint(await host_place(await fleet.transport(inv.host("h1")), JOB), 10)
            finally:
                await mirror.close()

    assert asyncio.run(mirror10()).verified
    assert (where / JOB).stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o077 == 0 for p in (where / JOB).rglob("*"))
    if os.geteuid() != 0:
        return  # giving the directory to another account needs root
    os.chown(where / JOB, 65534, 65534)  # another account's job of the same name (or a trap)
    with pytest.raises(MirrorError, match="belongs to another account"):
        asyncio.run(mirror10())


def test_a_host_without_python_mirrors_with_plain_shell_tools(testbed):
    # The one-command copy needs the host's Python; without it, cp + sha256sum + mv.
    import re

    h1 = testbed.add_host("h1")
    spec, where = mirror_spec(testbed, "dir")
    path = testbed.write_inventory()
    path.write_text(re.sub(r'(?m)^python = .*$', 'python = "/nonexistent/python3"', path.read_text()))
    inv = load_inventory(path)
    assert inv.host("h1").python == "/nonexistent/python3"
    commit(h1, 10)
    commit(h1, 20)
    flip_byte(ckpt_dir(h1) / "step-00000020" / "state.pt")

    async def main():
        mirror = Mirror(parse_target(spec), JOB, keep=2, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            src = await host_place(await fleet.transport(inv.host("h1")), JOB)
            try:
                copied = await mirror.mirror_checkpoint(src, 10)
                again = await mirror.mirror_checkpoint(src, 10)
                with pytest.raises(MirrorError, match="does not verify"):
                    await mirror.mirror_checkpoint(src, 20)
            finally:
                await mirror.close()
        return copied, again

    copied, again = asyncio.run(main())
    assert copied.verified and again.verified
    assert sorted(os.listdir(where / JOB)) == ["step-00000010"]
    assert verify_dir(where / JOB / "step-00000010") is not None


def test_a_reader_never_sees_a_partial_mirror_copy(testbed, kind):
    h1 = testbed.add_host("h1")
    spec, where = mirror_spec(testbed, kind)
    inv = load_inventory(testbed.write_inventory())
    commit(h1, 5)
    commit(h1, 7, floats=12_000_000)  # 48 MB: the copy takes a while
    job_dir = where / JOB
    seen_tmp, seen_steps, bad = set(), set(), []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                names = os.listdir(job_dir)
            except FileNotFoundError:
                continue
            for name in names:
                if name.startswith(".tmp-"):
                    seen_tmp.add(name)
                elif name.startswith("step-") and name not in seen_steps:
                    if verify_dir(job_dir / name) is None and (job_dir / name).exists():
                        bad.append(name)
                    seen_steps.add(name)

    async def main():
        mirror = Mirror(parse_target(spec), JOB, keep=3, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            src = await host_place(await fleet.transport(inv.host("h1")), JOB)
            try:
                await mirror.mirror_checkpoint(src, 5)
                t = threading.Thread(target=reader, daemon=True)
                t.start()
                try:
                    await mirror.mirror_checkpoint(src, 7)
                finally:
                    stop.set()
                    t.join(30)
            finally:
                await mirror.close()

    asyncio.run(main())
    assert bad == []
    assert seen_tmp, "the reader never saw the copy in progress (under its .tmp- name)"
    assert step_dirs(job_dir) == ["step-00000005", "step-00000007"]
    assert verify_dir(job_dir / "step-00000007") is not None


def test_corrupt_newest_mirror_copy_is_skipped_and_restored_on_a_fresh_host(testbed, kind):
    h1 = testbed.add_host("h1")
    spec, where = mirror_spec(testbed, kind)
    h2 = testbed.add_host("h2")
    inv = load_inventory(testbed.write_inventory())
    commit(h1, 10)
    commit(h1, 20)

    async def mirror_both():
        mirror = Mirror(parse_target(spec), JOB, keep=3, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            src = await host_place(await fleet.transport(inv.host("h1")), JOB)
            try:
                for s in (10, 20):
                    await mirror.mirror_checkpoint(src, s)
            finally:
                await mirror.close()

    asyncio.run(mirror_both())
    flip_byte(where / JOB / "step-00000020" / "state.pt")
    # Every host is lost at once: h1 dies and its disk is wiped.
    h1.crash()
    import shutil
    shutil.rmtree(ckpt_dir(h1))

    async def restore():
        mirror = Mirror(parse_target(spec), JOB, keep=3, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            fresh = await host_place(await fleet.transport(inv.host("h2")), JOB)
            try:
                choice = await mirror.choose_restore([fresh])
                assert choice is not None
                delivered = await mirror.deliver(choice, await mirror.place(), fresh)
            finally:
                await mirror.close()
        return choice, delivered

    choice, delivered = asyncio.run(restore())
    assert (choice.step, choice.where) == (10, MIRROR_LABEL)
    assert any("step 20 on mirror" in s and "sha256" in s for s in choice.skipped)
    assert delivered.verified and delivered.where == "h2"
    step, state = load_tensor(ckpt_dir(h2))  # what the runtime does on h2 at start
    assert step == 10 and torch.equal(state["w"], torch.full((1000,), 10.0))


def test_mirror_away_for_a_while_delays_mirroring_but_stops_nothing(testbed, kind):
    h1 = testbed.add_host("h1")
    spec, where = mirror_spec(testbed, kind)
    inv = load_inventory(testbed.write_inventory())
    commit(h1, 10)
    store_host = testbed.host("store") if kind == "ssh" else None
    moved = where.with_name(where.name + ".away")

    def take_away():
        if store_host is not None:
            store_host.crash()  # sshd and its connections gone: unreachable
        else:
            where.rename(moved)  # the mount is gone: a plain file stands in its place
            where.write_text("not a directory\n")

    def bring_back():
        if store_host is not None:
            store_host.restore()
        else:
            where.unlink()
            moved.rename(where)

    async def main():
        mirror = Mirror(parse_target(spec), JOB, keep=3, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            t1 = await fleet.transport(inv.host("h1"))

            async def source(name):
                assert name == "h1"
                return await host_place(t1, JOB)

            worker = MirrorWorker(mirror, source, backoff_base=0.2, backoff_cap=1.0)
            await worker.start()
            try:
                worker.notify("h1", 10)
                assert await worker.flush(timeout=120)
                first = worker.status()
                take_away()
                commit(h1, 20)  # training goes on: a new checkpoint commits on the host
                worker.notify("h1", 20)
                # unreachable (ssh://) is retried with back-off; a directory that is not
                # there is permanent: tried once, shown with its fix, not retried
                deadline = time.monotonic() + 120
                while worker.status()["failures"] < (2 if store_host else 1) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                during = worker.status()
                commit(h1, 30)  # and another, while the mirror is still away
                worker.notify("h1", 30)
                bring_back()
                if store_host is None:  # fixed: `eltctl up` has the worker try again
                    commit(h1, 40)
                    worker.notify("h1", 40)
                    worker.retry()
                flushed = await worker.flush(timeout=120)
                after = worker.status()
            finally:
                await worker.stop()
        return first, during, flushed, after

    first, during, flushed, after = asyncio.run(main())
    assert first["step"] == 10 and first["lag_steps"] == 0 and first["last_error"] is None
    assert during["last_error"] and "step 20" in during["last_error"]
    if kind == "ssh":
        assert during["failures"] >= 2 and during["problem"] is None
    else:
        assert during["failures"] == 1 and during["problem"]["kind"] == "missing-path"
        assert "mount it" in during["problem"]["fix"]
    assert during["step"] == 10 and during["lag_steps"] == 10 and during["last_attempt"] is not None
    assert flushed
    last = 30 if kind == "ssh" else 40
    assert after["step"] == last and after["lag_steps"] == 0 and after["last_error"] is None
    assert after["problem"] is None and after["age_s"] is not None and after["age_s"] >= 0
    assert f"step-000000{last}" in step_dirs(where / JOB)
    assert verify_dir(where / JOB / f"step-000000{last}") is not None


def test_a_newer_copy_that_fails_verification_never_removes_the_last_good_one(testbed):
    h1 = testbed.add_host("h1")
    spec, where = mirror_spec(testbed, "dir")
    inv = load_inventory(testbed.write_inventory())
    commit(h1, 10)
    commit(h1, 20)
    flip_byte(ckpt_dir(h1) / "step-00000020" / "state.pt")  # bad disk on the host after commit
    commit(h1, 30)

    async def main():
        mirror = Mirror(parse_target(spec), JOB, keep=1, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            src = await host_place(await fleet.transport(inv.host("h1")), JOB)
            try:
                await mirror.mirror_checkpoint(src, 10)
                with pytest.raises(MirrorError, match="does not verify"):
                    await mirror.mirror_checkpoint(src, 20)
                between = step_dirs(where / JOB)
                good = verify_dir(where / JOB / "step-00000010")
                await mirror.mirror_checkpoint(src, 30)
            finally:
                await mirror.close()
        return between, good

    between, good = asyncio.run(main())
    assert between == ["step-00000010"] and good is not None and good.step == 10
    assert sorted(os.listdir(where / JOB)) == ["step-00000030"]


def test_source_host_dying_mid_copy_leaves_nothing_on_the_mirror(testbed):
    h1 = testbed.add_host("h1")
    spec, where = mirror_spec(testbed, "ssh")
    inv = load_inventory(testbed.write_inventory())
    commit(h1, 3, floats=25_000_000)  # 100 MB
    job_dir = where / JOB

    async def main():
        mirror = Mirror(parse_target(spec), JOB, keep=3, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            src = await host_place(await fleet.transport(inv.host("h1")), JOB)
            try:
                task = asyncio.create_task(mirror.mirror_checkpoint(src, 3))
                deadline = time.monotonic() + 60
                while not task.done() and time.monotonic() < deadline:
                    if job_dir.exists() and any(n.startswith(".tmp-") for n in os.listdir(job_dir)):
                        break
                    await asyncio.sleep(0.005)
                if task.done():
                    pytest.skip("the copy finished before the host could be killed")
                h1.crash()
                with pytest.raises((MirrorError, HostError)):
                    await asyncio.wait_for(task, 120)
            finally:
                await mirror.close()

    asyncio.run(main())
    assert step_dirs(job_dir) == []


def test_checkpoints_command_lists_local_and_mirrored_without_torch(testbed, tmp_path):
    h1 = testbed.add_host("h1")
    h2 = testbed.add_host("h2")
    spec, where = mirror_spec(testbed, "dir")
    inv_path = testbed.write_inventory(job={"name": JOB}, extra=f'[storage]\nmirror = "{spec}"\nkeep = 2\n')
    inv = load_inventory(inv_path)
    commit(h1, 10)
    commit(h1, 20)

    async def mirror10():
        mirror = Mirror.from_inventory(inv)
        assert mirror is not None
        async with Fleet(inv) as fleet:
            try:
                await mirror.mirror_checkpoint(await host_place(await fleet.transport(inv.host("h1")), JOB), 10)
            finally:
                await mirror.close()

    asyncio.run(mirror10())
    flip_byte(ckpt_dir(h1) / "step-00000020" / "state.pt")
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "eltctl", "-i", str(inv_path),
                          "checkpoints", "--json"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(run.stdout)
    rows = [(c["step"], c["where"], c["verified"]) for c in doc["checkpoints"]]
    assert rows == [(20, "h1", False), (10, "h1", True), (10, "mirror", True)]
    assert doc["mirror"] == spec and doc["errors"] == []
    assert all(c["size"] > 4000 and c["time"] > 0 for c in doc["checkpoints"])
    imported = [line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]
    assert imported and not any(m == "torch" or m.startswith("torch.") for m in imported)
    # the table form, without verification
    run = subprocess.run([sys.executable, "-m", "eltctl", "-i", str(inv_path), "checkpoints", "--no-verify"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "mirror" in run.stdout and "h1" in run.stdout and "20" in run.stdout
    del h2


def test_every_host_lost_new_hosts_get_the_newest_mirrored_step(testbed, kind):
    h1 = testbed.add_host("h1")
    spec, where = mirror_spec(testbed, kind)
    h2, h3 = testbed.add_hosts(2, names=["h2", "h3"])
    inv = load_inventory(testbed.write_inventory())
    for step in (10, 20):
        commit(h1, step)

    async def mirror_all():
        mirror = Mirror(parse_target(spec), JOB, keep=3, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            src = await host_place(await fleet.transport(inv.host("h1")), JOB)
            try:
                for s in (10, 20):
                    await mirror.mirror_checkpoint(src, s)
            finally:
                await mirror.close()

    asyncio.run(mirror_all())
    h1.crash()  # every host of the job gone at once, its disk with it
    import shutil
    shutil.rmtree(ckpt_dir(h1))

    async def restart():
        mirror = Mirror(parse_target(spec), JOB, keep=3, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            hosts = [await host_place(await fleet.transport(inv.host(n)), JOB) for n in ("h2", "h3")]
            try:
                return await prepare_restore(hosts, mirror)
            finally:
                await mirror.close()

    plan = asyncio.run(restart())
    assert plan.choice is not None and (plan.choice.step, plan.choice.where) == (20, MIRROR_LABEL)
    assert sorted(plan.ready) == ["h2", "h3"] and plan.failed == ()
    for h in (h2, h3):
        step, state = load_tensor(ckpt_dir(h))
        assert step == 20 and torch.equal(state["w"], torch.full((1000,), 20.0))


def test_a_restore_is_not_cut_by_the_copiers_failed_copies_beside_it(testbed):
    # Every host lost, the controller's copier still retries the last notice (its host is
    # gone) and drops its mirror connection after each failed copy; the restore beside it
    # must still list the mirror and deliver its newest step (sharing the copier's
    # connection, it was cut and the job started from step 0: CI, test_restore_from_mirror).
    from eltctl.controller import act

    h1 = testbed.add_host("h1")
    spec, _ = mirror_spec(testbed, "ssh")
    h2, h3 = testbed.add_hosts(2, names=["h2", "h3"])
    inv = load_inventory(testbed.write_inventory())
    for step in (10, 20):
        commit(h1, step)
    events: list[tuple] = []

    async def event(kind, host, detail, **fields):
        events.append((kind, detail, fields))

    async def main():
        mirror = Mirror(parse_target(spec), JOB, keep=3, ssh=inv.ssh)
        async with Fleet(inv) as fleet:
            src = await host_place(await fleet.transport(inv.host("h1")), JOB)
            for s in (10, 20):
                await mirror.mirror_checkpoint(src, s)
            h1.crash()
            failed = []

            async def source(name):  # reached, but the copy from it fails: a transient error each time
                failed.append(name)
                return src

            worker = MirrorWorker(mirror, source, backoff_base=0.001, backoff_cap=0.002)
            await worker.start()
            try:
                worker.notify("h1", 30)
                while len(failed) < 3:
                    await asyncio.sleep(0.01)
                told = await act.restore(fleet, inv, ["h2", "h3"], worker, event)
                return told, len(failed), worker.status()
            finally:
                await worker.stop()
                await mirror.close()

    told, attempts, status = asyncio.run(main())
    assert attempts > 3 and status["failures"] >= 3, (attempts, status, events)  # the copier failed (and reset) throughout
    assert told == {"step": 20, "targets": ["h2", "h3"], "ready": ["h2", "h3"]}, (told, events)
    assert [(k, f["where"], f["step"]) for k, _, f in events] == [("restore", MIRROR_LABEL, 20)], events
    for h in (h2, h3):  # delivered into the inventory job's directory, which the runtime restores from
        assert load_tensor(h.dir / "home" / ".eltctl" / "jobs" / inv.job.name / h.name / "checkpoints")[0] == 20


def test_a_restore_without_a_mirror_takes_the_newest_step_from_a_host_that_runs_no_worker(testbed):
    """The job's last worker left h1 for its owner (h1 wrote step 30 there); the job starts
    again on h2 only, which holds step 10 from long ago: h1 is still a candidate (it answers),
    so h2 gets step 30 (before, h2's own step 10 was restored: 20 committed steps lost)."""
    h1, h2 = testbed.add_hosts(2, names=["h1", "h2"])
    inv = load_inventory(testbed.write_inventory())
    commit(h2, 10)
    for step in (20, 30):
        commit(h1, step)

    async def restart():
        async with Fleet(inv) as fleet:
            place = {n: await host_place(await fleet.transport(inv.host(n)), JOB) for n in ("h1", "h2")}
            return await prepare_restore([place["h2"]], None, [place["h1"]])

    plan = asyncio.run(restart())
    assert plan.choice is not None and (plan.choice.step, plan.choice.where) == (30, "h1"), plan
    assert plan.ready == ("h2",) and plan.failed == ()
    step, state = load_tensor(ckpt_dir(h2))
    assert step == 30 and torch.equal(state["w"], torch.full((1000,), 30.0))


def test_checkpoints_export_writes_a_plain_file_from_the_mirror_or_a_host(testbed, tmp_path):
    """`eltctl checkpoints export OUT.pt`: the newest verified checkpoint, brought from the
    mirror (a damaged copy there is passed over for a host's), as a file torch.load opens
    with weights_only=True in an interpreter without eltctl."""
    from eltctl_runtime.train import state as state_mod
    from tests.testbed.hostpython import HOST_PYTHON

    h1 = testbed.add_host("h1")
    spec, where = mirror_spec(testbed, "dir")
    inv_path = testbed.write_inventory(job={"name": JOB}, extra=f'[storage]\nmirror = "{spec}"\nkeep = 3\n')
    inv = load_inventory(inv_path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for step in (10, 20):
        opt.step()
        sched.step()
        state = state_mod.capture(model, opt, {"step": step, "epoch": step // 10, "position": 0},
                                  {"scheduler": sched})
        CheckpointStore(ckpt_dir(h1), keep=10).save(step, state)

    async def mirror_both():
        mirror = Mirror.from_inventory(inv)
        async with Fleet(inv) as fleet:
            try:
                src = await host_place(await fleet.transport(inv.host("h1")), JOB)
                for s in (10, 20):
                    await mirror.mirror_checkpoint(src, s)
            finally:
                await mirror.close()

    asyncio.run(mirror_both())
    flip_byte(where / JOB / "step-00000020" / "state.pt")

    def export(*args):
        return subprocess.run([sys.executable, "-m", "eltctl", "-i", str(inv_path), "checkpoints", "export", *args],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)

    run = export(str(tmp_path / "model.pt"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "exported step 20 (epoch 2, from h1)" in run.stdout and "weights_only=True" in run.stdout, run.stdout
    assert "passed over" in run.stderr and "mirror" in run.stderr, run.stderr  # the damaged mirror copy
    check = ("import sys, torch; d = torch.load(sys.argv[1], weights_only=True); "
             "print(sorted(d), d['step'], d['epoch'], d['extra_state']['scheduler']['last_epoch'], "
             "sorted(d['model']))")
    loaded = subprocess.run([HOST_PYTHON, "-I", "-c", check, str(tmp_path / "model.pt")], capture_output=True,
                            text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split("] ")[0] == "['epoch', 'extra_state', 'model', 'optimizer', 'step'"
    assert " 20 2 2 " in loaded.stdout and "1.running_mean" in loaded.stdout, loaded.stdout
    # An older step from the mirror, and errors that say what to do.
    run = export("--step", "10", "--from", "mirror", str(tmp_path / "old.pt"))
    assert run.returncode == 0 and "exported step 10 (epoch 1, from mirror)" in run.stdout, run.stdout + run.stderr
    run = export("--step", "30", str(tmp_path / "none.pt"))
    assert run.returncode == 1 and "no verified copy of step 30" in run.stderr, run.stderr
    assert "eltctl checkpoints" in run.stderr and not (tmp_path / "none.pt").exists()

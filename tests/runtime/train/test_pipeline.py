"""The input pipeline (runtime/pipeline.py): shares loaded in data worker processes.

First the pure parts (which shares a rank wants, by table), then the
prefetcher on real forked processes, then whole jobs on the runtime cluster
with `--num-workers 2` through a planned leave, a join and a SIGKILL: exactly
once, the same losses as loading on the training thread, clear errors, and no
data worker outliving its job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset, default_collate

import eltctl_runtime as elt
from eltctl_runtime.pids import pid_alive
from eltctl_runtime.train.pipeline import DataLoadError, Prefetcher, ShareKey, check_pipeline_args, fetch_batch, micro_chunks, plan_shares
from eltctl_runtime.train.sampler import SamplerState
from runtime_cluster import SMALL, assert_exactly_once, assert_identical_state

N_SAMPLES = int(SMALL[SMALL.index("--samples") + 1])
BATCH = int(SMALL[SMALL.index("--batch") + 1])

# -- which shares a rank wants (pure) ------------------------------------------------


def split_for(rank: int, world: int):
    return lambda s: s.local_indices(rank, world)


@pytest.mark.parametrize("indices, micro, chunks", [
    ([1, 2, 3, 4, 5], None, [[1, 2, 3, 4, 5]]),
    ([1, 2, 3, 4, 5], 2, [[1, 2], [3, 4], [5]]),
    ([1, 2, 3, 4], 4, [[1, 2, 3, 4]]),
    ([], 2, [[]]),
    ([], None, [[]]),
])
def test_micro_chunks_cut_a_share_in_order(indices, micro, chunks):
    assert micro_chunks(indices, micro) == chunks


def test_planned_shares_are_this_step_then_the_next_ones_in_order():
    s = SamplerState(n_samples=20, global_batch=8, seed=3)
    keys = plan_shares(s, split_for(1, 2), micro=None, ahead=2, steps_left=None, epochs=None)
    assert [(k.epoch, k.position) for k in keys] == [(0, 0), (0, 8), (0, 16)]
    assert [list(k.indices) for k in keys] == [s.local_indices(1, 2), s.advanced().local_indices(1, 2),
                                               s.advanced().advanced().local_indices(1, 2)]
    # the last step of the epoch is short (4 samples), the next epoch starts at 0
    assert len(keys[2].indices) == 2
    more = plan_shares(s, split_for(1, 2), micro=None, ahead=3, steps_left=None, epochs=None)
    assert (more[3].epoch, more[3].position) == (1, 0)


@pytest.mark.parametrize("steps_left, epochs, ahead, expect", [
    (None, None, 2, 3),
    (1, None, 2, 1),     # the step being trained is the job's last: nothing ahead
    (2, None, 5, 2),
    (None, 1, 5, 3),     # epoch 0 has 3 steps; nothing of epoch 1
    (None, None, 0, 1),  # no lookahead: only the current step
])
def test_planned_shares_stop_at_the_end_of_the_job(steps_left, epochs, ahead, expect):
    s = SamplerState(n_samples=20, global_batch=8, seed=0)
    keys = plan_shares(s, split_for(0, 1), micro=None, ahead=ahead, steps_left=steps_left, epochs=epochs)
    assert len(keys) == expect


def test_planned_shares_with_micro_batches_are_one_key_per_chunk():
    s = SamplerState(n_samples=100, global_batch=24, seed=0)
    keys = plan_shares(s, split_for(0, 2), micro=5, ahead=1, steps_left=None, epochs=None)
    assert [len(k.indices) for k in keys] == [5, 5, 2, 5, 5, 2]
    assert [i for k in keys[:3] for i in k.indices] == s.local_indices(0, 2)


def test_a_share_key_names_exact_samples_at_an_exact_place():
    assert ShareKey(0, 8, (1, 2)) == ShareKey(0, 8, (1, 2))
    assert ShareKey(0, 8, (1, 2)) != ShareKey(0, 8, (2, 1))
    assert ShareKey(0, 8, (1, 2)) != ShareKey(1, 8, (1, 2))
    assert ShareKey(0, 8, (1, 2)) != ShareKey(0, 16, (1, 2))


@pytest.mark.parametrize("workers, ahead", [(-1, 2), (2, -1), (1.5, 2)])
def test_bad_pipeline_arguments_are_refused_with_the_fix(workers, ahead):
    with pytest.raises(ValueError, match=">= 0"):
        check_pipeline_args(workers, ahead)


# -- the prefetcher on real processes ---------------------------------------------------


def test_an_empty_share_is_the_batch_of_one_sample_cut_to_none_where_the_collate_cannot_make_it():
    """A rank without samples in a step (a joiner catching up: catchup.py) is handed an
    empty batch of the dataset's own structure; torch's default_collate([]) raises."""
    from collections import namedtuple

    Pair = namedtuple("Pair", "x y")
    rows = [{"x": torch.ones(3) * i, "label": i, "name": f"s{i}", "pair": Pair(torch.zeros(2), i)} for i in range(4)]
    with pytest.raises(IndexError):
        default_collate([])
    empty = fetch_batch(rows, [], default_collate)
    assert empty["x"].shape == (0, 3) and empty["label"].shape == (0,) and empty["name"] == []
    assert isinstance(empty["pair"], Pair) and empty["pair"].x.shape == (0, 2) and empty["pair"].y.shape == (0,)
    tuples = [(torch.full((2,), float(i)), i) for i in range(3)]
    x, y = fetch_batch(tuples, [], default_collate)
    assert x.shape == (0, 2) and y.shape == (0,)
    assert fetch_batch(rows, [], lambda b: list(b)) == []  # a collate that makes an empty batch itself is asked
    full = fetch_batch(tuples, [2, 0], default_collate)
    assert full[1].tolist() == [2, 0]  # a share with samples: unchanged


class Records:
    """A map-style dataset that reads slowly and fails on one sample."""

    def __init__(self, n: int = 64, bad: int | None = None) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"record {i} is corrupt")
        time.sleep(0.001)
        return torch.full((3,), float(i)) + torch.rand(1), i  # rand: seeded per share in the workers


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@contextlib.contextmanager
def started(dataset, workers: int = 2, collate=default_collate, seed: int = 5):
    """A started Prefetcher, closed after the block however it ends."""
    p = Prefetcher(dataset, collate, workers, seed=seed)
    p.start()
    try:
        yield p
    finally:
        p.close()


# The cases below fork data workers, which Prefetcher.start asks for before the process
# starts threads or opens connections (as the job does). A pytest worker has run other
# tests by then and may hold threads and native state they left, and a fork copies
# those half-done: one CI run saw a data worker die of SIGSEGV before its first batch.
# So each case runs in a clean interpreter spawned once for this module: the fork there
# is the one the job makes. An assertion failing there fails here with its message.


@pytest.fixture(scope="module")
def clean():
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    def run(case) -> None:
        failure = pool.submit(run_case, case).result(timeout=120)
        if failure:
            pytest.fail(f"in the clean interpreter:\n{failure}", pytrace=False)

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield run


def run_case(case) -> str | None:
    """In the clean interpreter: None, or how the case failed (a traceback)."""
    import traceback

    try:
        case()
    except BaseException:  # noqa: BLE001 - pytest's own outcomes too: they come back as text
        return traceback.format_exc()
    return None


def case_shares_by_key() -> None:
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
    with started(data) as p:
        keys = [ShareKey(0, 0, (3, 1, 4)), ShareKey(0, 3, (15, 9)), ShareKey(0, 5, (26,))]
        p.want(keys)
        for k in reversed(keys):  # any order asked, each gets its own samples
            assert same(p.get(k), fetch_batch(data, list(k.indices), default_collate))
        assert p.prepared() == set()


def test_shares_come_back_by_key_as_the_training_thread_would_load_them(clean):
    clean(case_shares_by_key)


def case_same_whichever_worker() -> None:
    with started(Records()) as p:
        k = ShareKey(2, 10, (7, 8, 9))
        first = p.get(k)
        assert first[1].tolist() == [7, 8, 9]
        assert same(p.get(k), first)  # loaded again (maybe elsewhere): same random augmentation


def test_a_share_loads_the_same_whichever_worker_and_whenever(clean):
    clean(case_same_whichever_worker)


def case_old_layout_dropped() -> None:
    with started(Records()) as p:
        old = [ShareKey(0, 0, (0, 1, 2, 3)), ShareKey(0, 8, (8, 9, 10, 11))]  # rank 0 of 2
        p.want(old)
        p.get(old[0])
        new = [ShareKey(0, 8, (8, 9, 10)), ShareKey(0, 16, (16, 17, 18))]  # rank 0 of 3 after a join
        p.want(new)
        assert p.prepared() == set(new)
        assert p.get(new[0])[1].tolist() == [8, 9, 10]
        assert p.get(new[1])[1].tolist() == [16, 17, 18]


def test_shares_of_a_layout_that_no_longer_holds_are_dropped(clean):
    clean(case_old_layout_dropped)


def case_dataset_error() -> None:
    with started(Records(bad=13)) as p:
        p.want([ShareKey(0, 0, (1, 2)), ShareKey(0, 2, (12, 13))])
        assert p.get(ShareKey(0, 0, (1, 2)))[1].tolist() == [1, 2]
        with pytest.raises(DataLoadError) as e:
            p.get(ShareKey(0, 2, (12, 13)))
        msg = str(e.value)
        assert "record 13 is corrupt" in msg and "Traceback" in msg and "__getitem__" in msg
        assert "samples [12, 13]" in msg and "num_workers=0" in msg


def test_an_error_in_the_dataset_reaches_the_training_thread_with_its_traceback(clean):
    clean(case_dataset_error)


def unpicklable_collate(samples):
    return default_collate(samples), lambda: None


def case_unpicklable_batch() -> None:
    with started(Records(), workers=1, collate=unpicklable_collate, seed=0) as p:
        with pytest.raises(DataLoadError, match="pickle"):
            p.get(ShareKey(0, 0, (1, 2)))


def test_a_batch_that_cannot_cross_to_the_training_process_is_an_error_not_a_lost_share(clean):
    clean(case_unpicklable_batch)


def case_worker_dies() -> None:
    with started(Records(), workers=1) as p:
        p.get(ShareKey(0, 0, (1,)))
        os.kill(p.pids[0], signal.SIGKILL)
        with pytest.raises(DataLoadError, match="killed by signal SIGKILL"):
            p.get(ShareKey(0, 1, (2,)))


def test_a_data_worker_that_dies_is_an_error_not_a_hang(clean):
    clean(case_worker_dies)


def case_sigterm_ignored() -> None:
    with started(Records()) as p:
        pids = p.pids
        for pid in pids:
            os.kill(pid, signal.SIGTERM)  # meant for the job (a planned leave), not for its data workers
        assert p.get(ShareKey(0, 0, (4, 5)))[1].tolist() == [4, 5]
        assert all(pid_alive(pid) for pid in pids)
        p.close()
        assert not any(pid_alive(pid) for pid in pids)
        p.close()  # idempotent


def test_data_workers_ignore_sigterm_and_end_with_close(clean):
    clean(case_sigterm_ignored)


# -- whole jobs on the runtime cluster --------------------------------------------------


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def data_workers(cluster, w, n: int = 2) -> list[int]:
    box: dict = {}

    def found() -> bool:
        box["pids"] = children_of(w.proc.pid)
        return len(box["pids"]) == n

    cluster.wait_for(found, 30, f"the {n} data workers of {w.id}")
    return box["pids"]


def losses_by_step(workers) -> dict[int, float]:
    """step -> global loss as committed by the newest generation that committed it."""
    best: dict[int, tuple[int, float]] = {}
    for w in workers:
        for line in w.progress.read_text().splitlines():
            step, gen, _world, _t, loss = line.split()
            if int(step) not in best or int(gen) > best[int(step)][0]:
                best[int(step)] = (int(gen), float(loss))
    return {s: loss for s, (_g, loss) in best.items()}


PIPE = ["--num-workers", "2", "--prefetch-steps", "2"]


@pytest.mark.slow
def test_prefetched_data_through_a_leave_a_join_and_a_sigkill_is_exactly_once_and_trains_alike(cluster_factory):
    """3 workers with 2 data workers each; rank 1 leaves on SIGTERM (3 -> 2),
    one joins (2 -> 3), one is SIGKILLed (3 -> 2); stop. Prefetched shares of the old
    layouts are dropped: the audit is exactly-once, the ranks agree bit for
    bit, every step's loss is the loss of a fixed-size run loading on the
    training thread, and no data worker outlives its training process."""
    c = cluster_factory(min_workers=3)
    slow = ["--steps", "100000", "--step-sleep", "0.03", *PIPE]
    a, b, x = c.start(3, slow)
    c.wait_world(3, steps_after=3)
    pids = {w.id: data_workers(c, w) for w in (a, b, x)}
    c.kill(b, signal.SIGTERM)  # a planned leave; its data workers ignore the signal and end with it
    g = c.wait_world(2, steps_after=3)
    (d,) = c.start(1, slow)
    g = c.wait_world(3, min_gen=g + 1, steps_after=3)
    pids[d.id] = data_workers(c, d)
    c.kill(x)  # SIGKILL: its data workers go with it (PR_SET_PDEATHSIG)
    c.wait_world(2, min_gen=g + 1, steps_after=3)
    c.stop()
    c.wait_exit([a, b, x, d])
    assert all(w.proc.returncode == 0 for w in (a, b, d)), c.dump_logs()
    results = [r for r in (w.read_result() for w in (a, d)) if r and not r["left"]]
    assert len(results) == 2, c.dump_logs()
    assert_identical_state(results)
    steps = results[0]["step"]
    assert_exactly_once(c.audit, N_SAMPLES, BATCH, steps)
    kinds = [ev["kind"] for ev in c.events()]
    assert "leave" in kinds and "join" in kinds and "crash" in kinds, kinds
    c.wait_for(lambda: not any(pid_alive(p) for ps in pids.values() for p in ps), 30, "the data workers to end")

    fixed = cluster_factory(min_workers=2)
    ws = fixed.start(2, ["--steps", str(steps)])
    fixed.wait_exit(ws)
    assert all(w.proc.returncode == 0 for w in ws), fixed.dump_logs()
    want, got = losses_by_step(ws), losses_by_step([a, b, x, d])
    assert sorted(got) == sorted(want) == list(range(1, steps + 1))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    print(f"per-step losses differ by up to {worst:.2e} (relative)")
    assert worst <= 1e-4, f"per-step losses differ by up to {worst:.2e} (relative)"
    assert "no longer holds" in a.log_text() + d.log_text()  # the resizes did drop prefetched shares


@pytest.mark.slow
def test_micro_batches_through_data_workers_train_bit_for_bit_like_the_training_thread(cluster_factory):
    prints = {}
    for name, extra in (("thread", []), ("workers", PIPE)):
        c = cluster_factory(min_workers=2)
        # equal shares: a speed-balanced split follows timing, and with it the order of float sums
        ws = c.start(2, ["--steps", "15", "--micro-batch", "5", "--io-ms", "0", "--no-balance", *extra])
        c.wait_exit(ws)
        assert all(w.proc.returncode == 0 for w in ws), c.dump_logs()
        results = [w.read_result() for w in ws]
        assert_identical_state(results)
        assert_exactly_once(c.audit, N_SAMPLES, BATCH, 15)
        prints[name] = results[0]["fingerprint"]
    assert prints["thread"] == prints["workers"]


# Sample 426 is in the 9th step of epoch 0 (seed 0, 480 samples, batch 24).
BAD = 426


@pytest.mark.slow
def test_a_corrupt_record_ends_the_worker_with_the_datasets_traceback(cluster_factory):
    c = cluster_factory(min_workers=1)
    (w,) = c.start(1, ["--steps", "100", "--step-sleep", "0.1", "--bad-sample", str(BAD), *PIPE])
    pids = data_workers(c, w)
    c.wait_exit([w], timeout=60)
    log = w.log_text()
    assert w.proc.returncode != 0, log
    assert "DataLoadError" in log and f"record {BAD} is corrupt" in log and "__getitem__" in log, log
    assert w.last_progress()[0] == 8, "the steps before the corrupt record trained"
    c.wait_for(lambda: not any(pid_alive(p) for p in pids), 30, "the data workers to end")


FAST_EXIT = textwrap.dedent("""
    import ctypes, json, multiprocessing, sys, torch
    import eltctl_runtime as elt

    # Only an ordinary interpreter teardown runs C exit handlers (os._exit skips them):
    # this one aborts the process (test_exiting.py).
    libc = ctypes.CDLL(None)
    libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
    model = torch.nn.Linear(4, 1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    job = elt.ElasticJob(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=4,
                         max_steps=3, num_workers=2)
    with job:
        for x, y in job:
            pids = [p.pid for p in multiprocessing.active_children()]
            job.step(((model(x) - y) ** 2).mean())
    open(sys.argv[1], "w").write(json.dumps(pids))
    sys.exit(3)
""")


def test_a_finished_job_with_data_workers_still_exits_the_fast_way_and_ends_them(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    script, out = tmp_path / "script.py", tmp_path / "out.json"
    script.write_text(FAST_EXIT)
    job = f"p{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, ELTCTL_STORE=f"127.0.0.1:{store.port}", ELTCTL_JOB=job,
               ELTCTL_WORKER_ID=f"h/0/{uuid.uuid4().hex[:6]}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode != -signal.SIGABRT, "the interpreter's teardown ran: the exit was not shortened"
    assert proc.returncode == 3, proc.stderr
    assert (elt.read_status(store, job) or {}).get("step") == 3, proc.stderr
    pids = json.loads(out.read_text())
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)

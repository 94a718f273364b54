"""The gradient path: buffers per dtype in one bucket order, global clipping,
the hook, the GradScaler's skipped steps, and the buffers' agreement.

The layouts are pure (tables); the rest runs real workers (tests/runtime/
grad_worker.py, gloo) and compares them with one process on the global batch."""

from __future__ import annotations

import pytest
import torch

import grad_worker
from eltctl_runtime.train.gradients import BufferSync, Bucket, Slot, plan_layout
from runtime_cluster import assert_exactly_once

F32, F64, F16 = "torch.float32", "torch.float64", "torch.float16"


@pytest.mark.parametrize("kinds, numels, sizes, bucket_bytes, slots, buckets, tail_group", [
    # one dtype: as before, reverse order, a bucket closes at bucket_bytes
    ([F32] * 3, [10, 20, 30], [4] * 3, 100,
     [(0, 50, 10), (0, 30, 20), (0, 0, 30)], [(0, 0, 30, (2,)), (0, 30, 60, (1, 0))], 0),
    # a dtype change closes the bucket; each dtype has its own buffer; the last bucket is float64:
    # the tail goes alone
    ([F64, F64, F32, F32], [4, 4, 4, 4], [8, 8, 4, 4], 1000,
     [(1, 4, 4), (1, 0, 4), (0, 4, 4), (0, 0, 4)], [(0, 0, 8, (3, 2)), (1, 0, 8, (1, 0))], None),
    # interleaved dtypes: one global order, buckets never span dtypes, offsets continue per buffer
    ([F32, F64, F32], [2, 3, 5], [4, 8, 4], 1000,
     [(0, 5, 2), (1, 0, 3), (0, 0, 5)], [(0, 0, 5, (2,)), (1, 0, 3, (1,)), (0, 5, 7, (0,))], 0),
    # byte-sized buckets: 8-byte elements fill a bucket twice as fast
    ([F32, F64, F64], [4, 2, 2], [4, 8, 8], 16,
     [(1, 0, 4), (0, 2, 2), (0, 0, 2)], [(0, 0, 2, (2,)), (0, 2, 4, (1,)), (1, 0, 4, (0,))], 1),
    ([F16], [8], [2], 4, [(0, 0, 8)], [(0, 0, 8, (0,))], None),  # fp16 gradients: the tail goes alone
    ([], [], [], 4, [], [], None),  # nothing to reduce: the tail alone
])
def test_bucket_order_is_global_and_buckets_never_span_dtypes(kinds, numels, sizes, bucket_bytes, slots,
                                                              buckets, tail_group):
    lay = plan_layout(kinds, numels, sizes, bucket_bytes)
    assert lay.slots == tuple(Slot(*s) for s in slots)
    assert lay.buckets == tuple(Bucket(*b) for b in buckets)
    assert lay.tail_group == tail_group
    for g, length in enumerate(lay.lengths):  # each dtype's buckets tile its buffer
        mine = [b for b in lay.buckets if b.group == g]
        assert mine[0].start == 0 and mine[-1].end == length
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
    for b in lay.buckets:
        assert {kinds[i] for i in b.members} == {lay.groups[b.group]}


def bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def test_buffers_agree_on_the_sample_weighted_update_and_rank_0s_counter():
    ranks = [bn_model() for _ in range(3)]
    syncs = [BufferSync(m) for m in ranks]
    for s in syncs:
        s.mark()
    start = {k: v.clone() for k, v in ranks[0].named_buffers()}
    counts = [6, 2, 0]  # the third rank has no samples: no forward, no weight
    torch.manual_seed(1)
    ranks[0](torch.randn(6, 3))
    ranks[1](torch.randn(1, 3).expand(2, 3) + torch.tensor([[0.0], [1.0]]))
    ranks[1](torch.randn(2, 3))  # micro-batches: rank 1 ran two forward passes
    local = [{k: v.clone() for k, v in m.named_buffers()} for m in ranks]
    out = []
    for r, (s, n) in enumerate(zip(syncs, counts)):
        t = torch.zeros(s.size)
        s.write(t, n, r)
        out.append(t)
    summed = out[0] + out[1] + out[2]
    for s in syncs:
        s.read(summed, sum(counts))
    agreed = [dict(m.named_buffers()) for m in ranks]
    for name in ("1.running_mean", "1.running_var"):
        want = start[name] + sum(n * (b[name] - start[name]) for b, n in zip(local, counts)) / sum(counts)
        assert torch.allclose(agreed[0][name], want, atol=1e-6), name
        assert all(torch.equal(a[name], agreed[0][name]) for a in agreed)
    assert all(int(a["1.num_batches_tracked"]) == 1 for a in agreed)  # rank 0's count (rank 1 had 2)


def test_a_buffer_no_forward_moves_stays_bit_for_bit_and_a_dropped_step_is_undone():
    m = bn_model()
    m.register_buffer("const", torch.tensor([0.1, 1 / 3, 7.25]))
    s = BufferSync(m)
    s.mark()
    before = {k: v.clone() for k, v in m.named_buffers()}
    m(torch.randn(5, 3))
    t = torch.zeros(s.size)
    s.write(t, 5, 0)
    s.read(t, 5)
    assert torch.equal(m.const, before["const"])
    assert not torch.equal(m[1].running_mean, before["1.running_mean"])
    agreed = {k: v.clone() for k, v in m.named_buffers()}
    m(torch.randn(5, 3))  # the forward of a step that is then dropped
    s.reset()
    assert all(torch.equal(v, agreed[k]) for k, v in m.named_buffers())


def run_workers(cluster_factory, args: list[str], n: int = 2, batch: int = 24) -> list[dict]:
    from runtime_cluster import GRAD_WORKER

    c = cluster_factory(min_workers=n, script=GRAD_WORKER, args=[])
    ws = c.start(n, args + ["--batch", str(batch)])
    c.wait_exit(ws)
    assert all(w.proc.returncode == 0 for w in ws), c.dump_logs()
    results = sorted((w.read_result() for w in ws), key=lambda r: r["rank"])
    for r, w in zip(results, sorted(ws, key=lambda w: w.read_result()["rank"])):
        r["state"] = torch.load(w.result.with_suffix(".pt"), weights_only=True)
    assert len({r["fingerprint"] for r in results}) == 1, "ranks disagree"
    assert_exactly_once(c.audit, 96, batch, results[0]["step"])
    return results


@pytest.mark.slow
@pytest.mark.parametrize("dtypes, batch", [
    ("64,32", 24),  # the last bucket is float64: the tail is its own all-reduce
    ("32,64", 24),  # the last bucket is float32: the tail rides with it
    ("64,32", 2),   # rank 2 has no samples: no backward, every bucket and the tail launched at the end
])
def test_mixed_dtypes_with_clipping_train_like_one_process_on_the_global_batch(cluster_factory, dtypes, batch):
    steps, max_norm = 8, 0.05
    results = run_workers(cluster_factory, ["--dtypes", dtypes, "--steps", str(steps),
                                            "--max-grad-norm", str(max_norm)], n=3, batch=batch)
    want_state, want_norms = grad_worker.reference(dtypes, steps, batch, 0.05, max_norm)
    got = results[0]
    norms = [s["norm"] for s in got["steps"]]
    assert norms == pytest.approx(want_norms, rel=1e-5)
    assert min(norms) > max_norm  # clipping was active at every step
    # the hook ran after clipping (and sees the clipped global gradient on every rank)
    assert all(s["hook_norm"] == pytest.approx(max_norm, rel=1e-4) for s in got["steps"])
    assert [s["hook_norm"] for s in got["steps"]] == [s["hook_norm"] for s in results[1]["steps"]]
    for k, v in want_state.items():
        assert got["state"][k].dtype == v.dtype
        assert torch.allclose(got["state"][k], v, rtol=1e-5, atol=1e-6), k


@pytest.mark.slow
def test_a_step_with_inf_gradients_on_one_rank_is_skipped_on_every_rank_and_still_commits(cluster_factory):
    steps, bad = 6, 3
    results = run_workers(cluster_factory, ["--steps", str(steps), "--scaler", "--inf-at", str(bad),
                                            "--inf-rank", "1", "--max-grad-norm", "1e6"])
    for r in results:
        by_step = {s["step"]: s for s in r["steps"]}
        assert sorted(by_step) == list(range(1, steps + 1))  # the skipped step is a committed step
        assert [s for s in by_step if by_step[s]["skipped"]] == [bad]
        assert by_step[bad]["params"] == by_step[bad - 1]["params"]  # no optimizer step
        assert by_step[bad + 1]["params"] != by_step[bad]["params"]
        assert by_step[bad]["scale"] == by_step[bad - 1]["scale"] / 2  # the scaler backed off
    assert [s["params"] for s in results[0]["steps"]] == [s["params"] for s in results[1]["steps"]]
    # clipping and the hook saw unscaled gradients (the scale, 65536, would show in the norm)
    _state, want_norms = grad_worker.reference("64,32", 2, 24, 0.05, None)
    first = results[0]["steps"][0]
    assert first["norm"] == pytest.approx(want_norms[0], rel=1e-5)
    assert all(s["hook_norm"] == pytest.approx(s["norm"], rel=1e-6) for s in results[0]["steps"] if not s["skipped"])


_PEER = """
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
opts = dist.ProcessGroupGloo._Options()
opts._timeout = timedelta(seconds=30)
opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
pg = dist.ProcessGroupGloo(dist.FileStore(sys.argv[1], 2), 1, 2, opts)
pg.allreduce([torch.ones(4)]).wait()
sys.stdin.readline()  # the test says when to die
os._exit(9)
"""


def test_a_reduction_that_failed_is_seen_without_waiting_so_backward_can_stop(tmp_path):
    """collectives.first_failure (what a gradient hook asks through the path's failed()):
    a reduction still in flight is not taken for failed; once the peer is gone (its
    process died) the one in flight reports the reset connection, without a wait. And
    collectives.settled: in flight it is not, failed it is."""
    import subprocess
    import sys
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from eltctl_runtime.member import collectives

    store_path = str(tmp_path / "store")
    peer = subprocess.Popen([sys.executable, "-c", _PEER, store_path], stdin=subprocess.PIPE, text=True)
    try:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=30)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(dist.FileStore(store_path, 2), 0, 2, opts)
        done = pg.allreduce([torch.ones(4)])
        done.wait()
        assert collectives.first_failure([done]) == (1, None)
        pending = pg.allreduce([torch.ones(4)])  # the peer never joins this one
        time.sleep(0.2)
        assert collectives.first_failure([done, pending]) == (1, None)
        assert collectives.first_failure([done, None])[0] == 1  # a launch that failed
        assert collectives.first_failure([done, None])[1] is not None
        # settled (what a dropped step asks before it reuses its buffers): the one in flight may still write
        assert collectives.settled([done, None]) and not collectives.settled([done, pending])
        peer.stdin.write("die\n")
        peer.stdin.flush()
        peer.wait(30)
        deadline = time.monotonic() + 20
        while collectives.first_failure([done, pending])[1] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        at, error = collectives.first_failure([done, pending])
        assert at == 1 and isinstance(error, Exception) and "peer" in str(error).lower()
        assert collectives.settled([done, pending])  # failed: it writes nothing more
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


def test_the_replicated_path_keeps_a_dropped_steps_buffers_only_where_its_reductions_ended():
    """As the sharded path's (test_zero_reducer.py): w0 drops step 1 with its all-reduces in flight
    and redoes it at once on fresh buffers, while w1's late all-reduces (matched with w0's
    dropped ones) write into the old ones; w1 drops it after they ended and keeps its
    buffers. Both end with the gradients of one process on the global batch."""
    import threading

    import torch.distributed as dist
    from runtime_cluster import gloo_group, run_threads

    from eltctl_runtime.member import collectives
    from eltctl_runtime.train.gradients import ReplicatedPath

    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)

    init = threading.Lock()  # the ranks are threads: the global RNG that initialises the layer is shared

    def model():
        with init:  # (without it, one run in 5-20 gave a rank other weights than the reference's)
            torch.manual_seed(3)
            return torch.nn.Linear(5, 2).double()

    ref = model()
    ((ref(x) - y) ** 2).sum().backward()
    store, w0_redoing = dist.HashStore(), threading.Event()

    def rank(r: int) -> list[torch.Tensor]:
        pg = gloo_group(store, "g", r, 2)
        m = model()
        params = list(m.parameters())
        path = ReplicatedPath(params, bucket_mb=1.0)
        path.pg = pg
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: path.grad_ready(i, p))

        def backward() -> None:
            path.begin(4)
            ((m(x[r::2]) - y[r::2]) ** 2).sum().backward()
            path.end_backward()

        def dropped() -> None:
            path.drop()
            for p in params:
                p.grad = None  # as the job does after a drop

        if r == 0:
            backward()  # launched; w1 is not there yet
            old = list(path._flats)
            assert not collectives.settled(path._works)
            dropped()
            backward()  # the redo
            assert not {f.data_ptr() for f in path._flats} & {f.data_ptr() for f in old}
            w0_redoing.set()
            path.finish(None)
            assert any(f.abs().sum() > 0 for f in old), "the late all-reduces wrote into the old buffers"
        else:
            w0_redoing.wait(30)
            backward()
            for work in path._works:  # the buckets w0 dropped (the tail goes only with a finish)
                work.wait()
            kept = [f.data_ptr() for f in path._flats]
            dropped()
            backward()
            assert [f.data_ptr() for f in path._flats] == kept
            path.finish(None)
        return [p.grad.clone() for p in params]

    out = run_threads({r: (lambda r=r: rank(r)) for r in range(2)})
    for r in range(2):
        for g, p in zip(out[r], ref.parameters()):
            torch.testing.assert_close(g, p.grad)


def test_the_clipping_norm_is_summed_in_float64_and_both_paths_clip_alike():
    """Clipping sums the squares in float64 on both paths (gradients.add_squares). torch's
    float32 norm (clip_grad_norm_) on the CPU lost 1.1e-4 of the norm of the toy MLP's 8.6 M
    gradients, while the sharded path's was exact: at lr 3e-3, where that model's training
    is chaotic, a replicated run and a sharded one parted by 5 % of the loss by step 30.
    One world-1 step of each path on a 4 Mi-weight layer: the norm is the float64 one of
    the same gradient, the same on both, and the clipped step gives the same parameters
    bit for bit."""
    import torch.distributed as dist
    from runtime_cluster import gloo_group

    from eltctl_runtime.train.gradients import ReplicatedPath
    from eltctl_runtime.train.zero import Member, ShardedGradients, shard_layout

    x = torch.randn(32, 2048, generator=torch.Generator().manual_seed(1))

    def fresh():
        torch.manual_seed(0)
        m = torch.nn.Linear(2048, 2048)
        return m, torch.optim.SGD(m.parameters(), lr=0.5)

    def loss(m):
        return (m(x) ** 2).mean()

    ref, _ = fresh()
    loss(ref).backward()
    want = sum(float(torch.sum(p.grad.double() ** 2)) for p in ref.parameters()) ** 0.5
    assert want > 0.1  # max_norm 0.1 below: the clipping is active

    m1, opt1 = fresh()
    params1 = list(m1.parameters())
    path = ReplicatedPath(params1, bucket_mb=4.0)
    path.pg = gloo_group(dist.HashStore(), "r", 0, 1)
    for i, p in enumerate(params1):
        p.register_post_accumulate_grad_hook(lambda p, i=i: path.grad_ready(i, p))
    path.begin(4)
    loss(m1).backward()
    path.end_backward()
    path.finish(None)
    norm1 = path.clip_grad_norm_(0.1, None)
    opt1.step()

    m2, opt2 = fresh()
    params2 = list(m2.parameters())
    lay = shard_layout(params2, opt2, [Member("w0", "a")], 1, 4.0)
    sg = ShardedGradients(params2, opt2, lay, 0, "optimizer")
    sg.bind()
    with sg.attached():
        sg.begin(gloo_group(dist.HashStore(), "s", 0, 1))
        loss(m2).backward()
        sg.finish()
        norm2 = sg.step(0.1).grad_norm

    assert norm1 == pytest.approx(want, rel=1e-12) and norm2 == norm1
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_a_new_world_sizes_tail_reuses_the_flat_buffers_and_a_joiner_allocates_them_before_it_asks():
    """A membership change changes only the control tail's size (its per-rank slots): the
    gradients stay views of the same memory (a 200 MB model's buffers were reallocated,
    faulted in and copied into at every generation's first step), the reductions and the
    tail stay right, and a tail past the room left for it moves to new memory with the
    gradients' values. A joiner's prepare_join allocates the buffers its first step uses."""
    import threading

    import torch.distributed as dist
    from runtime_cluster import gloo_group, run_threads

    from eltctl_runtime.train.gradients import TAIL_ROOM, ReplicatedPath

    init = threading.Lock()

    def rank(r: int) -> list:
        pg = gloo_group(store, "g", r, 2)
        with init:
            torch.manual_seed(5)
            m = torch.nn.Linear(4, 3)
        params = list(m.parameters())
        path = ReplicatedPath(params, bucket_mb=1.0)
        path.pg = pg
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: path.grad_ready(i, p))
        seen = []

        def step(tail_size: int, x: torch.Tensor) -> torch.Tensor:
            path.begin(tail_size)
            m(x).sum().backward()
            path.end_backward()
            path.tail().fill_(r + 1)
            tail = path.finish(None)
            assert tail.numel() == tail_size and torch.all(tail == 3)  # 1 + 2 from the two ranks
            grads = [p.grad.clone() for p in params]
            seen.append([p.grad.data_ptr() for p in params])
            path.zero()
            return grads

        path.prepare_join(2, threading.Event())
        stores = [s.data_ptr() for s in path._stores]
        x = torch.full((2, 4), float(r + 1))
        out = [step(4, x)]
        assert [f.data_ptr() for f in path._flats] == stores  # the joiner's first step: what it prepared
        out.append(step(7, x))  # a world size more: a longer tail in the same memory
        assert seen[1] == seen[0]
        m.weight.grad.fill_(0.5)  # a gradient that must survive a move
        assert path._stores[0].numel() >= 2 * 7 + TAIL_ROOM  # room for a tail more than twice as long
        path.begin(path._stores[0].numel())  # past the room: new memory, the values copied in
        assert [f.data_ptr() for f in path._flats] != stores
        assert torch.all(m.weight.grad == 0.5)
        path.end_backward()
        return out

    store = dist.HashStore()
    out = run_threads({r: (lambda r=r: rank(r)) for r in range(2)})
    for r in range(2):
        for grads in out[r]:
            # d(sum(W x + b))/dW = the summed inputs over both ranks: 2*1 + 2*2 = 6 per entry
            assert torch.all(grads[0] == 6) and torch.all(grads[1] == 4)

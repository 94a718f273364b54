"""Where a step's time goes (issue 51), on the worker's side: the replicated path's
per-step figures (gradients.StepTiming: the wait in `finish`, the bytes all-reduced),
their smoothing into the status record (records.NetworkFigures), and what rank 0's
status document of a real two-worker job (gloo) must carry (`assert_network_figures`,
called by test_elastic_scenarios.py on a job it runs anyway)."""

from __future__ import annotations

import threading

import pytest
import torch

from eltctl_runtime.train.gradients import ReplicatedPath, StepTiming
from eltctl_runtime.train.records import NETWORK_ALPHA, NetworkFigures
from eltctl_runtime.train.tail import layout as tail_layout


def test_network_figures_smooth_the_steps_and_say_the_networks_share():
    f = NetworkFigures()
    assert f.fields() == {}  # before a step: no `network` in the status
    f.observed(0.5, None)  # a path that does not measure (sharded): nothing recorded
    assert f.fields() == {}
    f.observed(0.6, StepTiming(wait_s=1.2, bytes=1000))
    assert f.fields() == {"network": {"wait_s": 1.2, "compute_s": 0.6, "share": 0.6667, "bytes_per_step": 1000}}
    f.observed(1.6, StepTiming(wait_s=0.2, bytes=1004))
    a = NETWORK_ALPHA
    wait, compute = 1.2 + a * (0.2 - 1.2), 0.6 + a * (1.6 - 0.6)
    assert f.fields()["network"] == {"wait_s": round(wait, 6), "compute_s": round(compute, 6),
                                     "share": round(wait / (wait + compute), 4), "bytes_per_step": 1004}
    g = NetworkFigures()
    g.observed(0.0, StepTiming(wait_s=0.0, bytes=8))  # a rank with no samples, nothing to wait for
    assert g.fields()["network"]["share"] == 0.0


@pytest.mark.parametrize("dtypes, grad_dtype", [
    ((torch.float64, torch.float32), None),  # the last bucket is float32: the tail rides with it
    ((torch.float32, torch.float64), None),  # the last bucket is float64: the tail is its own all-reduce
    ((torch.float64, torch.float32), "bf16"),  # float32 buckets go as bfloat16: 2 bytes each on the wire
])
def test_the_replicated_path_times_its_wait_and_counts_every_byte_it_all_reduces(dtypes, grad_dtype):
    import torch.distributed as dist
    from runtime_cluster import gloo_group, run_threads

    tail_size = 7
    store = dist.HashStore()

    def rank(r: int) -> StepTiming:
        pg = gloo_group(store, "net", r, 2)
        m = torch.nn.Sequential(torch.nn.Linear(5, 4).to(dtypes[0]), torch.nn.Linear(4, 3).to(dtypes[1]))
        params = list(m.parameters())
        path = ReplicatedPath(params, bucket_mb=1e-4, grad_dtype=grad_dtype)  # 104-byte buckets: several launches
        path.pg = pg
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: path.grad_ready(i, p))
        assert path.last_step_timing is None  # nothing before a step
        path.begin(tail_size)
        m[1](m[0](torch.randn(2, 5, dtype=dtypes[0])).to(dtypes[1])).sum().backward()
        path.end_backward()
        path.tail().fill_(1.0)
        summed = path.finish(threading.Event())
        assert summed.tolist() == [2.0] * tail_size
        return path.last_step_timing

    got = run_threads({"w0": lambda: rank(0), "w1": lambda: rank(1)})
    def wire(dtype: torch.dtype) -> int:
        return 2 if grad_dtype == "bf16" and dtype == torch.float32 else dtype.itemsize

    want = (5 * 4 + 4) * wire(dtypes[0]) + (4 * 3 + 3) * wire(dtypes[1]) + tail_size * 4
    for timing in got.values():
        assert isinstance(timing, StepTiming) and timing.bytes == want and timing.wait_s >= 0.0


def assert_network_figures(status: dict, world: int) -> None:
    """Rank 0's status document from a real job of examples/train.py with SMALL's model
    (replicated, gloo): its `network` has a compute time, a share in [0, 1] and exactly
    the model's gradient bytes plus the float32 control tail (the toy model has no
    buffers). The job's end-to-end tests call it on a finished job's status
    (test_elastic_scenarios.py: test_micro_batches_accumulate_to_the_same_training)."""
    import examples.toy as toy
    from runtime_cluster import SMALL

    net = status["network"]
    model = toy.make_model(hidden=int(SMALL[SMALL.index("--hidden") + 1]),
                           layers=int(SMALL[SMALL.index("--layers") + 1]))
    assert not list(model.buffers())  # no buffers' updates in the tail
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert net["bytes_per_step"] == grad_bytes + tail_layout(world).size * 4, net
    assert net["compute_s"] > 0 and net["wait_s"] >= 0 and 0.0 <= net["share"] <= 1.0, net

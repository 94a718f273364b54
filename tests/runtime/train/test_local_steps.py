"""Local steps (`ElasticJob(sync="local", sync_every=H)`, train/local.py): inner steps on
each rank's own gradient, a samples-weighted average of the deltas and an outer step at
each round's end, and the job's elastic life around the rounds."""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace

import pytest
import torch

import eltctl_runtime as elt
from eltctl_runtime.train import local
from eltctl_runtime.train.records import NetworkFigures
from eltctl_runtime.train.tail import Control, layout as tail_layout
from runtime_cluster import gloo_group, run_threads

INNER_LR = 0.1
MODEL_KEYS = ("0.weight", "0.bias", "2.weight", "2.bias")
DATA_X = torch.randn(64, 6, generator=torch.Generator().manual_seed(3))
DATA_Y = DATA_X @ torch.randn(6, 2, generator=torch.Generator().manual_seed(4))


def make_model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def mean_loss(model: torch.nn.Module, idx: list[int]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(DATA_X[idx]), DATA_Y[idx])


def thread_rank(init: threading.Lock, r: int) -> tuple:
    """A thread rank's model, its parameters, its inner SGD and the job view LocalPath reads."""
    with init:
        model = make_model()
    params = list(model.parameters())
    inner = torch.optim.SGD(params, lr=INNER_LR)
    job = SimpleNamespace(model=model, _params=params, _extra={}, _status=SimpleNamespace(network=NetworkFigures()),
                          _step=0, worker_id=f"w{r}")
    job._progress = lambda: {"step": job._step, "epoch": 0, "position": 0}
    return model, params, inner, job


def by_hand(shares: list[list[list[int]]], H: int, rounds: int, lag: int | None = None, bf16: bool = False,
            weights: tuple[int, int] = (3, 7)) -> list[dict]:
    """Local steps by hand, two ranks with `weights` samples a step: after each round, the
    global parameters (the outer Nesterov step from the round's start along the
    samples-weighted mean delta) and each rank's own (with `lag`, sync_overlap: the steps
    taken during the overlap on top of the new start). `bf16`: each rank's weighted delta
    rounded to bfloat16 and the sum rounded again, as roundwire.py's wire does."""
    start = [p.detach().clone() for p in make_model().parameters()]
    own, momentum, taken, out = [start, start], None, 0, []  # taken: the steps already in `own`
    for k in range(rounds):
        end = (k + 1) * H
        ends = [local_sgd(own[r], shares[r][taken:end]) for r in range(2)]
        if bf16:
            wire = [[((s - e) * (w * H)).to(torch.bfloat16) for s, e in zip(start, ends[r])]
                    for r, w in enumerate(weights)]
            delta = [(a.float() + b.float()).to(torch.bfloat16).float() / (sum(weights) * H) for a, b in zip(*wire)]
        else:
            delta = [(weights[0] * (s - e0) + weights[1] * (s - e1)) / sum(weights) for s, e0, e1 in zip(start, *ends)]
        start, momentum = outer_nesterov(start, momentum, delta)
        if lag:
            meanwhile = [local_sgd(ends[r], shares[r][end:end + lag]) for r in range(2)]
            own, taken = [[s + (m - e) for s, m, e in zip(start, meanwhile[r], ends[r])] for r in range(2)], end + lag
        else:
            own, taken = [start, start], end
        out.append({"global": start, "own": own})
    return out


def run_ranks(shares: list[list[list[int]]], sync_every: int, outer, rounds: int, lag: int | None = None,
              grad_dtype: str | None = None, leave_wire: bool = False) -> list[dict]:
    """Each rank (a thread, gloo) runs LocalPath as ElasticJob does: backward of the local mean
    loss scaled by n / global_count, the tail with its sample count, finish, the inner SGD step,
    and the round's averaging after every `sync_every` steps. `shares[r][t]`: rank r's indices
    at step t. Returns each rank's parameters after each round, its fingerprint and inner steps.
    `lag` (sync_overlap): each round's averaging is launched at its end and merged `lag` steps
    later (1 to sync_every: at the next round's end), after the step whose tail says every
    rank's is done (each rank waits for its all-reduce before that step's tail, so the merge's
    step is the test's, not the machine's timing); `after` then holds, at each merge, the
    global parameters (the new round start) and this rank's own. `leave_wire`: each launch goes
    on the wire a planned leave's averaging takes (LocalPath.at_boundary: roundwire.leave_dtype)."""
    store = torch.distributed.HashStore()
    init = threading.Lock()  # the ranks are threads: the global RNG is shared

    def rank(r: int) -> dict:
        model, params, inner, job = thread_rank(init, r)
        path = local.LocalPath(job, sync_every, outer, overlap=lag is not None, grad_dtype=grad_dtype)
        path.bind(gloo_group(store, "l", r, 2), r, ["a", "b"], threading.Event())
        path.start_round()
        lay = tail_layout(2)
        after, launched = [], 0
        for t in range(sync_every * rounds + (lag or 0)):
            idx = shares[r][t]
            total = len(idx) + len(shares[1 - r][t])
            merge = path.in_flight and t + 1 == launched + lag
            if merge:
                path._wire.wait(None)  # done before this step's tail: the tail says so, the boundary merges
            path.begin(lay.size)
            # a queued joiner is admitted only where the round ends anyway (the step now committed is its H-th)
            assert path.ready_for_join(3) == ((t + 1) % sync_every == 0), t
            (mean_loss(model, idx) * (len(idx) / total)).backward()
            path.end_backward()
            path.tail().copy_(lay.encode(r, Control(False, False, len(idx), 0.0, False, False, False, False, 0.0, 0)))
            summed = path.finish(threading.Event())
            assert lay.decode(summed).samples == total
            if merge:
                assert path.merge_due  # every rank's all-reduce done before this step's tail: its field says so
            elif not path.in_flight:
                assert not path.merge_due
            path.step(inner, None, threading.Event())
            path.zero()
            job._step = t + 1
            if merge:
                path.merge(threading.Event())
                start = path.capture(model, inner, job._progress(), {})["model"]
                after.append({"global": [start[k].clone() for k in MODEL_KEYS],
                              "own": [p.detach().clone() for p in params]})
            if (t + 1) % sync_every or t + 1 > sync_every * rounds:
                continue
            if lag is not None:
                assert not path.in_flight  # never two in flight: merged at the latest here
                path.launch(path._leave_rwire if leave_wire else None)
                launched = t + 1
                continue
            path.average(threading.Event())
            path.start_round()
            after.append([p.detach().clone() for p in params])
        return {"after": after, "fingerprint": path.fingerprint(model, inner, {}), "mode": job._status.network.mode,
                "round_bytes": path._round_bytes}

    return [v for _k, v in sorted(run_threads({r: (lambda r=r: rank(r)) for r in range(2)}).items())]


def shares_of(seed: int, steps: int, split: int = 3, per_step: int = 10) -> list[list[list[int]]]:
    """Rank 0 takes `split` of each step's `per_step` samples, rank 1 the rest (the data
    reshuffled when used up)."""
    order = torch.randperm(64, generator=torch.Generator().manual_seed(seed)).tolist() * (1 + steps * per_step // 64)
    return [[order[per_step * t:per_step * t + split] for t in range(steps)],
            [order[per_step * t + split:per_step * (t + 1)] for t in range(steps)]]


def local_sgd(params: list[torch.Tensor], steps: list[list[int]]) -> list[torch.Tensor]:
    """By hand: plain SGD on the local mean loss of each step's indices, from `params`."""
    model = make_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    for idx in steps:
        grads = torch.autograd.grad(mean_loss(model, idx), list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= INNER_LR * g
    return [p.detach().clone() for p in model.parameters()]


def test_a_round_steps_the_outer_nesterov_sgd_on_the_samples_weighted_mean_delta():
    """Rank 0 takes 3 samples a step, rank 1 takes 7: after each round of 3 steps the
    parameters are the paper's outer step (SGD lr 0.7, Nesterov momentum 0.9) from the
    round's start along (3 d0 + 7 d1) / 10, d_r the rank's own delta after 3 local SGD steps,
    computed here by hand; two rounds (the second uses the momentum). Identical on both ranks
    (bit for bit, and their fingerprints); float tolerance 1e-6 against the hand computation."""
    H = 3
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    shares = [[order[10 * t:10 * t + 3] for t in range(2 * H)], [order[10 * t + 3:10 * t + 10] for t in range(2 * H)]]
    out = run_ranks(shares, H, None, rounds=2)
    assert out[0]["mode"] == {"mode": "local", "sync_every": H}
    for a, b in zip(out[0]["after"], out[1]["after"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert out[0]["fingerprint"] == out[1]["fingerprint"]

    start = [p.detach().clone() for p in make_model().parameters()]
    momentum = None
    for k in range(2):
        ends = [local_sgd(start, shares[r][k * H:(k + 1) * H]) for r in range(2)]
        delta = [(3 * H * (s - e0) + 7 * H * (s - e1)) / (10 * H) for s, e0, e1 in zip(start, *ends)]
        momentum = delta if momentum is None else [0.9 * m + d for m, d in zip(momentum, delta)]
        start = [s - 0.7 * (d + 0.9 * m) for s, d, m in zip(start, delta, momentum)]
        moved = max(float((s - e).abs().max()) for s, e in zip(start, ends[0]))
        assert moved > 1e-3  # the outer step is not one rank's own result
        for got, want in zip(out[0]["after"][k], start):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lag", [None, 2], ids=["synchronous", "overlapped"])
def test_bf16_averaging_sends_the_weighted_deltas_as_bfloat16_and_keeps_the_counts_exact(lag):
    """grad_dtype="bf16" (roundwire.py): each rank's s_r * d_r goes on the wire as bfloat16
    and is summed in bfloat16; the sample counts (3 + 7 per step) stay exact float32. Against
    the hand computation that rounds the same way (float tolerance), two rounds, with and
    without the overlap; half the bytes of the float32 averaging; the fp32 result differs."""
    H = 3
    shares = shares_of(0, 2 * H + (lag or 0))
    out = run_ranks(shares, H, None, rounds=2, lag=lag, grad_dtype="bf16")
    fp32 = run_ranks(shares, H, None, rounds=2, lag=lag)
    assert out[0]["mode"]["grad_dtype"] == "bf16" and "grad_dtype" not in fp32[0]["mode"]
    numel = sum(p.numel() for p in make_model().parameters())
    assert out[0]["round_bytes"] == numel * 2 + 4 and fp32[0]["round_bytes"] == (numel + 1) * 4
    assert out[0]["fingerprint"] == out[1]["fingerprint"]
    for k, want in enumerate(by_hand(shares, H, 2, lag, bf16=True)):
        got = out[0]["after"][k]["global"] if lag else out[0]["after"][k]
        for g, w in zip(got, want["global"]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    want32 = fp32[0]["after"][1]["global"] if lag else fp32[0]["after"][1]
    assert max(float((g - w).abs().max()) for g, w in zip(got, want32)) > 1e-6  # bf16 rounds: not fp32's bits


def test_a_planned_leaves_averaging_travels_in_bf16_unless_fp32_was_asked_for():
    """roundwire.leave_dtype: a leave's averaging (launched at its boundary, merged later) goes
    as bfloat16 by default, the hand computation's bf16 rounding; with grad_dtype="fp32" it
    is the float32 averaging, bit for bit; with "bf16" it is the job's own wire."""
    H, lag = 3, 2
    shares = shares_of(0, 2 * H + lag)
    leave = run_ranks(shares, H, None, rounds=2, lag=lag, leave_wire=True)
    assert "grad_dtype" not in leave[0]["mode"]  # the rounds themselves stay float32
    numel = sum(p.numel() for p in make_model().parameters())
    assert leave[0]["round_bytes"] == numel * 2 + 4
    assert leave[0]["fingerprint"] == leave[1]["fingerprint"]
    for k, want in enumerate(by_hand(shares, H, 2, lag, bf16=True)):
        for g, w in zip(leave[0]["after"][k]["global"], want["global"]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    fp32 = run_ranks(shares, H, None, rounds=2, lag=lag, grad_dtype="fp32", leave_wire=True)
    plain = run_ranks(shares, H, None, rounds=2, lag=lag)
    assert fp32[0]["round_bytes"] == (numel + 1) * 4
    assert all(torch.equal(a, b) for a, b in zip(fp32[0]["after"][1]["global"], plain[0]["after"][1]["global"]))
    _model, _params, _inner, job = thread_rank(threading.Lock(), 0)
    bf16 = local.LocalPath(job, H, None, grad_dtype="bf16")
    assert bf16._leave_rwire is bf16._rwire and bf16._rwire.dtype == torch.bfloat16  # one bf16 wire, one kept body


def outer_nesterov(start, momentum, delta):
    """The paper's outer step by hand (SGD lr 0.7, Nesterov momentum 0.9): new start, momentum."""
    momentum = delta if momentum is None else [0.9 * m + d for m, d in zip(momentum, delta)]
    return [s - 0.7 * (d + 0.9 * m) for s, d, m in zip(start, delta, momentum)], momentum


@pytest.mark.parametrize("lag", [1, 3])
def test_an_overlapped_averaging_merges_late_and_keeps_the_steps_taken_meanwhile(lag):
    """sync_overlap, rounds of 3 steps, shares of 3 and 7 samples: each round's averaging is
    launched at its end and merged `lag` steps later (3: at the next round's end). By hand:
    the global parameters after each merge are the outer Nesterov step from the round's start
    along the samples-weighted mean delta (as without overlap), and each rank's own parameters
    are those plus its progress since the round's end; the next round's delta is taken from
    the new start and includes those steps. Two rounds, within 1e-6; the global parameters
    and the fingerprints identical on both ranks, bit for bit."""
    H = 3
    shares = shares_of(0, 2 * H + lag)
    out = run_ranks(shares, H, None, rounds=2, lag=lag)
    assert out[0]["mode"] == {"mode": "local", "sync_every": H, "sync_overlap": True}
    for a, b in zip(out[0]["after"], out[1]["after"]):
        assert all(torch.equal(x, y) for x, y in zip(a["global"], b["global"]))
    assert out[0]["fingerprint"] == out[1]["fingerprint"]

    for k, want in enumerate(by_hand(shares, H, 2, lag)):
        for r in range(2):
            got = out[r]["after"][k]
            for x, w in zip(got["global"], want["global"]):
                torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-6)
            for x, w in zip(got["own"], want["own"][r]):
                torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-6)
            assert max(float((x - g).abs().max()) for x, g in zip(got["own"], got["global"])) > 1e-3


@pytest.mark.parametrize("lag", [1, 2])
def test_the_overlap_costs_little_loss_against_the_synchronous_averaging(lag):
    """The same samples (8 rounds of 8 steps, shares of 3 and 7), outer SGD lr 0.7: the global
    parameters' loss on the whole data set with each round's averaging merged 1 or 2 steps
    late is within 5 % of the synchronous averaging's (measured: -0.4 % and +0.9 %; with the
    paper's Nesterov momentum 0.9 this small model's loss swings by tens of % between
    neighbouring settings, synchronous or not, so it tells nothing here: docs/network.md)."""
    H, rounds = 8, 8
    outer = lambda params: torch.optim.SGD(params, lr=0.7)  # noqa: E731
    shares = shares_of(5, H * rounds + lag)
    sync = run_ranks(shares, H, outer, rounds=rounds)[0]["after"][-1]
    late = run_ranks(shares, H, outer, rounds=rounds, lag=lag)[0]["after"][-1]["global"]
    start = [p.detach().clone() for p in make_model().parameters()]

    def loss(params) -> float:
        model = make_model()
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.copy_(v)
            return float(mean_loss(model, list(range(64))))

    first, a, b = loss(start), loss(sync), loss(late)
    assert a < 0.1 * first and b < 0.1 * first, (first, a, b)  # both trained
    assert abs(b - a) <= 0.05 * a, (first, a, b)


def test_one_step_rounds_with_plain_outer_sgd_are_synchronous_sgd():
    """H=1, outer SGD lr 1 without momentum, inner SGD: the new parameters are the start
    minus lr times the samples-weighted mean of the ranks' local mean gradients, the gradient
    of the global mean loss: plain synchronous SGD on the global batches (uneven shares),
    within float tolerance (rtol 1e-5, atol 1e-6) over 6 steps."""
    order = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    shares = [[order[8 * t:8 * t + 2] for t in range(6)], [order[8 * t + 2:8 * t + 8] for t in range(6)]]
    out = run_ranks(shares, 1, lambda params: torch.optim.SGD(params, lr=1.0), rounds=6)
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    for t in range(6):
        sgd.zero_grad()
        mean_loss(model, shares[0][t] + shares[1][t]).backward()
        sgd.step()
        for got, want in zip(out[0]["after"][t], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    assert out[0]["fingerprint"] == out[1]["fingerprint"]


class JobView:
    """What LocalPath reads of its ElasticJob, for a path driven by hand on one rank."""

    def __init__(self, model: torch.nn.Module, extra: dict) -> None:
        from eltctl_runtime.train.gradients import BufferSync

        self.model, self._params, self._extra = model, list(model.parameters()), extra
        self._status = SimpleNamespace(network=NetworkFigures())
        self._buffers = BufferSync(model)
        self._step, self._position, self.worker_id = 0, 0, "w"

    def _progress(self) -> dict:
        return {"step": self._step, "epoch": 0, "position": self._position, "generation": 0}

    def _set_progress(self, p: dict) -> None:
        self._step, self._position = int(p["step"]), int(p["position"])


def _one_rank_step(path, model, inner, sched, job, indices: list[int]) -> None:
    """One committed step of a one-rank LocalPath on the samples `indices` (8 of them), the
    scheduler stepped after it as a script's loop does."""
    lay = tail_layout(1)
    path.begin(lay.size)
    mean_loss(model, indices).backward()
    path.tail().copy_(lay.encode(0, Control(False, False, len(indices), 0.0, False, False, False, False, 0.0, 0)))
    path.finish(threading.Event())
    path.step(inner, None, threading.Event())
    path.zero()
    sched.step()
    job._step, job._position = job._step + 1, job._position + len(indices)


def test_mid_round_the_state_captured_is_the_rounds_start_and_an_abort_rolls_back_to_it():
    """One rank, two inner steps into a round: capture (what a checkpoint written then, e.g.
    at a store loss, would hold) is the round's start (parameters, progress, the scheduler's
    state) with the outer optimizer's state; roll_back puts the parameters, the step count,
    the position and the scheduler back there; a state applied from elsewhere is captured
    as it is until a round starts from it."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    job = JobView(model, {"sched": sched})
    path = local.LocalPath(job, 4, None)
    path.bind(gloo_group(torch.distributed.HashStore(), "one", 0, 1), 0, ["a"], threading.Event())
    job._step, job._position = 8, 96
    path.start_round()
    start = [p.detach().clone() for p in model.parameters()]
    for t in range(2):
        _one_rank_step(path, model, inner, sched, job, list(range(8 * t, 8 * t + 8)))
    assert not torch.equal(next(model.parameters()), start[0])
    saved = path.capture(model, inner, job._progress(), job._extra)
    assert all(torch.equal(saved["model"][k], v) for k, v in zip(("0.weight", "0.bias", "2.weight", "2.bias"), start))
    assert saved["progress"]["step"] == 8 and saved["progress"]["position"] == 96
    assert saved["extra_state"]["sched"]["last_epoch"] == 0 and local.OUTER_KEY in saved
    path.roll_back()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    assert (job._step, job._position, sched.state_dict()["last_epoch"]) == (8, 96, 0)
    other = {**saved, "model": {k: v + 1 for k, v in saved["model"].items()}}
    path.apply(other, model, inner, job._extra)
    assert torch.equal(path.capture(model, inner, job._progress(), job._extra)["model"]["0.bias"], start[1] + 1)


def test_an_abort_with_an_averaging_in_flight_rolls_back_to_the_last_merged_start():
    """sync_overlap on one rank, rounds of 2 steps from step 8: with the round's averaging in
    flight and a step taken meanwhile, what a checkpoint would hold, the fingerprint and an
    abort's roll-back are the last MERGED start (step 8: parameters, position, scheduler), so
    the unmerged round and the step after it are served again; once merged, the merged start
    is the round's end (step 10) with the outer step's parameters, and a later roll-back goes
    there, dropping only the steps since."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    job = JobView(model, {"sched": sched})
    path = local.LocalPath(job, 2, None, overlap=True)
    path.bind(gloo_group(torch.distributed.HashStore(), "one", 0, 1), 0, ["a"], threading.Event())
    job._step, job._position = 8, 96
    path.start_round()
    start = [p.detach().clone() for p in model.parameters()]
    fingerprint = path.fingerprint(model, inner, job._extra)

    def steps(n: int) -> None:
        for _ in range(n):
            _one_rank_step(path, model, inner, sched, job, list(range(8)))

    def merged_start() -> tuple:
        saved = path.capture(model, inner, job._progress(), job._extra)
        return ([saved["model"][k] for k in MODEL_KEYS], saved["progress"]["step"], saved["progress"]["position"],
                saved["extra_state"]["sched"]["last_epoch"])

    steps(2)
    path.launch()  # the round [8, 10) ends: its averaging on the wire
    steps(1)
    assert path.in_flight
    params, step, position, epoch = merged_start()
    assert all(torch.equal(p, s) for p, s in zip(params, start)) and (step, position, epoch) == (8, 96, 0)
    assert path.fingerprint(model, inner, job._extra) == fingerprint
    path.roll_back()
    assert not path.in_flight
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    assert (job._step, job._position, sched.state_dict()["last_epoch"]) == (8, 96, 0)

    steps(2)
    path.launch()
    steps(1)
    path.merge(threading.Event())
    params, step, position, epoch = merged_start()
    assert (step, position, epoch) == (10, 112, 2) and not torch.equal(params[0], start[0])
    assert path.fingerprint(model, inner, job._extra) != fingerprint
    path.roll_back()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), params))
    assert (job._step, job._position, sched.state_dict()["last_epoch"]) == (10, 112, 2)


@pytest.mark.parametrize("steps, flight, asks, plan", [
    (2, {}, {}, (False, None)),  # mid-round, nothing in flight
    (2, {"in_flight": True}, {}, (False, None)),  # mid-round, a rank's averaging not done: train on
    (2, {"in_flight": True, "all_done": True}, {}, (True, None)),  # every rank's done: merge here
    (4, {}, {}, (False, local.LAUNCH)),  # a natural end: its averaging on the wire
    (4, {"in_flight": True}, {}, (True, local.LAUNCH)),  # not done by the next end: wait, merge, launch
    (2, {"in_flight": True}, {"change": True}, (True, local.AVERAGE)),  # a join, leave, yield: merge, then end
    (2, {"in_flight": True}, {"stop": True}, (True, local.AVERAGE)),
    (2, {}, {"checkpoint": True}, (False, local.AVERAGE)),  # a checkpoint holds merged state only
    (4, {}, {"done": True}, (False, local.AVERAGE)),  # the job's end
    (4, {"catching_up": True}, {}, (False, local.AVERAGE)),  # a joiner catches up: synchronous rounds
    (4, {"overlap": False}, {}, (False, local.AVERAGE)),  # sync_overlap off: as before
    # a planned leave some member survives: the leaver's partial round goes on the wire, nobody waits for it
    (2, {"overlap": False}, {"change": True, "leave": True}, (False, local.LAUNCH)),
    (2, {"in_flight": True}, {"change": True, "leave": True}, (True, local.LAUNCH)),  # never two in flight
    (2, {"overlap": False}, {"change": True, "leave": True, "checkpoint": True}, (False, local.AVERAGE)),
    (2, {"overlap": False, "catching_up": True}, {"change": True, "leave": True}, (False, local.AVERAGE)),
    (2, {"overlap": False}, {"change": True}, (False, local.AVERAGE)),  # a join: a merged round start for it
])
def test_what_a_step_boundary_does_with_an_overlapped_averaging(steps, flight, asks, plan):
    kw = {"in_flight": False, "all_done": False, "overlap": True, "catching_up": False, "stop": False,
          "change": False, "checkpoint": False, "done": False, **flight, **asks}
    assert local.boundary_plan(steps, 4, **kw) == plan


@pytest.mark.parametrize("steps, H, asks, ends", [
    (0, 4, {}, False),  # nothing trained in the round: nothing to average
    (3, 4, {}, False),
    (4, 4, {}, True),  # the natural end
    (1, 4, {"stop": True}, True),
    (1, 4, {"change": True}, True),  # a join, a planned leave, an owner's yield
    (2, 4, {"checkpoint": True}, True),
    (2, 4, {"done": True}, True),
    (0, 4, {"change": True}, False),
])
def test_where_a_round_ends(steps, H, asks, ends):
    kw = {"stop": False, "change": False, "checkpoint": False, "done": False, **asks}
    assert local.round_ends(steps, H, **kw) is ends


@pytest.mark.parametrize("committing, H, step_s, now", [
    (16, 16, 0.7, True),  # the round's natural end: admitted there, at no extra averaging
    (17, 16, 0.7, True),  # past it (a rank saw the joiner a step late)
    (1, 16, 0.7, False),  # 15 steps of 0.7 s to the end: held for it
    (15, 16, None, False),  # the pace not measured yet: held
    (1, 500, 0.3, True),  # 150 s to the end: the round ends early for the joiner
    (400, 500, 0.3, False),  # 30 s to the end: held
    (1, 10000, 0.05, True),
])
def test_a_joiner_waits_for_the_rounds_end_unless_it_is_far(committing, H, step_s, now):
    assert local.JOIN_HOLD_MAX_S == 60.0
    assert local.join_now(committing, H, step_s) is now


def test_bad_sync_settings_are_refused_naming_the_fix():
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.zeros(4, 2))

    def job(**kw):
        return elt.ElasticJob(model, sgd, data, global_batch_size=2, max_steps=1, **kw)

    with pytest.raises(ValueError, match=r"sync must be one of 'steps', 'local', got 'diloco'"):
        job(sync="diloco")
    with pytest.raises(ValueError, match=r"sync='local' needs sync_every=H"):
        job(sync="local")
    with pytest.raises(ValueError, match=r"sync_every and outer_optimizer apply to local steps"):
        job(sync_every=5)
    with pytest.raises(ValueError, match=r"sync_overlap applies to local steps: pass sync='local', sync_every=H"):
        job(sync_overlap=True)
    with pytest.raises(ValueError, match=r"sync_overlap must be True or False, got 'yes'"):
        job(sync="local", sync_every=2, sync_overlap="yes")
    with pytest.raises(ValueError, match=r"outer_optimizer must be a callable params -> optimizer"):
        job(sync="local", sync_every=2, outer_optimizer=sgd)
    with pytest.raises(ValueError, match=r"outer_optimizer\(params\) returned a list, not an optimizer"):
        job(sync="local", sync_every=2, outer_optimizer=list)
    for kw in ({"shard": "optimizer"}, {"shard": "gradients", "reduce_each_micro_batch": True},
               {"compress": "powersgd"}):
        with pytest.raises(ValueError, match=r"sync='local' does not compose with (shard|compress)="):
            job(sync="local", sync_every=2, **kw)
    with pytest.raises(ValueError, match=r"grad_dtype must be None or one of .fp32., .bf16., got .fp16."):
        job(sync="local", sync_every=2, grad_dtype="fp16")
    assert job(sync="local", sync_every=2, grad_dtype="bf16")._rounds._rwire.dtype == torch.bfloat16  # roundwire.py
    assert isinstance(job(sync="local", sync_every=2)._grads, local.LocalPath)
    assert job(sync="local", sync_every=2, sync_overlap=True)._rounds.overlap
    assert not job(sync="local", sync_every=2)._rounds.overlap  # the default: the paper's synchronous averaging
    assert job()._rounds is None  # the default: the replicated path, no rounds
    with pytest.raises(ValueError, match=r"inner_batch applies to local steps: pass sync='local', sync_every=H"):
        job(inner_batch=4)
    for bad in (0, -1, True, 2.5, "4"):
        with pytest.raises(ValueError, match=r"inner_batch must be a positive integer"):
            job(sync="local", sync_every=2, inner_batch=bad)
    assert job(sync="local", sync_every=2, inner_batch=4)._rounds.inner.inner_batch == 4
    assert job(sync="local", sync_every=2)._rounds.inner.inner_batch is None  # the default: one inner step a step


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_local_steps_through_restore_join_leave_and_sigkill(cluster_factory, overlap):
    """Real processes, rounds of 4 steps: 2 workers, both SIGKILLed -> 2 restored from the
    newest checkpoint -> 3 (join) -> 2 (planned leave) -> 3 (join) -> 2 (SIGKILL of a member,
    mid-round: the survivors go back to the round's start and redo it) -> stop. Every
    committed step's samples exactly once (a redone step counts in its newest generation),
    the same state on both survivors at the end (a round's end: without the roll-back their
    parameters would differ from the crash on), the status names the mode, and the loss
    went down. `overlapped` (sync_overlap): each round's averaging merged at a later step
    (the survivors' logs say so), the changes merging the one in flight first, the SIGKILL
    rolling back to the last merged round's start; its ranks also take inner steps of 8
    samples (inner_batch: several inner steps in each step of the 64-sample global batch)
    and average in bf16 (grad_dtype)."""
    from tests.runtime.train.test_elastic_scenarios import FOREVER, finish

    args = FOREVER + ["--sync-every", "4", "--checkpoint-every", "7"] + (["--sync-overlap", "--inner-batch", "8",
                                                                            "--grad-dtype", "bf16"]
                                                                         if overlap else [])
    cl = cluster_factory(min_workers=2)
    a, b = cl.start(2, args)
    cl.wait_step(9)
    cl.kill(a)
    cl.kill(b)
    cl.wait_exit([a, b])
    c, d = cl.start(2, args)
    g = cl.wait_world(2, steps_after=3)
    (e,) = cl.start(1, args)
    g = cl.wait_world(3, min_gen=g + 1, steps_after=5)
    status = cl.wait_for_status(lambda s: s.get("world_size") == 3 and "network" in s)
    assert status["network"]["mode"] == "local" and status["network"]["sync_every"] == 4, status
    assert status["network"].get("inner_batch") == (8 if overlap else None), status
    assert status["network"].get("grad_dtype") == ("bf16" if overlap else None), status
    cl.leave(d)
    g = cl.wait_world(2, min_gen=g + 1, steps_after=3)
    (f,) = cl.start(1, args)
    g = cl.wait_world(3, min_gen=g + 1, steps_after=6)
    cl.kill(f)
    cl.wait_world(2, min_gen=g + 1, steps_after=6)
    results = finish(cl, None, [c, d, e], 2)
    kinds = [ev["kind"] for ev in cl.events()]
    assert kinds[0] == "start" and {"restore", "join", "leave", "crash"} <= set(kinds), kinds
    first = float(a.progress.read_text().splitlines()[0].split()[4])
    assert results[0]["loss"] < first, (first, results[0]["loss"])
    merged = [w for w in (c, d, e) if re.search(r"the averaging of the round ending at step \d+ merged at step",
                                                 w.log_text())]
    assert bool(merged) is overlap, [w.log_text()[-2000:] for w in (c, d, e)]
    # d's planned leave: unless a checkpoint fell due at its boundary (then the averaging is synchronous), its
    # round went on the wire as the survivors trained on, and they merged it at a later boundary
    for w in (c, e):
        launched = re.search(r"the round ending at step (\d+) is averaged on the wire( in bfloat16)? while the job goes on",
                             w.log_text())
        if launched:
            assert launched.group(2), launched.group(0)  # a leave's averaging goes as bfloat16 (roundwire.leave_dtype)
            assert f"the averaging of the round ending at step {launched.group(1)} (a planned leave's) merged" in \
                w.log_text(), w.log_text()[-3000:]


def test_a_leaves_memory_is_touched_ahead_on_a_helper_thread_and_handed_to_the_launch_once():
    """roundwire.LeaveMemory through LocalPath.ready_for_leave: from the first call a helper
    allocates what a leave's launch writes (the round's-end parameters, the bf16 body); a
    leave waits for it; then the path holds it, and later calls allocate nothing more.
    Off the CPU nothing is allocated and a leave never waits."""
    import time

    from eltctl_runtime.train.roundwire import LeaveMemory, RoundWire

    _model, params, _inner, job = thread_rank(threading.Lock(), 0)
    path = local.LocalPath(job, 3, None)
    deadline = time.monotonic() + 30
    while not path.ready_for_leave([]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ends = path._ends
    assert [(e.shape, e.dtype) for e in ends] == [(p.shape, p.dtype) for p in params]
    assert all(e.data_ptr() != p.data_ptr() for e, p in zip(ends, params))
    body = path._leave_rwire._body
    assert body is not None and body.dtype == torch.bfloat16 and body.numel() == sum(p.numel() for p in params)
    assert path.ready_for_leave(["h2/cpu/1"]) and path._ends is ends and path._leave_rwire._body is body
    wire = RoundWire(torch.bfloat16)
    assert LeaveMemory().ready(params, wire, torch.device("meta")) == (True, None) and wire._body is None

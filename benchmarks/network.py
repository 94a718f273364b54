"""What a gradient exchange costs on an office network: all-reduce over shaped links.

Every other figure in this project ran on loopback. Here each rank runs in a host
of the shaped network bed (tests/testbed/netns.py: a namespace per host, a bridge
between them, each host's link limited by `tc`), with gloo bound to the host's
interface (GLOO_SOCKET_IFNAME) and a TCPStore on rank 0's bridge address. For each
world size the workers start once (the host interpreter, Python and torch only)
and the bed is reshaped under them for each link case, so the table costs one
`import torch` per rank, not one per row.

A mode is one function of the worker's gradient and group (`MODES`): the table
iterates over them. Issue 51's later modes (local steps, low rank) add theirs here.

    .venv/bin/python benchmarks/network.py --mb 20                  # quick
    .venv/bin/python benchmarks/network.py --json                   # the issue's sizes
    .venv/bin/python benchmarks/network.py --delays 0 --worlds 2    # a kernel without sch_netem

Per row: the slowest rank's time for one exchange (after a barrier; the median
of --rounds), the bytes a rank's interface sent (`tx_bytes`, headers included)
against a ring all-reduce's 2 (N-1)/N of the payload, and the rate those imply.
Needs root (network namespaces). Cases the kernel cannot shape (delay without
sch_netem) are skipped with the reason, in the table and in --json.

The second part trains: real `ElasticJob`s, one per (world, link, mode of
`train_modes()`, the one table of name -> ElasticJob arguments), on a byte-level
language model over the Python standard library's sources (benchmarks/_textlm.py),
every rank a host of the bed with the job's store (the runtime's StoreServer) on
rank 0's host. Per row: compute utilization per rank, bytes sent per sample, and the
held-out loss after equal samples against synchronous fp32's (`summarize_train`). A
mode this runtime does not accept is a skipped row with the reason. With `--torchft
DIR[:DIR]`, torchft's own DiLoCo trains beside them on the same bed, the same work
as the `local` row (benchmarks/_torchft.py); without it, or where torchft does not
import, that row is skipped with the reason (`torchft_skip`). `--quick` is the smoke
test (world 2, one link, few steps, the small model); `--model 50m` is issue 51's 200 MB of gradients.

    .venv/bin/python benchmarks/network.py --quick
    .venv/bin/python benchmarks/network.py --json --model 50m --steps 400 --parts train

`--parts matrix` (not by default; benchmarks/_matrix.py): the same rows, but one job
per (world, mode) that trains through every link, the bed reshaped between its
segments: the whole matrix on the 50m model in under an hour here, not most of a day.

    .venv/bin/python benchmarks/network.py --parts matrix --model 50m --outer-momentum 0.5 --json

`--parts events` (not by default; benchmarks/_events.py): per mode (sync_fp32, local)
and link, one job of W-1 ranks that a W-th joins and one then leaves by SIGTERM; the
members' pause at each event against the steady step, and whether the joiner caught up.

    .venv/bin/python benchmarks/network.py --parts events --worlds 3 --rates 1000 --delays 0 --model 5m --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _textlm  # noqa: E402  (beside this file: the corpus and the model; torch only once built)
import _torchft  # noqa: E402  (beside this file: torchft's DiLoCo on the bed; torchft only in its workers)
import _events  # noqa: E402  (beside this file: --parts events, a join and a planned leave)
import _bed  # noqa: E402  (beside this file: the cases, environment, ranks and servers on the bed)
import _trainrank  # noqa: E402  (beside this file: a training job's rank, its segments and records)
import _matrix  # noqa: E402  (beside this file: --parts matrix, one job per mode through every link)

ROOT = Path(__file__).resolve().parents[1]
STORE_PORT = 29500  # each host has its own network stack: no other bed can hold this port
PROCESS_GROUP_TIMEOUT_S = 1800  # 200 MB at 100 Mbit/s on a loaded machine takes tens of seconds


# --- the modes (run in the workers; torch is imported there only) ------------------

def allreduce_fp32(grad, dist) -> int:
    """The synchronous baseline: the fp32 gradient summed in place. Returns payload bytes."""
    dist.all_reduce(grad)
    return grad.numel() * 4


def allreduce_bf16(grad, dist) -> int:
    """Half the bytes: cast to bf16, all-reduce, cast back (accumulation is the caller's)."""
    import torch

    half = grad.to(torch.bfloat16)
    dist.all_reduce(half)
    grad.copy_(half)
    return half.numel() * 2


MODES = {f.__name__: f for f in (allreduce_fp32, allreduce_bf16)}


# --- pure parts ---------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One link shape, the same for every host."""

    rate_mbit: float
    delay_ms: float

    @property
    def label(self) -> str:
        rate = f"{self.rate_mbit / 1000:g} Gbit/s" if self.rate_mbit >= 1000 else f"{self.rate_mbit:g} Mbit/s"
        return f"{rate}, {self.delay_ms:g} ms"


def ring_bytes(payload: int, world: int) -> int:
    """What a ring all-reduce sends per rank: reduce-scatter plus all-gather."""
    return 2 * (world - 1) * payload // world


def summarize(world: int, case: Case, mode: str, rounds: list[list[dict]]) -> dict:
    """One table row from the ranks' records of each round of one mode: an exchange
    takes as long as its slowest rank; the row has the median round."""
    times = sorted(max(r["seconds"] for r in per_rank) for per_rank in rounds)
    seconds = times[len(times) // 2]
    records = [r for per_rank in rounds for r in per_rank]
    wire = sum(r["wire_bytes"] for r in records) // len(records)
    payload = records[0]["payload_bytes"]
    return {"world": world, "rate_mbit": case.rate_mbit, "delay_ms": case.delay_ms, "mode": mode,
            "rounds": len(rounds), "seconds": round(seconds, 4), "seconds_all": [round(t, 4) for t in times],
            "payload_bytes": payload,
            "ring_bytes_per_rank": ring_bytes(payload, world), "wire_bytes_per_rank": wire,
            "wire_mbit_per_s": round(wire * 8 / seconds / 1e6, 1)}


def render_table(rows: list[dict], skipped: list[dict]) -> str:
    head = (f"{'world':>5}  {'link':<22} {'mode':<16} {'time s':>8} {'MB sent/rank':>13} "
            f"{'ring MB':>8} {'Mbit/s':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        link = Case(r["rate_mbit"], r["delay_ms"]).label
        lines.append(f"{r['world']:>5}  {link:<22} {r['mode']:<16} {r['seconds']:>8.3f} "
                     f"{r['wire_bytes_per_rank'] / 1e6:>13.1f} {r['ring_bytes_per_rank'] / 1e6:>8.1f} "
                     f"{r['wire_mbit_per_s']:>8.1f}")
    lines += [f"skipped world {s['world']}, {Case(s['rate_mbit'], s['delay_ms']).label}: {s['reason']}"
              for s in skipped]
    return "\n".join(lines)


# --- the worker (host interpreter, inside a namespace) ------------------------------

def worker(rank: int, world: int, master: str, floats: int, modes: list[str], rounds: int) -> None:
    """Join the group, then for each `run` line on stdin time every mode `rounds` times.

    The gradient is filled with rank+1 before each mode, so the sum is known
    (world (world+1) / 2, exact in bf16 too) and a wrong exchange fails loudly.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    store = dist.TCPStore(master, STORE_PORT, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    grad = torch.empty(floats)
    tx = _bed.tx_bytes_file()
    expected = world * (world + 1) / 2
    print(json.dumps({"ready": rank}), flush=True)
    for line in sys.stdin:
        if line.split()[0] != "run":
            break
        for name in (m for m in modes for _ in range(rounds)):
            grad.fill_(rank + 1)
            dist.barrier()
            sent = int(tx.read_text())
            start = time.perf_counter()
            payload = MODES[name](grad, dist)
            seconds = time.perf_counter() - start
            # A rank is done when it has received its share; its last sends may still sit in
            # its tbf queue (not yet counted in tx_bytes) until every rank is done.
            dist.barrier()
            sent = int(tx.read_text()) - sent
            if grad[0].item() != expected or grad[-1].item() != expected:
                raise SystemExit(f"rank {rank}: {name} summed to {grad[0].item()}, not {expected}")
            print(json.dumps({"mode": name, "rank": rank, "seconds": seconds, "wire_bytes": sent,
                              "payload_bytes": payload}), flush=True)
    dist.destroy_process_group()


# --- the driver -----------------------------------------------------------------------

def run_world(world: int, cases: list[Case], floats: int, modes: list[str],
              rounds: int) -> tuple[list[dict], list[dict]]:
    """One bed of `world` hosts; its links reshaped for each case under the same workers."""
    sys.path.insert(0, str(ROOT))
    from tests.testbed.hostpython import HOST_PYTHON
    from tests.testbed.netns import IFNAME, Link, shaping_missing_reason

    rows, skipped, runnable = [], [], []
    for case in cases:
        reason = shaping_missing_reason(Link(rate_mbit=case.rate_mbit, delay_ms=case.delay_ms))
        if reason:
            skipped.append({"world": world, **asdict(case), "reason": reason})
        else:
            runnable.append(case)
    if not runnable:
        return rows, skipped
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GLOO_SOCKET_IFNAME": IFNAME,
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONWARNINGS": "ignore::UserWarning"}  # torch warns that it has no numpy: hosts have none
    with _bed.bed_for(world, runnable) as bed:
        master = bed.address("h1")
        workers = [bed.run_in(f"h{r + 1}", [HOST_PYTHON, __file__, "--worker", str(r), str(world), master,
                                            str(floats), ",".join(modes), str(rounds)],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for r in range(world)]
        for w in workers:
            _read(w)  # ready
        for case in runnable:
            bed.reshape_all(Link(rate_mbit=case.rate_mbit, delay_ms=case.delay_ms))
            for w in workers:
                w.stdin.write("run\n")
                w.stdin.flush()
            records = [[_read(w) for _ in range(len(modes) * rounds)] for w in workers]
            for i, mode in enumerate(modes):
                mode_rounds = [[per_worker[i * rounds + k] for per_worker in records] for k in range(rounds)]
                rows.append({**summarize(world, case, mode, mode_rounds), "delay_by": _bed.delay_path(bed)})
                print(render_table(rows[-1:], []).splitlines()[-1], file=sys.stderr, flush=True)
        for w in workers:
            w.stdin.write("quit\n")
            w.stdin.close()
        for w in workers:
            w.wait(60)
    return rows, skipped


def _read(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a worker ended early (exit {proc.wait()}); its stderr is above")
    return json.loads(line)


# --- training: the modes of ElasticJob (one place) ------------------------------------

SYNC = "sync_fp32"  # the reference every mode's loss is compared with


def train_modes(sync_every: int, outer: dict | None = None, inner_batch: int = 16) -> dict[str, dict]:
    """Mode name -> the ElasticJob keyword arguments that choose it. Modes whose
    arguments this runtime does not have are skipped with the reason (`refusal`).
    `outer`: local steps' outer SGD's arguments (lr, momentum, nesterov) where not the
    runtime's default; the worker makes the `outer_optimizer` callable of them.
    `inner_batch`: local_inner's inner steps' size (runtime/train/inner.py)."""
    def local(**options) -> dict:  # local steps with `options` (runtime/train/local.py)
        return {"sync": "local", "sync_every": sync_every, **options, **({"outer_optimizer": outer} if outer else {})}

    return {
        SYNC: {},
        "bf16": {"grad_dtype": "bf16"},
        "lowrank": {"compress": "powersgd"},
        "local": local(),
        "local_overlap": local(sync_overlap=True),  # the round's averaging under the next round's compute
        "local_bf16": local(grad_dtype="bf16"),  # a round's weighted deltas as bfloat16: half its bytes (roundwire.py)
        "local_overlap_bf16": local(sync_overlap=True, grad_dtype="bf16"),
        "local_inner": local(inner_batch=inner_batch),  # a faster rank (a bigger share) takes more inner steps
    }


def parse_slow(text: str | None) -> tuple[int, float]:
    """--slow RANK=SECONDS as (rank, seconds per sample); (-1, 0.0) for none."""
    if not text:
        return -1, 0.0
    rank, sep, seconds = text.partition("=")
    try:
        r, s = int(rank), float(seconds)
    except ValueError:
        r, s = -1, -1.0
    if not sep or r < 0 or not s >= 0:
        raise ValueError(f"--slow takes RANK=SECONDS (a rank from 0, seconds per sample >= 0), e.g. 1=0.002; "
                         f"got {text!r}")
    return r, s


def outer_sgd(lr: float | None, momentum: float | None) -> dict | None:
    """--outer-lr / --outer-momentum as the outer SGD's arguments (Nesterov where there
    is momentum), or None for the runtime's default (lr 0.7, momentum 0.9, Nesterov)."""
    if lr is None and momentum is None:
        return None
    m = 0.9 if momentum is None else momentum
    return {"lr": 0.7 if lr is None else lr, "momentum": m, "nesterov": m > 0}


def refusal(parameters: list[str], kwargs: dict) -> str | None:
    """Why an ElasticJob with these `parameters` (its signature's names) cannot take
    `kwargs`, or None if it can (a **kwargs parameter takes anything)."""
    if "**" in parameters:
        return None
    missing = [k for k in kwargs if k not in parameters]
    if not missing:
        return None
    return f"this runtime's ElasticJob has no parameter {', '.join(map(repr, missing))} (not landed yet)"


# --- training: the pure arithmetic ------------------------------------------------------

def utilization(window_s: float, wait_s: float | None) -> float | None:
    """Compute utilization of a rank: compute time / step time, where compute is the
    window's wall time less the network wait its gradient path measured (None: the
    path measures none)."""
    if wait_s is None or window_s <= 0:
        return None
    return round(min(1.0, max(0.0, (window_s - wait_s) / window_s)), 4)


def summarize_train(world: int, case: Case, mode: str, records: list[dict], global_batch: int) -> dict:
    """One training row from the ranks' records (_trainrank.py's): per rank its
    utilization over the measured steps (after the warm-up), bytes per sample (its
    interface's tx_bytes and the job's own bytes_per_step, over the samples of the
    whole job's measured steps), and rank 0's losses."""
    records = sorted(records, key=lambda r: r["rank"])
    r0 = records[0]
    samples = r0["measured_steps"] * global_batch
    utils = [utilization(r["window_s"], r["wait_s"]) for r in records]
    known = [u for u in utils if u is not None]

    def per_sample(key: str) -> float | None:
        vals = [r[key] for r in records if r[key] is not None]
        if not samples or len(vals) < len(records):
            return None
        return round(sum(vals) / len(vals) / samples, 1)

    return {"world": world, "rate_mbit": case.rate_mbit, "delay_ms": case.delay_ms, "mode": mode,
            "steps": r0["steps"], "measured_steps": r0["measured_steps"], "samples": r0["steps"] * global_batch,
            "step_s": round(max(r["window_s"] for r in records) / max(1, r0["measured_steps"]), 4),
            "utilization": round(sum(known) / len(known), 4) if len(known) == len(utils) else None,
            "utilization_min": min(known) if len(known) == len(utils) else None,
            "utilization_per_rank": utils,
            # what each rank trained: its optimizer steps (local steps: its inner steps) and samples
            "optimizer_steps_per_rank": [r.get("optimizer_steps") for r in records],
            "samples_per_rank": [r.get("samples_trained") for r in records],
            "wire_bytes_per_sample": per_sample("tx_bytes"), "job_bytes_per_sample": per_sample("job_bytes"),
            "job_bytes_per_step": r0["job_bytes_per_step"],
            "start_loss": r0["start_loss"], "end_loss": r0["end_loss"],
            "eval_loss_start": r0["eval_loss_start"], "eval_loss": r0["eval_loss"],
            "halved": _textlm.halved(r0["start_loss"], r0["eval_loss"]), "loss_vs_sync": None,
            **status_verdict(r0.get("status_network"))}


def status_verdict(net: dict | None) -> dict:
    """What `eltctl status` would say of rank 0's status document's `network`: its
    smoothed share of the step, and whether the hint names the network as what sets the
    job's speed (eltctl/statusview/job.py network_hint; the control side, no torch)."""
    from eltctl.statusview.job import network_hint

    if not isinstance(net, dict):
        return {"status_share": None, "status_names_network": None}
    return {"status_share": net.get("share"), "status_names_network": network_hint(net) is not None}


def compare_losses(rows: list[dict]) -> list[dict]:
    """Each row with `loss_vs_sync`: its held-out loss relative to synchronous fp32's
    on the same world and link, (loss - sync) / sync (None without a sync row or
    where the two trained unequal steps: the matrix part's local jobs run longer)."""
    ref = {(r["world"], r["rate_mbit"], r["delay_ms"]): (r["eval_loss"], r.get("steps")) for r in rows
           if r["mode"] == SYNC}
    out = []
    for r in rows:
        base, steps = ref.get((r["world"], r["rate_mbit"], r["delay_ms"]), (None, None))
        equal = base and r["eval_loss"] is not None and r.get("steps") == steps
        rel = round((r["eval_loss"] - base) / base, 5) if equal else None
        out.append({**r, "loss_vs_sync": rel})
    return out


def _status_cell(r: dict) -> str:
    """The status column: rank 0's network share and "network" where `eltctl status` names it."""
    share = r.get("status_share")
    if share is None:
        return "n/a"
    return f"{share:.2f}" + (" network" if r.get("status_names_network") else " compute")


def render_train(rows: list[dict], skipped: list[dict]) -> str:
    head = (f"{'world':>5}  {'link':<22} {'mode':<14} {'util':>5} {'min':>5} {'step s':>7} "
            f"{'wire kB/smp':>11} {'job kB/smp':>10} {'loss start>end':>15} {'held-out':>8} {'vs sync':>8} "
            f"{'status':>14}")
    lines = [head, "-" * len(head)]

    def num(v, fmt):
        return format(v, fmt) if v is not None else "n/a"

    for r in rows:
        link = Case(r["rate_mbit"], r["delay_ms"]).label
        kb = {k: None if r[k] is None else r[k] / 1e3 for k in ("wire_bytes_per_sample", "job_bytes_per_sample")}
        vs = num(None if r["loss_vs_sync"] is None else 100 * r["loss_vs_sync"], "+.2f")
        lines.append(f"{r['world']:>5}  {link:<22} {r['mode']:<14} {num(r['utilization'], '.2f'):>5} "
                     f"{num(r['utilization_min'], '.2f'):>5} {r['step_s']:>7.3f} "
                     f"{num(kb['wire_bytes_per_sample'], '.1f'):>11} {num(kb['job_bytes_per_sample'], '.1f'):>10} "
                     f"{num(r['start_loss'], '.2f'):>7}>{num(r['end_loss'], '.2f'):<7} "
                     f"{num(r['eval_loss'], '.3f'):>8} {vs + ('%' if r['loss_vs_sync'] is not None else ''):>8} "
                     f"{_status_cell(r):>14}")
    lines += [f"skipped {s['mode']}" + (f", world {s['world']}, {Case(s['rate_mbit'], s['delay_ms']).label}"
                                        if "world" in s else "") + f": {s['reason']}" for s in skipped]
    return "\n".join(lines)


# --- training: the driver -----------------------------------------------------------------

class JobFailed(Exception):
    """A training job ended without every rank's record (the message names its log)."""


@dataclass(frozen=True)
class TrainPlan:
    """What every training job of one run shares (the worker's spec, less rank and mode)."""

    corpus: str  # the file the driver wrote the corpus to
    shape: dict
    stride: int
    steps: int
    batch: int
    lr: float
    seed: int
    warmup: int
    eval_samples: int
    threads: int
    timeout_s: float
    balance: bool = True  # ElasticJob(balance=): shares follow the ranks' speeds (False: equal, reproducible)
    slow_rank: int = -1  # --slow: this rank is a slower machine (-1: none) ...
    slow_per_sample: float = 0.0  # ... by this many seconds of compute per sample
    link_steps: int = 8  # the matrix part: steps per link of a mode without local steps ...
    link_warmup: int = 3  # ... of which this many are its warm-up (benchmarks/_matrix.py)


def probe_parameters() -> list[str]:
    """ElasticJob's parameter names in the host interpreter's runtime ("**" for a **kwargs)."""
    from tests.testbed.hostpython import HOST_PYTHON, host_env

    code = ("import inspect, json, eltctl_runtime as e\n"
            "ps = inspect.signature(e.ElasticJob).parameters.values()\n"
            "print(json.dumps(['**' if p.kind is p.VAR_KEYWORD else p.name for p in ps]))")
    env = host_env({"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONWARNINGS": "ignore::UserWarning"})
    done = subprocess.run([HOST_PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"cannot inspect the runtime's ElasticJob: {done.stderr.strip()}")
    return json.loads(done.stdout.splitlines()[-1])


def train_world(world: int, cases: list[Case], modes: dict[str, dict], plan: TrainPlan,
                workdir: Path, torchft: str | None = None, sync_every: int = 16) -> tuple[list[dict], list[dict]]:
    """One bed of `world` hosts, a store on h1; for each link, one job per mode, then
    torchft's DiLoCo where `torchft` names where it is installed."""
    from tests.testbed.netns import Link

    rows: list[dict] = []
    runnable, skipped = _bed.shapeable(cases, world, modes)
    if not runnable or not (modes or torchft):
        return rows, skipped
    base = _bed.bed_env(plan.threads)
    with _bed.bed_for(world, runnable) as bed, _bed.job_store(bed, "h1", STORE_PORT, base) as master:
        for case in runnable:
            bed.reshape_all(Link(rate_mbit=case.rate_mbit, delay_ms=case.delay_ms))
            for mode, kwargs in modes.items():
                job = f"net-{mode}-w{world}-{case.rate_mbit:g}-{case.delay_ms:g}-{os.getpid()}"
                try:
                    records = _run_job(bed, world, job, master, base, mode, kwargs, plan, workdir)
                except JobFailed as e:  # the row says so; the other rows still run
                    skipped.append({"mode": mode, "world": world, **asdict(case), "reason": str(e), "failed": True})
                    print(f"{mode}, world {world}, {case.label}: {e}", file=sys.stderr, flush=True)
                    continue
                refused = [r["skipped"] for r in records if "skipped" in r]
                if refused:
                    skipped.append({"mode": mode, "world": world, **asdict(case), "reason": refused[0]})
                    continue
                rows.append({**summarize_train(world, case, mode, records, plan.batch),
                             "delay_by": _bed.delay_path(bed)})
                print(render_train(rows[-1:], []).splitlines()[-1], file=sys.stderr, flush=True)
            if torchft:
                job = f"net-torchft-w{world}-{case.rate_mbit:g}-{case.delay_ms:g}-{os.getpid()}"
                try:
                    records = _torchft.run_job(bed, world, job, asdict(plan), sync_every, torchft, base, workdir)
                except _torchft.TorchftFailed as e:
                    skipped.append({"mode": _torchft.MODE, "world": world, **asdict(case), "reason": str(e),
                                    "failed": True})
                    print(f"{_torchft.MODE}, world {world}, {case.label}: {e}", file=sys.stderr, flush=True)
                    continue
                rows.append({**summarize_train(world, case, _torchft.MODE, records, plan.batch),
                             **_torchft.replica_fields(records, plan.steps, sync_every)})
                print(render_train(rows[-1:], []).splitlines()[-1], file=sys.stderr, flush=True)
    return rows, skipped


def matrix_world(world: int, cases: list[Case], modes: dict[str, dict], plan: TrainPlan, workdir: Path,
                 torchft: str | None = None, sync_every: int = 16) -> tuple[list[dict], list[dict]]:
    """The matrix part (benchmarks/_matrix.py): one bed of `world` hosts, a store on
    h1, one job per mode through every link, a row per (link, mode)."""
    from tests.testbed.netns import Link

    rows: list[dict] = []
    runnable, skipped = _bed.shapeable(cases, world, modes)
    if not runnable or not modes:
        return rows, skipped
    base = _bed.bed_env(plan.threads)
    links = [Link(rate_mbit=c.rate_mbit, delay_ms=c.delay_ms) for c in runnable]
    with _bed.bed_for(world, runnable) as bed, _bed.job_store(bed, "h1", STORE_PORT, base) as master:
        for mode, kwargs in modes.items():
            job = f"net-matrix-{mode}-w{world}-{os.getpid()}"
            segments = _matrix.schedule(kwargs, len(runnable), plan.link_steps, plan.link_warmup, sync_every)
            handoff = workdir / f"{job}.link"
            bed.reshape_all(links[0])
            try:
                records = _run_job(bed, world, job, master, base, mode, kwargs, plan, workdir,
                                   {"segments": segments, "handoff": str(handoff)},
                                   _matrix.watcher(lambda i: bed.reshape_all(links[i]), handoff))
            except JobFailed as e:
                skipped += [{"mode": mode, "world": world, **asdict(c), "reason": str(e), "failed": True}
                            for c in runnable]
                print(f"{mode}, world {world}: {e}", file=sys.stderr, flush=True)
                continue
            refused = [r["skipped"] for r in records if "skipped" in r]
            if refused:
                skipped += [{"mode": mode, "world": world, **asdict(c), "reason": refused[0]} for c in runnable]
                continue
            for i, case in enumerate(runnable):
                rows.append({**summarize_train(world, case, mode, _matrix.segment_records(records, i), plan.batch),
                             "delay_by": _bed.delay_path(bed)})
                print(render_train(rows[-1:], []).splitlines()[-1], file=sys.stderr, flush=True)
    return rows, skipped


def _run_job(bed, world: int, job: str, master: str, base: dict, mode: str, kwargs: dict,
             plan: TrainPlan, workdir: Path, extra: dict | None = None, watch=None) -> list[dict]:
    """Start one job's ranks (h1..hN), wait for them, return their records. `extra`:
    more of every rank's spec (the matrix part's segments); `watch(procs, deadline)`:
    runs while they do (the matrix part reshapes the bed), returns why the job
    failed or None."""
    from tests.testbed.hostpython import HOST_PYTHON

    procs = []
    for r in range(world):
        host = f"h{r + 1}"
        spec = {**asdict(plan), "rank": r, "kwargs": kwargs, **(extra or {})}
        env = {**base, "ELTCTL_STORE": f"tcp:{master}:{STORE_PORT}", "ELTCTL_JOB": job,
               "ELTCTL_WORKER_ID": f"{host}/cpu/{r}", "ELTCTL_DEVICE": "cpu",
               "ELTCTL_MIN_WORKERS": str(world), "ELTCTL_MAX_WORKERS": str(world),
               "ELTCTL_BIND_ADDRESS": bed.address(host), "ELTCTL_HANG_TIMEOUT": "30"}
        procs.append(_bed.start_rank(bed, host, [HOST_PYTHON, __file__, "--train-worker", json.dumps(spec)], env,
                                     workdir / f"{job}-{host}.log"))
    deadline = time.monotonic() + plan.timeout_s
    records = []
    try:
        failed = watch(procs, deadline) if watch is not None else None
        if failed:
            raise JobFailed(f"failed: job {job}: {failed}; see its logs {job}-h*.log")
        for proc, log in procs:
            try:
                record = _bed.last_record(proc, deadline)
            except subprocess.TimeoutExpired:
                raise JobFailed(f"failed: job {job} ran past {plan.timeout_s:g} s; see {log.name}") from None
            if record is None:
                raise JobFailed(f"failed: a rank of job {job} ended without a record (exit {proc.returncode}); "
                                f"see {log.name}")
            records.append(record)
    finally:
        _bed.stop_ranks(procs)
    return records


def torchft_skip(where: str | None) -> dict | None:
    """The skipped row for torchft's DiLoCo, saying why (not asked for, or does not
    import here: the exact error), or None where it imports and runs."""
    if not where:
        return {"mode": _torchft.MODE, "reason": f"not asked for: --torchft DIR[:DIR], where {_torchft.INSTALL}"}
    problem = _torchft.import_problem(where)
    return {"mode": _torchft.MODE, "reason": problem} if problem else None


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


QUICK = {"worlds": "2", "rates": "1000", "delays": "0", "mb": 20.0, "steps": 40, "model": "small"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        rank, world, master, floats, modes, rounds = argv[1:7]
        worker(int(rank), int(world), master, int(floats), modes.split(","), int(rounds))
        return
    if argv[:1] == ["--train-worker"]:
        _trainrank.train_worker(json.loads(argv[1]))
        return
    if argv[:1] == ["--events-worker"]:
        _events.events_worker(json.loads(argv[1]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: world 2, 1 Gbit/s without delay, 20 MB, 40 steps of the small model")
    ap.add_argument("--parts", default="allreduce,train",
                    help="allreduce (the raw exchange), train (ElasticJob: a job per world, link and mode), "
                         "matrix (a job per world and mode, the links reshaped under it: not by default), "
                         "events (a join and a planned leave: not by default)")
    ap.add_argument("--link-steps", type=int, default=8,
                    help="matrix: steps per link of a mode without local steps (local steps: three rounds)")
    ap.add_argument("--link-warmup", type=int, default=3,
                    help="matrix: of --link-steps, those left out of the figures (local steps: one round)")
    ap.add_argument("--join-after", type=int, default=30, help="events: steps at W-1 before the W-th rank starts")
    ap.add_argument("--leave-after", type=int, default=30, help="events: steps at W before h2 gets SIGTERM")
    ap.add_argument("--repeats", type=int, default=1,
                    help="events: jobs per mode and link, the modes taking turns; the medians over them are reported")
    ap.add_argument("--keep-logs", action="store_true", help="events: keep the ranks' logs (named on stderr), with the runtime's DEBUG "
                                                                  "lines (a generation's pause phases)")
    ap.add_argument("--mb", type=float, default=200, help="fp32 gradient size in MB (200: 50 M floats)")
    ap.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--rates", default="10000,1000,100", help="link rates in Mbit/s")
    ap.add_argument("--delays", default="0.2,5", help="one-way delay per host link in ms (netem, or the "
                    "user-space delay line where the kernel has none: tests/testbed/delayline.py)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"all-reduce modes, of: {', '.join(MODES)}")
    ap.add_argument("--rounds", type=int, default=1, help="exchanges per mode and link (the median is shown)")
    ap.add_argument("--train-modes", default=",".join(train_modes(1)),
                    help=f"ElasticJob modes, of: {', '.join(train_modes(1))}")
    ap.add_argument("--model", choices=sorted(_textlm.SHAPES), default="small",
                    help="the language model: small (~0.27 M parameters), 5m (~4.5 M: 18 MB of fp32 gradients), "
                         "50m (~51 M: 200 MB of fp32 gradients)")
    ap.add_argument("--steps", type=int, default=400, help="steps per job (equal samples in every mode)")
    ap.add_argument("--batch", type=int, default=64, help="global batch (byte windows per step)")
    ap.add_argument("--lr", type=float, default=None,
                    help="AdamW's learning rate (local steps: the inner one); default: the model's "
                         f"({', '.join(f'{m} {lr:g}' for m, lr in _textlm.LEARNING_RATES.items())})")
    ap.add_argument("--sync-every", type=int, default=16, help="local steps: steps between synchronizations (H)")
    ap.add_argument("--outer-lr", type=float, default=None,
                    help="local steps: the outer SGD's learning rate (default: the runtime's, 0.7)")
    ap.add_argument("--outer-momentum", type=float, default=None,
                    help="local steps: the outer SGD's momentum, Nesterov when above 0 (default: the runtime's, 0.9)")
    ap.add_argument("--corpus-mb", type=float, default=4.0, help="the first MB of the stdlib's sources")
    ap.add_argument("--stride", type=int, default=4, help="bytes between training windows")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing and the byte counts")
    ap.add_argument("--eval-samples", type=int, default=2048, help="held-out windows for the loss")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--slow", default=None, metavar="RANK=SECONDS",
                    help="mixed hardware: rank RANK is a slower machine, SECONDS more compute per sample")
    ap.add_argument("--inner-batch", type=int, default=16,
                    help="local_inner: the samples of one inner step (a faster rank takes more of them)")
    ap.add_argument("--no-balance", action="store_true",
                    help="equal shares (ElasticJob(balance=False)): local steps' losses repeat from run to run")
    ap.add_argument("--torchft", default=None, metavar="DIR[:DIR]",
                    help="where torchft and its dependencies are installed for the host interpreter "
                         "(its DiLoCo trains beside the local row)")
    ap.add_argument("--job-timeout", type=float, default=3600, help="seconds a training job may take")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    args = ap.parse_args(argv)
    if args.quick:  # what the command line names itself wins over the quick defaults
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}")
    table = train_modes(args.sync_every, outer_sgd(args.outer_lr, args.outer_momentum), args.inner_batch)
    try:
        args.slow_rank, args.slow_per_sample = parse_slow(args.slow)
    except ValueError as e:
        ap.error(str(e))
    wanted = args.train_modes.split(",")
    unknown = sorted(set(wanted) - set(table))
    if unknown:
        ap.error(f"unknown training mode(s) {', '.join(unknown)}: choose from {', '.join(table)}")
    parts = set(args.parts.split(","))
    if parts - {"allreduce", "train", "matrix", "events"} or not parts:
        ap.error(f"--parts takes allreduce, train, matrix and/or events, not {args.parts!r}")
    if not 1 <= args.link_warmup < args.link_steps:
        ap.error(f"--link-steps ({args.link_steps}) must exceed --link-warmup ({args.link_warmup}), "
                 "which must be at least 1")
    if args.lr is None:
        args.lr = _textlm.LEARNING_RATES[args.model]
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.warmup < 1 or args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}), which must be at least 1")
    if os.geteuid() != 0:
        ap.error("network namespaces need root: run as root")
    sys.path.insert(0, str(ROOT))
    floats = int(args.mb * 1e6 / 4)
    cases = [Case(r, d) for r in _floats(args.rates) for d in _floats(args.delays)]
    worlds = [int(w) for w in args.worlds.split(",")]
    report: dict = {"mb": args.mb, "floats": floats, "rounds": args.rounds, "rows": [], "skipped": []}
    if "allreduce" in parts:
        for world in worlds:
            r, s = run_world(world, cases, floats, modes, args.rounds)
            report["rows"] += r
            report["skipped"] += s
        if not args.json:
            print(render_table(report["rows"], report["skipped"]), flush=True)
    for part in ("train", "matrix"):
        if part in parts:
            report[part] = run_training(args, cases, worlds, {m: table[m] for m in wanted}, part)
            if not args.json:
                print(render_train(report[part]["rows"], report[part]["skipped"]))
    if "events" in parts:
        chosen = wanted if "train_modes" in given else _events.EVENT_MODES  # sync_fp32 and local unless named
        report["events"] = run_events_part(args, cases, worlds, {m: table[m] for m in chosen})
        if not args.json:
            print(_events.render_events(report["events"]["rows"], report["events"]["skipped"]))
            if args.repeats > 1:
                print(_events.render_medians(report["events"]["medians"]))
    if args.json:
        print(json.dumps(report, indent=2))


def run_training(args, cases: list[Case], worlds: list[int], modes: dict[str, dict], part: str = "train") -> dict:
    """The training or the matrix part of a run: the corpus written once, a bed per world."""
    shape = _textlm.SHAPES[args.model]
    params = probe_parameters()
    skipped = [{"mode": m, "reason": why} for m, kw in modes.items() if (why := refusal(params, kw))]
    runnable = {m: kw for m, kw in modes.items() if not refusal(params, kw)}
    no_torchft = torchft_skip(args.torchft) if part == "train" else None
    if part == "matrix" and args.torchft:  # its DiLoCo trains one job per link: not through the links
        no_torchft = {"mode": _torchft.MODE, "reason": "torchft's DiLoCo runs in --parts train, not in the matrix"}
    skipped += [no_torchft] if no_torchft else []
    workdir = Path(tempfile.mkdtemp(prefix="eltnet-train-"))
    rows: list[dict] = []
    try:
        corpus = workdir / "corpus.txt"
        corpus.write_bytes(_textlm.build_corpus(int(args.corpus_mb * 1e6)))
        plan = TrainPlan(str(corpus), asdict(shape), args.stride, args.steps, args.batch, args.lr, 0,
                         args.warmup, args.eval_samples, args.threads, args.job_timeout, not args.no_balance,
                         args.slow_rank, args.slow_per_sample, args.link_steps, args.link_warmup)
        for world in worlds:
            r, s = (train_world if part == "train" else matrix_world)(
                world, cases, runnable, plan, workdir, None if no_torchft else args.torchft, args.sync_every)
            rows += r
            skipped += s
    except BaseException:
        print(f"the workers' logs are kept in {workdir}", file=sys.stderr)
        raise
    if any(s.get("failed") for s in skipped):
        print(f"a job failed: the workers' logs are kept in {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"model": args.model, "shape": asdict(shape), "parameters": shape.parameters,
            "fp32_gradient_mb": round(shape.parameters * 4 / 1e6, 1), "steps": args.steps, "batch": args.batch,
            "lr": args.lr, "sync_every": args.sync_every, "corpus_mb": args.corpus_mb, "balance": plan.balance,
            "timing": "window from the end of the warm-up to the last step; wait: the job's gradient path's "
                      "per-step network wait (last_step_timing)",
            **({"links": "one job per world and mode, the bed reshaped between segments (benchmarks/_matrix.py): "
                         f"{args.link_steps} steps per link ({args.link_warmup} warm-up) without local steps, "
                         f"3 rounds (1 warm-up) with them; steps: each job's total"} if part == "matrix" else {}),
            "rows": compare_losses(rows), "skipped": skipped}


def run_events_part(args, cases: list[Case], worlds: list[int], modes: dict[str, dict]) -> dict:
    """The events part (benchmarks/_events.py): the corpus written once, a bed per world."""
    shape = _textlm.SHAPES[args.model]
    workdir = Path(tempfile.mkdtemp(prefix="eltnet-events-"))
    corpus = workdir / "corpus.txt"
    corpus.write_bytes(_textlm.build_corpus(int(args.corpus_mb * 1e6)))
    plan = TrainPlan(str(corpus), asdict(shape), args.stride, args.steps, args.batch, args.lr, 0,
                     args.warmup, args.eval_samples, args.threads, args.job_timeout, not args.no_balance)
    rows, skipped = _events.run_events(worlds, cases, modes, plan, workdir, script=__file__,
                                       port=STORE_PORT, join_after=args.join_after, leave_after=args.leave_after,
                                       debug=args.keep_logs, repeats=args.repeats)
    if args.keep_logs or any(s.get("failed") for s in skipped):
        print(f"the events jobs' logs are kept in {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"model": args.model, "parameters": shape.parameters, "steps": args.steps, "batch": args.batch,
            "sync_every": args.sync_every, "join_after": args.join_after, "leave_after": args.leave_after,
            "pause": "longest gap between committed steps around the step where the world size changed "
                     "(1 before, 3 after) less the median steady gap (rank 0; max over the members)",
            "repeats": args.repeats, "rows": rows, "medians": _events.medians(rows), "skipped": skipped}


if __name__ == "__main__":
    main()

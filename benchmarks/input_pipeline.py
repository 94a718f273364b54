"""The input pipeline benchmark: eltctl's data workers against in-memory tensors and DDP's DataLoader.

    .venv/bin/python benchmarks/input_pipeline.py [--json] [--rounds 3] [--steps 200] [--workers 4]
        [--prefetch-steps 8] [--save out.json]

A data set that costs what real ones cost: examples/toy.py's `RecordDataset`
(each sample waits `--io-ms`, 1 ms, in time.sleep as a disk or network read
does, then is decoded on the CPU: zlib, a checksum, bytes to tensors, about
45 us). Global batch 64, two ranks (real processes, gloo on loopback, one
torch thread each), the ~3.2 M parameter toy MLP, SGD. Per rank and step
that is 32 samples: 32 ms of I/O wait, against roughly 20-40 ms of compute
here, so a pipeline that does not overlap them shows at once. Four runs per
round, in alternating order (the machine is shared):

- `eltctl_pipeline`: examples/train.py with `--io-ms 1 --num-workers 4
  --prefetch-steps 8`: 8 shares in flight, as DataLoader's 4 workers x its
  default prefetch_factor 2 have 8 batches in flight. (With the runtime's
  default prefetch_steps=2 only 2 of the 4 workers are busy: a share takes
  ~36 ms in one worker, so steps cannot go below ~18 ms; measured here, 22 ms
  per step against 20 ms of simulated compute, 21 ms with 4 steps ahead.)
- `eltctl_memory`: the same model on the same samples as in-memory tensors
  (a TensorDataset, loaded on the training thread): the floor;
- `ddp_loader`: plain DDP with `DataLoader(RecordDataset, num_workers=4,
  DistributedSampler)` (benchmarks/baselines/ddp_worker.py);
- `eltctl_thread`: the records loaded on the training thread (num_workers=0),
  for reference: what the pipeline hides.

Figures: the median step time of rank 0 after 30 warm-up steps, per run; per
round the ratios pipeline / memory and pipeline / DDP; the result is the median
of each ratio over rounds. Targets: <= 1.15x in-memory, <= 1.05x DDP with
DataLoader. On 2 cores the 8 data worker processes' decoding competes with the
2 training processes for the CPU on both sides alike; other load on the
machine moves every figure. Also printed: what loading one rank's share costs
in CPU (measured serially in the benchmark's process: the samples with their
I/O waits interleaved, collated, pickled), against the in-memory step: the
part of each core the data workers of either side take from its trainer
(about 4.7 ms, 22 %, here: the 1 ms sleeps' wake-ups and the cold caches after
them cost more than the decode). Where the cores are all trainers', the
in-memory ratio cannot go below about 1 + that fraction of the trainers' busy
time; with spare cores (a GPU server) it costs the step nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
from _baselines import measure_ddp_step_time  # noqa: E402
from _eltctl_side import measure_eltctl_step_time  # noqa: E402

WORLD = 2
MEMORY_TARGET = 1.15
DDP_TARGET = 1.05
SIDES = ("eltctl_pipeline", "eltctl_memory", "ddp_loader", "eltctl_thread")


def measure(side: str, *, steps: int, workers: int, prefetch: int, io_ms: float, threads: int) -> dict[str, Any]:
    records = ("--io-ms", f"{io_ms:g}")
    if side == "eltctl_pipeline":
        return measure_eltctl_step_time(WORLD, steps, threads=threads, extra_args=(
            *records, "--num-workers", str(workers), "--prefetch-steps", str(prefetch)))
    if side == "eltctl_memory":
        return measure_eltctl_step_time(WORLD, steps, threads=threads)
    if side == "eltctl_thread":
        return measure_eltctl_step_time(WORLD, steps, threads=threads, extra_args=records)
    return measure_ddp_step_time(WORLD, steps, threads=threads,
                                 extra_args=(*records, "--loader-workers", str(workers)))


def data_cpu_per_share(io_ms: float, share: int = 32, shares: int = 40) -> float:
    """The CPU seconds one rank's share of a step costs to load, measured serially in this
    process: `share` samples of the same RecordDataset (their I/O waits interleaved, as in a
    data worker), collated and pickled as a data worker sends them. What the data workers of
    either side take from the cores the trainers use."""
    import pickle

    import torch
    from torch.utils.data._utils.collate import default_collate

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import toy

    torch.set_num_threads(1)
    ds = toy.RecordDataset(toy.make_dataset(), io_ms=io_ms)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    spent = []
    for k in range(shares):
        t0 = time.process_time()
        batch = default_collate([ds[i] for i in order[k * share:(k + 1) * share]])
        pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        spent.append(time.process_time() - t0)
    return statistics.median(spent[5:])


def ratios(rounds: list[dict], num: str, den: str) -> dict[str, Any]:
    """Median over rounds of (num median step) / (den median step). Pure."""
    got = [r[num]["median_step_s"] / r[den]["median_step_s"] for r in rounds
           if r.get(num, {}).get("median_step_s") and r.get(den, {}).get("median_step_s")]
    return {"ratios": [round(x, 4) for x in got], "median_ratio": round(statistics.median(got), 4) if got else None}


def run(*, rounds: int, steps: int, workers: int, prefetch: int, io_ms: float, threads: int,
        progress=print) -> dict[str, Any]:
    started = time.time()
    load_before = os.getloadavg()
    out_rounds = []
    for i in range(rounds):
        order = SIDES if i % 2 == 0 else tuple(reversed(SIDES))
        progress(f"round {i + 1} of {rounds}: {', '.join(order)} ...")
        r: dict[str, Any] = {"order": list(order)}
        for side in order:
            r[side] = measure(side, steps=steps, workers=workers, prefetch=prefetch, io_ms=io_ms, threads=threads)
        out_rounds.append(r)
    vs_memory = ratios(out_rounds, "eltctl_pipeline", "eltctl_memory")
    vs_ddp = ratios(out_rounds, "eltctl_pipeline", "ddp_loader")
    medians = {side: _median_of(out_rounds, side) for side in SIDES}
    data_cpu = data_cpu_per_share(io_ms, share=64 // WORLD)
    targets = [
        _target("pipeline vs in-memory tensors", MEMORY_TARGET, vs_memory["median_ratio"]),
        _target("pipeline vs DDP + DataLoader", DDP_TARGET, vs_ddp["median_ratio"]),
    ]
    return {
        "machine": _report.machine(load_before, started),
        "workload": {"model": "examples/toy.py MLP (64-1024-1024-1024-16, ~3.2 M parameters)", "world": WORLD,
                     "global_batch": 64, "samples": 8192, "optimizer": "SGD lr 0.01", "threads_per_rank": threads,
                     "data": f"RecordDataset: {io_ms:g} ms I/O wait (sleep) + zlib decode per sample",
                     "data_workers_per_rank": workers, "prefetch_steps": prefetch, "steps": steps,
                     "warmup_discarded": 30},
        "median_step_s": medians,
        # What loading costs the cores, whoever loads: the data of one rank's share, in CPU
        # seconds, and as a fraction of the in-memory step (each rank's trainer keeps one
        # core busy for most of a step; the data workers' CPU comes out of the same cores).
        "data_cpu_per_share_s": round(data_cpu, 5),
        "data_cpu_vs_memory_step": round(data_cpu / medians["eltctl_memory"], 4) if medians["eltctl_memory"] else None,
        "vs_memory": vs_memory,
        "vs_ddp_loader": vs_ddp,
        "rounds": out_rounds,
        "targets": targets,
    }


def _median_of(rounds: list[dict], side: str) -> float | None:
    xs = [r[side]["median_step_s"] for r in rounds if r.get(side, {}).get("median_step_s")]
    return round(statistics.median(xs), 5) if xs else None


def _target(name: str, goal: float, ratio: float | None) -> dict[str, Any]:
    return {"name": name, "goal": f"<= {goal:.2f}x", "measured": "n/a" if ratio is None else f"{ratio:.3f}x",
            "met": None if ratio is None else ratio <= goal}


def render(res: dict) -> str:
    m, w = res["machine"], res["workload"]
    lines = [
        f"eltctl input pipeline benchmark, {m['started']} ({m['duration_s']:.0f} s), {m['cpus']} CPUs, load average "
        f"{m['loadavg_before'][0]:.2f} before / {m['loadavg_after'][0]:.2f} after, python {m['python']}, "
        f"torch {m['torch']}",
        f"workload: {w['model']}, world {w['world']}, global batch {w['global_batch']}, {w['data']}, "
        f"{w['data_workers_per_rank']} data workers per rank, prefetch_steps {w['prefetch_steps']}, "
        f"{w['steps']} steps per run "
        f"(first {w['warmup_discarded']} discarded)",
        "",
    ]
    for i, r in enumerate(res["rounds"]):
        figs = ", ".join(f"{side} {_fmt(r[side].get('median_step_s'))}" for side in SIDES)
        errs = "".join(f"  [{side}: {r[side]['error'][:160]}]" for side in SIDES if r[side].get("error"))
        lines.append(f"round {i + 1} ({', '.join(r['order'])}): median step {figs}{errs}")
    md = res["median_step_s"]
    lines += ["", "median step over rounds: " + ", ".join(f"{s} {_fmt(md[s])}" for s in SIDES),
              f"pipeline / in-memory: {res['vs_memory']['ratios']} -> median {res['vs_memory']['median_ratio']}",
              f"pipeline / DDP+DataLoader: {res['vs_ddp_loader']['ratios']} -> median "
              f"{res['vs_ddp_loader']['median_ratio']}",
              f"loading one rank's share costs {res['data_cpu_per_share_s'] * 1000:.1f} ms of CPU (measured "
              f"serially), {_pct(res['data_cpu_vs_memory_step'])} of the in-memory step: with {m['cpus']} cores "
              f"and {w['world']} trainers, data workers of either side take that from the trainers' cores", "",
              f"{'target':<34} {'goal':>9} {'measured':>10}  status"]
    for t in res["targets"]:
        status = "met" if t["met"] else ("n/a" if t["met"] is None else "NOT met")
        lines.append(f"{t['name']:<34} {t['goal']:>9} {t['measured']:>10}  {status}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.0f} %"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the four runs, in alternating order")
    ap.add_argument("--steps", type=int, default=200, help="steps per run (the first 30 are warm-up)")
    ap.add_argument("--workers", type=int, default=4, help="data worker processes per rank (both sides)")
    ap.add_argument("--prefetch-steps", type=int, default=8, help="eltctl's steps ahead (DataLoader: 4 x 2 in flight)")
    ap.add_argument("--io-ms", type=float, default=1.0, help="I/O wait per sample")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON object to this file")
    a = ap.parse_args(argv)
    res = run(rounds=a.rounds, steps=a.steps, workers=a.workers, prefetch=a.prefetch_steps, io_ms=a.io_ms,
              threads=a.threads, progress=_report.say)
    return _report.emit(res, as_json=a.json, save=a.save, render=render)


if __name__ == "__main__":
    sys.exit(main())

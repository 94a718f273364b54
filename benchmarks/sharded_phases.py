"""Where one step of the sharded path goes, phase by phase, against replicated.

    .venv/bin/python benchmarks/sharded_phases.py [--world 2] [--steps 10] [--layers 12] [--batch 4]
        [--json] [CONFIG ...]

CONFIG: replicated, optimizer-r1, optimizer-r2, gradients-r1, gradients-r2 (default: all,
replicated first and last). Each runs `--world` plain worker processes on one gloo group
(benchmarks/sharded.py's memory part: the same ~50 M-parameter MLP, AdamW, one torch thread
per process) and prints rank 0's median over the steps after the first two of: forward and
backward (`fb`), the wait for the reductions (`finish`), the optimizer step (`step`: for a
sharded run the shard's step with its parameter gather), zeroing the gradients, the whole
step (`total`); and inside a sharded step, the optimizer's work alone (`opt`), the gathers'
launches (`launch_gather`) and the pre-step copy and backups' refresh (`prepare`, made in
`finish` while the last buckets are reduced). Phases, not a verdict: the whole job's step
against replicated is benchmarks/sharded.py's job step time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharded  # noqa: E402 - the model, the group and the replicated path of the memory part

CONFIGS = ("replicated", "optimizer-r1", "optimizer-r2", "gradients-r1", "gradients-r2")


def _timed(phases: dict[str, float], name: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
    return wrapper


def _worker(cfg: dict, rank: int, store_path: str, out) -> None:
    import torch

    from eltctl_runtime.train import zero

    torch.set_num_threads(1)
    world = cfg["world"]
    model = sharded._model(cfg["layers"])
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    pg = sharded._group(store_path, cfg["name"], rank, world)
    x = torch.randn(cfg["batch"], sharded.WIDTH, generator=torch.Generator().manual_seed(rank))
    phases: dict[str, float] = {}
    rows = []
    hooks = contextlib.ExitStack()
    if cfg["shard"] is None:
        path = sharded._Replicated(params, pg)
        begin, finish, step, zero_grad = (lambda: None), path.finish, opt.step, path.zero
    else:
        members = [zero.Member(f"w{r}", f"host{r}") for r in range(world)]
        lay = zero.shard_layout(params, opt, members, cfg["replicas"], sharded.BUCKET_MB)
        sg = zero.ShardedGradients(params, opt, lay, rank, cfg["shard"])
        sg.bind()
        stepper = sg.stepper  # (the step's parts are the stepper's: timed on it)
        stepper.prepare = _timed(phases, "prepare", stepper.prepare)
        stepper.gather_bucket = _timed(phases, "launch_gather", stepper.gather_bucket)
        shard_step = stepper._step_shard

        def stepped():  # the optimizer's own work, without the gathers launched between its buckets
            it = shard_step()
            while True:
                t = time.perf_counter()
                b = next(it, None)
                phases["opt"] = phases.get("opt", 0.0) + time.perf_counter() - t
                if b is None:
                    return
                yield b
        stepper._step_shard = stepped
        hooks.enter_context(sg.attached())
        begin, finish, step, zero_grad = (lambda: sg.begin(pg)), sg.finish, sg.step, sg.zero_grad
    for _ in range(cfg["steps"]):
        phases.clear()
        t0 = time.perf_counter()
        begin()
        (model(x).square().mean() / world).backward()
        t1 = time.perf_counter()
        finish()
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        zero_grad()
        t4 = time.perf_counter()
        rows.append({"fb": t1 - t0, "finish": t2 - t1, "step": t3 - t2, "zero": t4 - t3, "total": t4 - t0,
                     **phases})
    hooks.close()
    out.put({"rank": rank, "rows": rows})
    pg.barrier().wait()  # nobody drops the group while a peer still uses it


def run(name: str, world: int, steps: int, layers: int, batch: int) -> dict[str, float]:
    shard, replicas = (None, 1) if name == "replicated" else (name.split("-")[0], int(name[-1]))
    cfg = {"world": world, "steps": steps, "batch": batch, "layers": layers, "name": name, "shard": shard,
           "replicas": replicas}
    rows = sharded.spawn_ranks(_worker, cfg, "eltctl-phases-")[0]["rows"][2:]
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    return {k: round(statistics.median(r.get(k, 0.0) for r in rows), 4) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", metavar="CONFIG")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configs = args.configs or [*CONFIGS, "replicated"]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown CONFIG {', '.join(unknown)}: choose from {', '.join(CONFIGS)}")
    result: dict[str, Any] = {"world": args.world, "steps": args.steps, "runs": []}
    for name in configs:
        r = run(name, args.world, args.steps, args.layers, args.batch)
        result["runs"].append({"config": name, **r})
        print(f"world {args.world} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()),
              file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""ZeRO-2 with micro-batches: the gradients kept between micro-batches, reduced each micro-batch or not.

`ElasticJob(shard="gradients")` with micro-batches accumulates the micro-batches before
a step's last in the full local gradients (each rank's `.grad`, as replicated training
does) and reduce-scatters once, in the last; `reduce_each_micro_batch=True` reduces
every micro-batch into the rank's chunks instead (`ShardedGradients.begin(accumulate=True)`,
`finish_round`), so between micro-batches only the chunks' gradients are kept, at the
price of one reduction of the whole gradient per micro-batch. This measures both, side
by side in one run, on the sharded benchmark's model (`--layers` Linear(2048, 2048), about
50 M parameters with 12, AdamW), at each of `--worlds`, `--micro` micro-batches of
`--batch` samples per rank and step, driving `eltctl_runtime.train.zero` directly in spawned
worker processes on one gloo group (benchmarks/sharded.py's harness), and prints per rank:

  - the gradient bytes kept between micro-batches (the `.grad` tensors left after the
    first micro-batch's backward, the chunks' gradients and, on the CPU, the staging pool);
  - peak RSS (ru_maxrss);
  - the steady step time (median of the slowest rank's steps, the first two left out)

and the ratios of the per-micro-batch reduction's figures to local accumulation's.

    .venv/bin/python benchmarks/micro_reduce.py [--worlds 2 4] [--micro 4] [--batch 2] [--steps 6]
        [--layers 12] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sharded  # noqa: E402  (the harness: the model, the gloo group, spawned ranks)

WARMUP = 2  # steps not timed: the first makes the optimizer state, the second the pre-step buffers


def _worker(cfg: dict, rank: int, store_path: str, out) -> None:
    import faulthandler

    import torch

    from eltctl_runtime.train import zero

    faulthandler.dump_traceback_later(600, exit=True)
    torch.set_num_threads(1)
    world, micro = cfg["world"], cfg["micro"]
    model = sharded._model(cfg["layers"])
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    pg = sharded._group(store_path, cfg["name"], rank, world)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(cfg["batch"], sharded.WIDTH, generator=gen) for _ in range(micro)]
    members = [zero.Member(f"w{r}", f"host{r}") for r in range(world)]
    lay = zero.shard_layout(params, opt, members, 1, sharded.BUCKET_MB)
    sg = zero.ShardedGradients(params, opt, lay, rank, "gradients")
    sg.bind()
    rounds = cfg["rounds"]
    times, between = [], 0
    with sg.attached():
        for step in range(cfg["steps"]):
            t0 = time.perf_counter()
            for k, x in enumerate(xs):
                last = k == micro - 1
                if last or rounds:
                    sg.begin(pg, accumulate=not last)
                (model(x).square().mean() / (world * micro)).backward()
                if last:
                    sg.finish()
                elif rounds:
                    sg.finish_round()
                if k == 0 and step == cfg["steps"] - 1:
                    mem = sg.memory()
                    between = (sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
                               + mem["gradients"] + mem.get("staging", 0))
            sg.step()
            sg.zero_grad()
            times.append(time.perf_counter() - t0)
    out.put({"rank": rank, "times": times, "between_bytes": between,
             "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    pg.barrier().wait()
    sg = None
    del pg


def run(cfg: dict) -> dict[str, Any]:
    got = sharded.spawn_ranks(_worker, cfg, prefix="eltctl-micro-")
    slowest = [max(g["times"][s] for g in got) for s in range(cfg["steps"])]
    return {"step_s": statistics.median(slowest[WARMUP:] or slowest[-1:]),
            "between_bytes": [g["between_bytes"] for g in got], "peak_rss_bytes": [g["peak_rss_bytes"] for g in got]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per rank and step")
    ap.add_argument("--batch", type=int, default=2, help="samples per micro-batch")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result: dict[str, Any] = {"parameters": args.layers * (sharded.WIDTH ** 2 + sharded.WIDTH), "micro": args.micro,
                              "batch": args.batch, "worlds": {}}
    for world in args.worlds:
        entry = {}
        for name, rounds in (("local", False), ("each_micro_batch", True)):
            cfg = {"world": world, "micro": args.micro, "batch": args.batch, "steps": args.steps,
                   "layers": args.layers, "rounds": rounds, "name": f"{name}-{world}"}
            entry[name] = run(cfg)
        loc, each = entry["local"], entry["each_micro_batch"]
        entry["ratios"] = {"between_bytes": max(each["between_bytes"]) / max(loc["between_bytes"]),
                           "peak_rss": max(each["peak_rss_bytes"]) / max(loc["peak_rss_bytes"]),
                           "step_s": each["step_s"] / loc["step_s"]}
        result["worlds"][str(world)] = entry
        if not args.json:
            mib = 2 ** 20
            print(f"world {world}, {args.micro} micro-batches of {args.batch} per rank, "
                  f"{result['parameters'] / 1e6:.1f} M parameters (ZeRO-2, AdamW):")
            for name in ("local", "each_micro_batch"):
                r = entry[name]
                print(f"  {name:17s} kept between micro-batches {max(r['between_bytes']) / mib:7.1f} MiB, "
                      f"peak RSS {max(r['peak_rss_bytes']) / mib:7.1f} MiB, step {r['step_s']:.3f} s")
            q = entry["ratios"]
            print(f"  each / local: kept {q['between_bytes']:.3f}x, peak RSS {q['peak_rss']:.3f}x, "
                  f"step {q['step_s']:.2f}x")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

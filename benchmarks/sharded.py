"""The sharded-state benchmark (skeleton): per-rank bytes and step time of ZeRO-1/2 against replicated.

    .venv/bin/python benchmarks/sharded.py [--json] [--worlds 2 4] [--steps 3] [--batch 4] [--layers 12]

This drives `eltctl_runtime.zero` directly, in plain worker processes on one
gloo group per configuration (spawned, a FileStore, one torch thread each): the
job integration (`ElasticJob(shard=...)`) comes later, and so do the pause per
leave / join / SIGKILL and the ZeroRedundancyOptimizer + torchrun baseline that
issue 22 also asks for.

The model is an MLP of `--layers` Linear(2048, 2048) layers (12: about 50 M
parameters) with AdamW, where the optimizer state dominates. For each world
size it runs replicated training (gradients all-reduced bucket by bucket from
backward hooks, every rank steps everything), then shard="optimizer" (ZeRO-1)
and shard="gradients" (ZeRO-2), each with shard_replicas 1 and 2, and reports
per rank:

- optimizer-state bytes and gradient bytes kept between steps, and their ratio
  to replicated (targets: 1/N with one replica, 2/N with two, within 5 %; the
  gradient target applies to ZeRO-2 only: ZeRO-1 keeps full gradients);
- the stepped copies of the shard's parameters (`shard_params`, 1/N or 2/N);
- peak RSS per rank (ru_maxrss);
- the steady step time (median over the timed steps of the slowest rank's
  step, the first step excluded) and its ratio to replicated (target <= 1.10).

The machine is shared (2 cores here): keep runs short, and read the step-time
ratios as rough.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

WIDTH = int(os.environ.get("ELTCTL_BENCH_WIDTH", "2048"))  # smaller only to try the script out
BUCKET_MB = 25.0


def _model(layers: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _group(store_path: str, name: str, rank: int, world: int):
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=300)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore(name, dist.FileStore(store_path, world)), rank, world, opts)


class _Replicated:
    """Today's path, for comparison: .grad are views of one flat buffer per dtype,
    each bucket all-reduced from backward hooks as it completes."""

    def __init__(self, params, pg) -> None:
        import torch

        from eltctl_runtime import collectives, gradients

        self._c = collectives
        self.params, self.pg = params, pg
        self.lay = gradients.layout_for(params, BUCKET_MB)
        self.flats = [torch.zeros(n, dtype=params[0].dtype) for n in self.lay.lengths]
        self.bucket_of = {i: b for b, bk in enumerate(self.lay.buckets) for i in bk.members}
        for p, s in zip(params, self.lay.slots):
            p.grad = self.flats[s.group][s.offset:s.offset + s.numel].view_as(p)
        self.ready = [0] * len(self.lay.buckets)
        self.works: list = []
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._ready(i))

    def _ready(self, i: int) -> None:
        self.ready[self.bucket_of[i]] += 1
        while len(self.works) < len(self.lay.buckets):
            b = len(self.works)
            bk = self.lay.buckets[b]
            if self.ready[b] < len(bk.members):
                break
            self.works.append(self._c.allreduce_async(self.pg, self.flats[bk.group][bk.start:bk.end]))

    def finish(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.ready = [], [0] * len(self.lay.buckets)

    def zero(self) -> None:
        for f in self.flats:
            f.zero_()


def _worker(cfg: dict, rank: int, store_path: str, out) -> None:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(cfg.get("hang_s", 600), exit=True)  # a hung worker says where

    from eltctl_runtime import zero

    torch.set_num_threads(1)
    world = cfg["world"]
    model = _model(cfg["layers"])
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    pg = _group(store_path, cfg["name"], rank, world)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], WIDTH, generator=gen)
    times = []
    sg = None
    if cfg["shard"] is None:
        path = _Replicated(params, pg)
        for _ in range(cfg["steps"]):
            t0 = time.perf_counter()
            (model(x).square().mean() / world).backward()
            path.finish()
            opt.step()
            path.zero()
            times.append(time.perf_counter() - t0)
        opt_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
        mem = {"optimizer_state": opt_bytes, "gradients": sum(f.numel() * f.element_size() for f in path.flats),
               "shard_params": 0}
    else:
        members = [zero.Member(f"w{r}", f"host{r}") for r in range(world)]
        lay = zero.shard_layout(params, opt, members, cfg["replicas"], BUCKET_MB)
        sg = zero.ShardedGradients(params, opt, lay, rank, cfg["shard"])
        sg.bind()
        with sg.attached():
            for _ in range(cfg["steps"]):
                t0 = time.perf_counter()
                sg.begin(pg)
                (model(x).square().mean() / world).backward()
                sg.finish()
                sg.step()
                sg.zero_grad()
                times.append(time.perf_counter() - t0)
        mem = sg.memory()
    out.put({"rank": rank, "times": times, "memory": mem,
             "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    pg.barrier().wait()  # nobody drops the group while a peer still uses it
    path = sg = None
    del pg


def run_config(cfg: dict) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="eltctl-sharded-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(cfg, r, store, out)) for r in range(cfg["world"])]
        for p in procs:
            p.start()
        got = [out.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a worker of {cfg['name']} failed: exit codes {[p.exitcode for p in procs]}")
    got.sort(key=lambda g: g["rank"])
    slowest = [max(g["times"][s] for g in got) for s in range(cfg["steps"])]
    return {"step_s": statistics.median(slowest[1:] if len(slowest) > 1 else slowest),
            "memory": [g["memory"] for g in got], "peak_rss_bytes": [g["peak_rss_bytes"] for g in got]}


def measure(worlds: list[int], steps: int, batch: int, layers: int, progress=print) -> dict[str, Any]:
    n_params = layers * (WIDTH * WIDTH + WIDTH)
    result: dict[str, Any] = {"parameters": n_params, "optimizer": "AdamW", "dtype": "float32",
                              "steps": steps, "batch_per_rank": batch, "worlds": {}}
    for world in worlds:
        base_cfg = {"world": world, "steps": steps, "batch": batch, "layers": layers}
        rep = run_config({**base_cfg, "name": f"rep{world}", "shard": None, "replicas": 1})
        progress(f"world {world} replicated: step {rep['step_s']:.3f} s")
        rep_opt = max(m["optimizer_state"] for m in rep["memory"])
        rep_grad = max(m["gradients"] for m in rep["memory"])
        entry: dict[str, Any] = {"replicated": {"step_s": rep["step_s"], "optimizer_state_bytes": rep_opt,
                                                "gradient_bytes": rep_grad,
                                                "peak_rss_bytes": max(rep["peak_rss_bytes"])}}
        for shard in ("optimizer", "gradients"):
            for replicas in (1, 2):
                name = f"{shard}-r{replicas}"
                r = run_config({**base_cfg, "name": f"{name}-{world}", "shard": shard, "replicas": replicas})
                target = replicas / world
                opt_ratio = max(m["optimizer_state"] for m in r["memory"]) / rep_opt
                grad_ratio = max(m["gradients"] for m in r["memory"]) / rep_grad
                entry[name] = {
                    "step_s": r["step_s"], "step_vs_replicated": r["step_s"] / rep["step_s"],
                    "optimizer_state_bytes": [m["optimizer_state"] for m in r["memory"]],
                    "gradient_bytes": [m["gradients"] for m in r["memory"]],
                    "shard_param_bytes": [m["shard_params"] for m in r["memory"]],
                    "peak_rss_bytes": r["peak_rss_bytes"],
                    "optimizer_state_ratio": opt_ratio, "gradient_ratio": grad_ratio, "target_ratio": target,
                    "optimizer_state_on_target": abs(opt_ratio - target) <= 0.05 * target,
                    "gradients_on_target": (abs(grad_ratio - target) <= 0.05 * target) if shard == "gradients"
                    else None,
                    "step_on_target": r["step_s"] / rep["step_s"] <= 1.10,
                }
                progress(f"world {world} {name}: step {r['step_s']:.3f} s ({r['step_s'] / rep['step_s']:.2f}x), "
                         f"optimizer state {opt_ratio:.3f} of replicated, gradients {grad_ratio:.3f} "
                         f"(target {target:.3f})")
        result["worlds"][str(world)] = entry
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=3, help="steps per configuration (the first is not timed)")
    ap.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    ap.add_argument("--layers", type=int, default=12, help="Linear(2048, 2048) layers (12: about 50 M parameters)")
    args = ap.parse_args()
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    result = measure(args.worlds, args.steps, args.batch, args.layers, log)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

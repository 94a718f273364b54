"""The sharded-state benchmark: per-rank bytes, step time and pauses of ZeRO-1/2 against replicated.

    .venv/bin/python benchmarks/sharded.py [--json] [--worlds 2 4] [--steps 6] [--batch 4] [--layers 12]
        [--job-steps 10] [--step-repeats 1] [--job-args "--bucket-mb 25"] [--skip-memory]
        [--baseline zero-torchrun [--baseline-world 2 4] [--pause-repeats 3] [--skip-torchrun] [--eltctl-runs NAME ...]]

Its memory part drives `eltctl_runtime.train.zero` directly, in plain worker processes on one
gloo group per configuration (spawned, a FileStore, one torch thread each).

`--baseline zero-torchrun` adds the pause baseline issue 22 compares against:
a ZeroRedundancyOptimizer (AdamW) + DDP job on the same model, under torchrun
(torch.distributed.run, --nnodes MIN:MAX, c10d rendezvous on localhost, elastic,
--max-restarts), one agent per simulated node, started at each `--baseline-world`
(2) agents, through a planned leave (SIGTERM to an agent), a join (a new
agent) and a crash (SIGKILL of a worker); for each, the pause from the last step
of the old worker generation to the first step of the new one, and the steps
redone (benchmarks/_baselines.py drives the job; benchmarks/baselines/zero_worker.py
is the worker: a consolidated checkpoint every `--baseline-ckpt-every` steps).
Beside it, the same events on eltctl's job (examples/train.py on `ElasticJob(shard=...)`,
benchmarks/_eltctl_side.py: a store here (`--store socket`, the default: the keeper's
Unix-socket store with every value signed, as under eltctl's controller), one worker process per rank, a leave
request through the store, a new worker, a SIGKILL reported dead as the host
daemon would) for each of `--eltctl-runs` (replicated, optimizer-r1,
gradients-r1, optimizer-r2, gradients-r2 by default), with a checkpoint every
`--baseline-ckpt-every` steps like the baseline (with shard_replicas=1 a SIGKILL
restores the lost shards from it) and each event fired 2 steps past one: the
pause from the last step at the old size to the first step at the new one, the
steps redone, per sharded run and event the ratio to replicated (target <= 2x)
and the baseline's pause over it (target >= 20x), the same two ratios of the time
each event cost the job (`lost_s`, both sides alike: the pause less one steady step at
the new size, which the first step there would have taken anyway, plus one such step
per step redone; the steady step is the run's own median at that size, the
`step_s_by_world`), and per worker where the pause
went ("phases": the job's pause phases and each move of the shards, from the
workers' logs with examples/train.py --debug). `--skip-torchrun` measures
eltctl's side alone. Where this tree's ElasticJob or examples/train.py lacks
`shard=` / `--shard`, that part says "not available" and why. eltctl's SIGKILL goes
from 2 workers to 1 (the job carries on without the dead rank); the baseline's
from 2 to 2 (torchrun restarts the whole group with the dead worker replaced).

For each of `--worlds` the whole job's steady step time (examples/train.py on
ElasticJob, a fixed-size run of `--job-steps`, no checkpoints, rank 0's median
step interval after `--job-warmup` steps) of each sharded run against
replicated (target <= 1.10); `--job-steps 0` skips it. `--step-repeats N`: N such
jobs per run, in turns, each against its own turn's replicated job, and the medians (the
ratio of one job moved by +-0.1 between runs here, more than the target's margin).
`--worlds` with no value skips the memory/step-time parts.

The model is an MLP of `--layers` Linear(2048, 2048) layers (12: about 50 M
parameters) with AdamW, where the optimizer state dominates. For each world
size it runs replicated training (gradients all-reduced bucket by bucket from
backward hooks, every rank steps everything), then shard="optimizer" (ZeRO-1)
and shard="gradients" (ZeRO-2), each with shard_replicas 1 and 2, and reports
per rank:

- optimizer-state bytes and gradient bytes kept between steps, and their ratio
  to replicated (targets: 1/N with one replica, 2/N with two, within 5 %; the
  gradient target applies to ZeRO-2 only: ZeRO-1 keeps full gradients);
- the stepped copies of the shard's parameters (`shard_params`: only the backups' with two
  replicas, 1/N; a rank's own chunk, and every chunk where a rank holds them all, steps
  the parameters themselves);
- on the CPU, the pre-step copy's buffers (`step_undo`) and ZeRO-2's staging pool
  (`staging`), both kept from step to step;
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
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
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

        from eltctl_runtime.member import collectives
        from eltctl_runtime.train import gradients

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

    from eltctl_runtime.train import zero

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


# The memory part's steps not timed: the first makes the optimizer state, the second (sharded)
# the pre-step copy's buffers, each a fresh allocation paid in page faults (with one untimed
# step, ZeRO-1 at world 2 read 1.62x replicated in session 23, its steady steps about 1x).
MEMORY_WARMUP_STEPS = 2


def spawn_ranks(worker, cfg: dict, prefix: str = "eltctl-sharded-") -> list[dict]:
    """Run `worker(cfg, rank, store_path, out)` in cfg["world"] spawned processes on one
    FileStore; each puts one report (a dict with its "rank") on `out`. The reports, by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=worker, args=(cfg, r, store, out)) for r in range(cfg["world"])]
        for p in procs:
            p.start()
        got = [out.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a worker of {cfg['name']} failed: exit codes {[p.exitcode for p in procs]}")
    return sorted(got, key=lambda g: g["rank"])


def run_config(cfg: dict) -> dict[str, Any]:
    got = spawn_ranks(_worker, cfg)
    slowest = [max(g["times"][s] for g in got) for s in range(cfg["steps"])]
    steady = slowest[MEMORY_WARMUP_STEPS:] or slowest[-1:]
    return {"step_s": statistics.median(steady),
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
                    # kept between steps on the CPU: the pre-step copy's buffers, ZeRO-2's staging pool
                    "step_undo_bytes": [m.get("step_undo", 0) for m in r["memory"]],
                    "staging_bytes": [m.get("staging", 0) for m in r["memory"]],
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


# ---------------------------------------------------------------------------- pauses

EVENTS = ("leave", "join", "kill")


def measure_zero_torchrun(world: int = 2, ckpt_every: int = 5, cap_s: float = 300.0, layers: int = 12,
                          steady_steps: int = 6, progress=print, repeats: int = 1) -> dict[str, Any]:
    """The ZeroRedundancyOptimizer + DDP job under torchrun through a leave, a join and a SIGKILL
    (from `world` agents: world -> world-1 -> world -> world), with each event's pause; with
    `repeats`, that many jobs one after another, each figure the median over them (`_sampled`)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _baselines

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baselines", "zero_worker.py")
    saved_worker, saved_env = _baselines.WORKER, os.environ.get("ELTCTL_ZERO_LAYERS")
    _baselines.WORKER = _baselines.Path(worker)  # same command line and step log as ddp_worker.py
    os.environ["ELTCTL_ZERO_LAYERS"] = str(layers)
    results = []
    try:
        for i in range(repeats):
            results.append(_baselines.measure_torchrun(
                EVENTS, nodes=world, min_nodes=1, max_nodes=world + 1, ckpt_every=ckpt_every, event_cap_s=cap_s,
                settle_steps=3, steady_steps=max(steady_steps, ckpt_every + 1), resumed_steps=2,
                event_phase=ckpt_every // 2, keep_workdir=bool(os.environ.get("ELTCTL_BENCH_KEEP"))))
            for e in results[-1].get("events", []):
                progress(f"zero-torchrun ({i + 1}/{repeats}) {e['event']}: pause {e.get('pause_s')} s, lost "
                         f"{e.get('lost_s')} s, world {e.get('old_world')} -> {e.get('new_world')}, steps redone "
                         f"{e.get('steps_lost')}" + (f" ({e['error']})" if e.get("error") else ""))
    finally:
        _baselines.WORKER = saved_worker
        if saved_env is None:
            os.environ.pop("ELTCTL_ZERO_LAYERS", None)
        else:
            os.environ["ELTCTL_ZERO_LAYERS"] = saved_env
    res = results[0] | _sampled([r.get("events", []) for r in results])
    res["step_s_by_world"] = [r.get("step_s_by_world") for r in results]
    res["errors"] = [r["error"] for r in results if r.get("error")]
    res["system"] = "torchrun c10d elastic, DDP + ZeroRedundancyOptimizer(AdamW)"
    res["settings"] |= {"model": f"MLP {layers} x Linear({WIDTH}, {WIDTH})", "parameters": layers * (WIDTH * WIDTH + WIDTH),
                        "batch_per_rank": int(os.environ.get("ELTCTL_ZERO_BATCH", "4")),
                        "checkpoint": "consolidate_state_dict(to=0) + torch.save by rank 0"}
    res["settings"].pop("global_batch", None)
    if repeats > 1:
        progress(f"zero-torchrun, medians of {repeats}: " + ", ".join(
            f"{ev} pause {p} s, lost {res['lost_s'].get(ev)} s, {res['steps_redone'].get(ev)} redone"
            for ev, p in res["pauses_s"].items()))
    return res


def eltctl_shard_support() -> str | None:
    """None if this tree's ElasticJob takes shard= and examples/train.py --shard, else why not."""
    import inspect

    try:
        from eltctl_runtime.train.job import ElasticJob
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"eltctl_runtime.train.job does not import: {exc}"
    if "shard" not in inspect.signature(ElasticJob).parameters:
        return "ElasticJob has no shard= in this tree (issue 22's job wiring is not merged)"
    from eltctl_runtime.train import zero

    if not hasattr(zero, "sharded_path"):
        return "ElasticJob(shard=...) is refused in this tree: zero.sharded_path (the job's sharded gradient path) is not merged"
    train = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train.py")
    with open(train, encoding="utf-8") as f:
        if '"--shard"' not in f.read():
            return "examples/train.py has no --shard option"
    return None


ELTCTL_RUNS = {  # name -> examples/train.py options
    "replicated": (),
    "optimizer-r1": ("--shard", "optimizer"),
    "gradients-r1": ("--shard", "gradients"),
    "optimizer-r2": ("--shard", "optimizer", "--shard-replicas", "2"),
    "gradients-r2": ("--shard", "gradients", "--shard-replicas", "2"),
}
DEFAULT_RUNS = ("replicated", "optimizer-r1", "gradients-r1", "optimizer-r2", "gradients-r2")


def _train_args(world: int, layers: int, batch: int) -> tuple[str, ...]:
    """examples/train.py options for the benchmark's MLP: the toy model's first layer
    (64 -> width) and last (width -> 16) around `layers` - 1 hidden ones, so `layers` + 1
    there gives the same `layers` Linear(width, width) as here (about 50.5 M parameters
    for 12, against 50.4 M), AdamW, `batch` samples per rank at `world`."""
    return ("--batch", str(batch * world), "--optimizer", "adamw", "--lr", "1e-4", "--hidden", str(WIDTH),
            "--layers", str(layers + 1))


def _medians(samples: list[list[dict[str, Any]]], key: str) -> dict[str, Any]:
    """Per event, the median of `key` over the samples (each a run's list of event figures)
    that have it; None where none has."""
    by_event: dict[str, list] = {}
    for events in samples:
        for e in events:
            by_event.setdefault(e["event"], [])
            if e.get(key) is not None:
                by_event[e["event"]].append(e[key])
    return {ev: (round(statistics.median(v), 4) if v else None) for ev, v in by_event.items()}


def _sampled(samples: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """A configuration's figures over its samples: the medians of the pause, the time lost and
    the steps redone per event, each sample's values, and the first sample's events (with the
    phases) in full."""
    keys = {"pauses_s": "pause_s", "lost_s": "lost_s", "steps_redone": "steps_lost"}
    out: dict[str, Any] = {name: _medians(samples, key) for name, key in keys.items()}
    out["samples"] = len(samples)
    out["per_sample"] = {name: [{e["event"]: e.get(key) for e in events} for events in samples]
                         for name, key in keys.items()}
    out["events"] = samples[0]
    out["events_of_later_samples"] = samples[1:]
    return out


def measure_eltctl_pauses(world: int = 2, layers: int = 12, cap_s: float = 300.0, runs=DEFAULT_RUNS,
                          ckpt_every: int = 5, batch: int = 4, job_args: tuple[str, ...] = (),
                          progress=print, store: str = "socket", repeats: int = 1,
                          base_env: dict[str, str] | None = None) -> dict[str, Any]:
    """eltctl through the same events (leave, join, SIGKILL) at `world` as the torchrun job,
    for each of `runs` (ELTCTL_RUNS: sharded and replicated) on the same MLP, with a
    checkpoint every `ckpt_every` steps (as the baseline; with shard_replicas=1 a SIGKILL
    restores the lost shards from it) and each event fired 2 steps past one (as the
    baseline's); "not available" (with the reason) where the job does not take shard= yet.
    `repeats` jobs per configuration, taken in turns (every configuration once, then again),
    so that a change in the machine's load reaches each alike; each figure is the median
    over them (`_sampled`). `base_env` (--base): each configuration also as "NAME@base", the
    other revision's runtime, in the same turns."""
    why = eltctl_shard_support()
    if why is not None:
        progress(f"eltctl pauses: not available: {why}")
        return {"available": False, "reason": why}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _eltctl_side

    base = (*_train_args(world, layers, batch), "--steps", "1000000", "--checkpoint-every", str(ckpt_every),
            "--debug", *job_args)  # --debug: the pause phases in the workers' logs (each event's "phases")
    out: dict[str, Any] = {"available": True, "world": world, "store": store, "checkpoint_every": ckpt_every,
                           "model": f"examples/toy.py MLP, {layers} x Linear({WIDTH}, {WIDTH}) between 64 -> {WIDTH} "
                                    f"and {WIDTH} -> 16", "batch_per_rank": batch, "job_args": list(job_args),
                           "repeats": repeats, "runs": {}}
    envs = {name: {} for name in runs}
    if base_env is not None:
        envs = {k: v for name in runs for k, v in ((name, {}), (f"{name}@base", base_env))}
    runs = list(envs)
    samples: dict[str, list] = {name: [] for name in runs}
    errors: dict[str, dict[str, Any]] = {}
    walls: dict[str, float] = {name: 0.0 for name in runs}
    steps_by_world: dict[str, list] = {name: [] for name in runs}
    for i in range(repeats):
        for name in runs:
            t0 = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="eltctl-sharded-pauses-") as tmp:
                try:
                    r = _eltctl_side.measure_eltctl(
                        EVENTS, nodes=world, settle_steps=3, resumed_steps=2, event_cap_s=cap_s,
                        worker_args=base + ELTCTL_RUNS[name.removesuffix("@base")], workdir=Path(tmp) / "work",
                        env={"ELTCTL_CHECKPOINT_DIR": str(Path(tmp) / "ckpt"), **envs[name]},
                        event_phase=(ckpt_every, min(2, ckpt_every - 1)), store=store)
                    samples[name].append(r["events"])
                    steps_by_world[name].append(r.get("step_s_by_world"))
                    progress(f"eltctl {name} ({i + 1}/{repeats}): " + ", ".join(
                        f"{e['event']} pause {e.get('pause_s')} s, lost {e.get('lost_s')} s, "
                        f"{e.get('steps_lost')} redone" for e in r["events"]))
                except Exception as exc:  # noqa: BLE001 - one configuration failing does not hide the others
                    errors.setdefault(name, {"error": f"{type(exc).__name__}: {exc}"})
                    progress(f"eltctl {name} ({i + 1}/{repeats}): {type(exc).__name__}: {exc}")
                if os.environ.get("ELTCTL_BENCH_KEEP"):  # the workers' logs and progress files, kept
                    keep = tempfile.mkdtemp(prefix=f"eltctl-sharded-{name}-")
                    shutil.copytree(Path(tmp) / "work", Path(keep) / "work", dirs_exist_ok=True)
                    progress(f"eltctl {name} ({i + 1}/{repeats}): the workers' logs kept in {keep}")
                    if name in errors:
                        errors[name].setdefault("logs", keep)
            walls[name] += time.monotonic() - t0
    for name in runs:
        run = _sampled(samples[name]) if samples[name] else {}
        if name in errors:
            run |= errors[name] | {"failed_samples": repeats - len(samples[name])}
        run |= {"step_s_by_world": steps_by_world[name], "wall_s": round(walls[name], 1)}
        out["runs"][name] = run
        if "pauses_s" in run:
            progress(f"eltctl {name}, medians of {run['samples']}: " + ", ".join(
                f"{ev} pause {p} s, lost {run['lost_s'][ev]} s, {run['steps_redone'][ev]} redone"
                for ev, p in run["pauses_s"].items()))
    return out


def measure_job_step_time(world: int = 2, layers: int = 12, steps: int = 12, warmup: int = 3, batch: int = 4,
                          runs=("replicated", "optimizer-r1", "gradients-r1"), job_args: tuple[str, ...] = (),
                          progress=print, store: str = "socket", repeats: int = 1,
                          base_env: dict[str, str] | None = None) -> dict[str, Any]:
    """The steady step time of the whole job (examples/train.py on ElasticJob, fixed size
    `world`, no checkpoints) for each of `runs`, and each sharded one against replicated
    (target <= 1.10): rank 0's median step interval after `warmup` steps. `repeats` > 1:
    that many jobs per run, taken in turns, each sharded one against the replicated job of
    its own turn; the figures are the medians (every job's kept under "samples")."""
    why = eltctl_shard_support()
    if why is not None:
        progress(f"job step time: not available: {why}")
        return {"available": False, "reason": why}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _eltctl_side

    out: dict[str, Any] = {"available": True, "world": world, "store": store, "steps": steps, "warmup": warmup,
                           "job_args": list(job_args), "repeats": repeats, "runs": {}}
    envs = {name: None for name in runs}
    if base_env is not None:  # --base: each run also as "NAME@base", in the same turns
        envs = {k: v for name in runs for k, v in ((name, None), (f"{name}@base", base_env))}
    runs = list(envs)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for i in range(repeats):
        turn: dict[str, dict[str, Any]] = {}
        for name in runs:
            try:
                r = _eltctl_side.measure_eltctl_step_time(
                    world, steps, warmup, timeout_s=max(600.0, 20.0 * steps),
                    extra_args=(*_train_args(world, layers, batch), *job_args, *ELTCTL_RUNS[name.removesuffix("@base")]),
                    store=store, env=envs[name])
            except Exception as exc:  # noqa: BLE001 - reported
                r = {"error": f"{type(exc).__name__}: {exc}"}
            turn[name] = r
            ref = "replicated@base" if name.endswith("@base") else "replicated"
            rep = turn.get(ref, {}).get("median_step_s")
            if r.get("median_step_s") and rep and name != ref:
                r["vs_replicated"] = round(r["median_step_s"] / rep, 3)
                r["on_target"] = r["median_step_s"] / rep <= 1.10
            samples[name].append(r)
            progress(f"job step time {name}" + (f" ({i + 1}/{repeats})" if repeats > 1 else "")
                     + f": median {r.get('median_step_s')} s over {r.get('steps_measured')} steps"
                     + (f" ({r['vs_replicated']:.2f}x replicated)" if "vs_replicated" in r else "")
                     + (f" ({r['error']})" if "error" in r else ""))
    for name, got in samples.items():
        if repeats == 1:
            out["runs"][name] = got[0]
            continue
        run: dict[str, Any] = {"samples": got}
        steps_s = [g["median_step_s"] for g in got if g.get("median_step_s")]
        ratios = [g["vs_replicated"] for g in got if "vs_replicated" in g]
        if steps_s:
            run["median_step_s"] = round(statistics.median(steps_s), 5)
        if ratios:
            run["vs_replicated"] = round(statistics.median(ratios), 3)
            run["on_target"] = run["vs_replicated"] <= 1.10
            progress(f"job step time {name}, medians of {len(ratios)}: {run['vs_replicated']:.2f}x replicated "
                     f"(each turn: {', '.join(f'{x:.2f}x' for x in ratios)})")
        out["runs"][name] = run
    return out


def pause_comparison(eltctl: dict[str, Any], torchrun: dict[str, Any]) -> dict[str, Any]:
    """Per event: each sharded run's pause against replicated (target <= 2x) and against the
    torchrun ZeRO job (target: >= 20x shorter), with the steps each redid; and the same two
    ratios of the time each event cost (`lost_s`: the pause less the first step's own time,
    plus the steps redone; no ratio where eltctl's is not above 0)."""
    if not eltctl.get("available"):
        return {"available": False, "reason": eltctl.get("reason")}
    tr = torchrun.get("pauses_s") or {}
    tr_cost = torchrun.get("lost_s") or {}
    tr_lost = torchrun.get("steps_redone") or {}
    out: dict[str, Any] = {}
    for name, run in eltctl["runs"].items():
        if "pauses_s" not in run:
            continue
        if name.endswith("@base"):  # --base: against the base revision's replicated run
            ref = eltctl["runs"].get("replicated@base") or {}
            rep, rep_lost = ref.get("pauses_s") or {}, ref.get("lost_s") or {}
        else:
            ref = eltctl["runs"].get("replicated") or {}
            rep, rep_lost = ref.get("pauses_s") or {}, ref.get("lost_s") or {}
        for ev, p in run["pauses_s"].items():
            row: dict[str, Any] = {"pause_s": p, "steps_redone": run["steps_redone"].get(ev),
                                   "replicated_pause_s": rep.get(ev), "torchrun_pause_s": tr.get(ev),
                                   "torchrun_steps_redone": tr_lost.get(ev)}
            if p and rep.get(ev):
                row["vs_replicated"] = round(p / rep[ev], 3)
                row["vs_replicated_on_target"] = p / rep[ev] <= 2.0
            if p and tr.get(ev):
                row["torchrun_over_eltctl"] = round(tr[ev] / p, 1)
                row["torchrun_on_target"] = tr[ev] / p >= 20.0
            lost = (run.get("lost_s") or {}).get(ev)
            row |= {"lost_s": lost, "replicated_lost_s": rep_lost.get(ev), "torchrun_lost_s": tr_cost.get(ev)}
            if lost is not None and lost > 0:
                if rep_lost.get(ev) is not None and rep_lost[ev] > 0:
                    row["lost_vs_replicated"] = round(lost / rep_lost[ev], 3)
                if tr_cost.get(ev):
                    row["torchrun_over_eltctl_lost"] = round(tr_cost[ev] / lost, 1)
            out[f"{name}/{ev}"] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4], help="none: skip the memory / step-time part")
    ap.add_argument("--baseline", choices=("zero-torchrun",), default=None,
                    help="also measure pauses: the ZeroRedundancyOptimizer + DDP job under torchrun, and eltctl's")
    ap.add_argument("--baseline-world", type=int, nargs="+", default=[2],
                    help="world sizes the pauses are measured at, each on its own (e.g. 2 4): the JSON's "
                         "pauses_by_world; its pauses are those of the first")
    ap.add_argument("--baseline-ckpt-every", type=int, default=5, help="steps between the baseline's checkpoints")
    ap.add_argument("--baseline-cap", type=float, default=300.0, help="seconds each event may take at most")
    ap.add_argument("--pause-repeats", type=int, default=1,
                    help="jobs per configuration (and torchrun jobs) through the events at each world: each "
                         "pause, time lost and steps redone is the median over them, each job's in per_sample")
    ap.add_argument("--steps", type=int, default=6,
                    help="steps per configuration of the memory part (the first MEMORY_WARMUP_STEPS are not timed)")
    ap.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    ap.add_argument("--layers", type=int, default=12, help="Linear(2048, 2048) layers (12: about 50 M parameters)")
    ap.add_argument("--eltctl-runs", nargs="*", choices=tuple(ELTCTL_RUNS), default=list(DEFAULT_RUNS),
                    help="eltctl job configurations for the job step time and the pauses (replicated is the "
                         "reference of both; none: skip eltctl's job)")
    ap.add_argument("--job-steps", type=int, default=10,
                    help="steps of each fixed-size eltctl job timed at each of --worlds (0: skip)")
    ap.add_argument("--job-warmup", type=int, default=3, help="of those, steps not timed")
    ap.add_argument("--step-repeats", type=int, default=1,
                    help="jobs per run for the steady step, in turns; the medians are reported")
    ap.add_argument("--skip-torchrun", action="store_true",
                    help="with --baseline: eltctl's pauses only (no torchrun job; no ratios against it)")
    ap.add_argument("--skip-memory", action="store_true",
                    help="leave out the memory / raw step-time part (the job step time still runs at --worlds)")
    ap.add_argument("--job-args", default="", help="more examples/train.py options for eltctl's job (e.g. "
                                                  "'--bucket-mb 25'; its default bucket is 4 MB)")
    ap.add_argument("--base", type=Path, default=None,
                    help="a checkout of another revision (git worktree add DIR REV): every eltctl run also with "
                         "its runtime (NAME@base), in the same turns, for a side-by-side comparison")
    ap.add_argument("--store", choices=("socket", "c10d"), default="socket",
                    help="eltctl's job store: socket (as under eltctl's controller: the keeper's Unix-socket "
                         "store, every value signed) or c10d (an unsigned TCPStore, this benchmark's setup "
                         "before session 15)")
    args = ap.parse_args()
    job_args = tuple(shlex.split(args.job_args))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _eltctl_side

    benv = _eltctl_side.base_env(args.base)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout ends the workers too (the finally blocks)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    t0 = time.monotonic()
    result = measure([] if args.skip_memory else args.worlds, args.steps, args.batch, args.layers, log)
    if args.job_steps and args.eltctl_runs:
        result["job_step_time"] = {str(w): measure_job_step_time(w, args.layers, args.job_steps, args.job_warmup,
                                                                 args.batch, args.eltctl_runs, job_args, progress=log,
                                                                 store=args.store, repeats=args.step_repeats,
                                                                 base_env=benv)
                                   for w in args.worlds}
    if args.baseline == "zero-torchrun":
        result["pauses_by_world"] = {}
        for world in args.baseline_world:
            log(f"pauses at world {world}")
            tr = ({"skipped": True, "pauses_s": {}} if args.skip_torchrun else
                  measure_zero_torchrun(world, args.baseline_ckpt_every, args.baseline_cap, args.layers,
                                        progress=log, repeats=args.pause_repeats))
            el = (measure_eltctl_pauses(world, args.layers, args.baseline_cap, args.eltctl_runs,
                                        args.baseline_ckpt_every, args.batch, job_args, progress=log,
                                        store=args.store, repeats=args.pause_repeats, base_env=benv) if args.eltctl_runs
                  else {"available": False, "reason": "--eltctl-runs is empty"})
            result["pauses_by_world"][str(world)] = {"zero_torchrun": tr, "eltctl": el,
                                                     "comparison": pause_comparison(el, tr)}
        result["pauses"] = result["pauses_by_world"][str(args.baseline_world[0])]
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

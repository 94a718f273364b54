"""A complete elastic training script on the toy model (examples/toy.py).

Launch it with the environment contract of runtime/README.md (ELTCTL_STORE,
ELTCTL_JOB, ELTCTL_WORKER_ID, ...); start more copies to grow the job, send
SIGTERM to one to make it leave at the next step boundary. Everything elastic
is in the three lines marked (*).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402

import eltctl_runtime as elt  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--batch", type=int, default=64, help="global batch size (constant whatever the world size)")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default="adam",
                    help="the optimizer (each of them also sharded: --shard)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--bucket-mb", type=float, default=4.0,
                    help="gradient all-reduce bucket size; 0: one all-reduce after backward")
    ap.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="what float32 gradients travel as in the all-reduce (bf16: half the bytes; "
                         "replicated training only; with --sync-every: each round's averaging)")
    ap.add_argument("--compress", choices=("powersgd",), default=None,
                    help="send big float32 gradient matrices as low-rank factors with error feedback "
                         "(PowerSGD; replicated training only)")
    ap.add_argument("--compress-rank", type=int, default=None, help="the factors' rank with --compress (default 4)")
    ap.add_argument("--sync-every", type=int, default=None, metavar="H",
                    help="local steps (DiLoCo): each worker steps on its own gradients, and the workers average "
                         "their parameters every H steps with an outer Nesterov step (replicated training only)")
    ap.add_argument("--sync-overlap", action="store_true",
                    help="with --sync-every: each round's averaging overlaps the next round's steps")
    ap.add_argument("--inner-batch", type=int, default=None, metavar="B",
                    help="with --sync-every: inner steps of at most B samples, so a faster worker (a bigger "
                         "share) takes more inner steps in a step")
    ap.add_argument("--shard", choices=("optimizer", "gradients"), default=None,
                    help="shard the optimizer state (ZeRO-1) or also the gradients (ZeRO-2) across the workers")
    ap.add_argument("--shard-replicas", type=int, choices=(1, 2), default=1,
                    help="ranks holding each shard (2: a crash loses no optimizer state)")
    ap.add_argument("--reduce-each-micro-batch", action="store_true",
                    help="with --shard gradients and micro-batches: reduce each micro-batch into the shards, "
                         "so no rank keeps a whole gradient between them (one reduction per micro-batch)")
    ap.add_argument("--checkpoint-every", type=int, default=None, help="steps")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per step (tests)")
    ap.add_argument("--slow-per-sample", type=float, default=0.0,
                    help="seconds of extra work per sample of this worker's share (tests, benchmarks: a slower GPU)")
    ap.add_argument("--slow-at", action="append", default=[], metavar="STEP=SECONDS",
                    help="from committed step STEP on, SECONDS per sample instead (repeatable): a worker slowing down")
    ap.add_argument("--no-balance", action="store_true", help="equal shares (no speed-proportional split)")
    ap.add_argument("--oom-once-above", type=int, default=None, metavar="N",
                    help="raise torch.OutOfMemoryError once, on the first batch of more than N samples (tests)")
    ap.add_argument("--num-workers", type=int, default=0, help="data worker processes (0: load on the training thread)")
    ap.add_argument("--prefetch-steps", type=int, default=2, help="steps' shares prepared ahead by the data workers")
    ap.add_argument("--io-ms", type=float, default=None,
                    help="read the data as records: this many ms of I/O wait plus a CPU decode per sample")
    ap.add_argument("--bad-sample", type=int, default=None, help="this record is corrupt: reading it raises (tests)")
    ap.add_argument("--result", type=Path, default=None, help="write final step, loss and state hash here (JSON)")
    ap.add_argument("--progress", type=Path, default=None, help="append 'step generation world_size time loss' lines")
    ap.add_argument("--debug", action="store_true",
                    help="eltctl_runtime's DEBUG lines too (where each membership change's pause went)")
    args = ap.parse_args(argv)
    slow_at = sorted((int(k), float(v)) for k, v in (x.split("=", 1) for x in args.slow_at))

    config = elt.RuntimeConfig.from_env()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {config.worker_id} %(levelname)s %(message)s")
    if args.debug:
        logging.getLogger("eltctl_runtime").setLevel(logging.DEBUG)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = toy.make_model(hidden=args.hidden, layers=args.layers, seed=args.seed)
    make_opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[args.optimizer]
    optimizer = make_opt(model.parameters(), lr=args.lr)
    dataset = toy.make_dataset(n_samples=args.samples)
    if args.io_ms is not None or args.bad_sample is not None:
        dataset = toy.RecordDataset(dataset, io_ms=args.io_ms or 0.0, bad_index=args.bad_sample)

    job = elt.ElasticJob(  # (*)
        model, optimizer, dataset, global_batch_size=args.batch, seed=args.seed, max_steps=args.steps,
        epochs=args.epochs, micro_batch_size=args.micro_batch, checkpoint_every_steps=args.checkpoint_every,
        config=config, bucket_mb=args.bucket_mb, balance=not args.no_balance, num_workers=args.num_workers,
        prefetch_steps=args.prefetch_steps, shard=args.shard,
        shard_replicas=args.shard_replicas, reduce_each_micro_batch=args.reduce_each_micro_batch,
        **({} if args.grad_dtype == "fp32" else {"grad_dtype": args.grad_dtype}),  # (a runtime before it: no such argument)
        **({} if args.sync_every is None else {"sync": "local", "sync_every": args.sync_every}),
        **({"sync_overlap": True} if args.sync_overlap else {}),  # (a runtime before it: no such argument)
        **({"inner_batch": args.inner_batch} if args.inner_batch else {}),
        **({} if args.compress is None else {"compress": args.compress, "compress_rank": args.compress_rank}),
    )
    loss = None
    progress = args.progress.open("a", buffering=1) if args.progress else None
    oom = {"armed": args.oom_once_above is not None}

    def compute_loss(batch):
        if oom["armed"] and len(batch[0]) > args.oom_once_above:
            oom["armed"] = False
            raise torch.OutOfMemoryError(f"injected: out of memory on {len(batch[0])} samples")
        return toy.loss_fn(model, batch)

    with job:  # (*)
        for batch in job:
            if args.step_sleep:
                time.sleep(args.step_sleep)
            per_sample = args.slow_per_sample
            for from_step, seconds in slow_at:
                if job.step_count >= from_step:
                    per_sample = seconds
            if per_sample:
                time.sleep(per_sample * len(batch[0]))
            # (*) a function computing the loss: an out-of-memory error in its forward is retried too
            step_loss = job.step(lambda: compute_loss(batch))
            if step_loss is not None:
                loss = step_loss
                if progress:
                    c = job.last_commit  # the step as committed (before a resize that followed it)
                    progress.write(f"{c.step} {c.generation} {c.world_size} {c.time:.6f} {c.loss:.8g}\n")
        if args.result:
            args.result.write_text(json.dumps({
                "worker": config.worker_id, "step": job.step_count, "loss": loss, "rank": job.rank,
                "world_size": job.world_size, "generation": job.generation, "epoch": job.epoch,
                "fingerprint": job.fingerprint(), "left": job.left,
            }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

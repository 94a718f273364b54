"""A sharded training worker for the runtime tests (test_sharded_job.py): the toy
model of examples/train.py with AdamW or SGD (momentum) and `shard=` / `shard_replicas=`.
Same flags and files as examples/train.py (runtime_cluster.Cluster's `script`), and
the final parameters saved next to the result (`<result>.pt`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import toy  # noqa: E402

import eltctl_runtime as elt  # noqa: E402


def die_in_checkpoint(at_step: int) -> None:
    """The job imports checkpoint.save_sharded when it saves, so this wrapper is what it calls."""
    from eltctl_runtime.train.zero import checkpoint

    real_save, real_send = checkpoint.save_sharded, checkpoint._send_bytes

    def send_then_die(*a, **kw):
        real_send(*a, **kw)
        os.kill(os.getpid(), signal.SIGKILL)

    def save(step, state, sg, pg, **kw):
        if step >= at_step and pg.rank() != kw.get("writer", 0):
            checkpoint._send_bytes = send_then_die
        return real_save(step, state, sg, pg, **kw)

    checkpoint.save_sharded = save


def break_in_gather(spec: str, how: str) -> None:
    """Rank 1 breaks the parameter all-gather of the first step at or after STEP (counted
    by the optimizer's steps), after its shard stepped and after gathering the first
    BUCKETS buckets with the others (0: exactly between the shard's step and the gather):
    `how` "die": it SIGKILLs itself; "abort": it raises Aborted once (the generation is
    aborted, nobody dies). The wrapper replaces Stepper.gather_params (the sharded step's),
    which launches each bucket's gather as the shard's step yields it: it steps the shard to
    the end, launching only the first BUCKETS gathers."""
    from eltctl_runtime.member import collectives
    from eltctl_runtime.train.zero.stepper import Stepper

    at_step, n = (int(x) for x in spec.split(":"))
    real = Stepper.gather_params
    done = []

    def gather(self, stepped=None):
        # Called before the shard's step runs (`stepped` drives it): this is step steps_taken() + 1.
        lay = self.place.layout
        if self.place.rank == 1 and lay.world > 1 and self.buffers.steps_taken() + 1 >= at_step and not done:
            done.append(True)
            works = []
            for b in (stepped if stepped is not None else range(len(lay.buckets))):
                if b < n:
                    works.append(self.gather_bucket(b))
            for w in works:
                w.wait()
            if how == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            raise collectives.Aborted(f"test: the all-gather of step {self.buffers.steps_taken()} broken after "
                                      f"{n} buckets")
        return real(self, stepped)

    Stepper.gather_params = gather


def abort_before_restore_check() -> None:
    """The first restore this worker takes part in aborts its generation (once) in the
    restore's first step, its backward done, before its verdict on the checkpoint's hashes
    goes in the control tail (ElasticJob._restore_flag): what every rank took up is not
    trusted yet."""
    from eltctl_runtime.member import collectives
    from eltctl_runtime.train import job

    real = job.ElasticJob._restore_flag
    done = []

    def flag(self):
        if not done:
            done.append(True)
            raise collectives.Aborted("test: the restore's generation aborted before its hashes were confirmed")
        return real(self)

    job.ElasticJob._restore_flag = flag


def abort_after_transfers(who: str) -> None:
    """In the first join or planned leave this worker takes part in as `who`, its reshard
    finishes its transfers, then aborts the generation (once) before this worker takes
    up the new layout. "joiner": it joins (it received all of its chunks and parameters;
    the members finished and hold the new layout; it holds none of its state).
    "member": a member at a join (it keeps the old layout's chunks while the others
    hold the new one's). "survivor": a survivor of a planned leave, whose chunks move in
    the hand-over over the old group (it keeps the old layout's)."""
    from eltctl_runtime.member import collectives
    from eltctl_runtime.train.zero import resharding

    real = resharding.reshard
    done = []

    def reshard(old_layout, new_layout, *a, **kw):
        moved = real(old_layout, new_layout, *a, **kw)
        joining = kw.get("old") is None and kw.get("new") is not None
        both = kw.get("old") is not None and kw.get("new") is not None
        growing = both and new_layout.world > old_layout.world
        shrinking = both and new_layout.world < old_layout.world  # a planned leave's hand_over
        if not done and {"joiner": joining, "member": growing, "survivor": shrinking}[who]:
            done.append(True)
            raise collectives.Aborted(f"test: the reshard aborted on the {who} after its transfers")
        return moved

    resharding.reshard = reshard  # where ShardedPath looks it up


# --optimizer: what the script builds (test_sharded_job.reference builds the same)
OPTIMIZERS = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    # L2 weight decay (added to the gradient) and the running maximum (max_exp_avg_sq)
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr, weight_decay=0.01, amsgrad=True),
    "rmsprop": lambda params, lr: torch.optim.RMSprop(params, lr=lr, eps=1.0, momentum=0.5, centered=True),
}


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](params, lr)


def freeze(model: torch.nn.Module, n: int) -> None:
    """--freeze N: the model's first N parameters stop training after the optimizer was
    built over all of them (fine-tuning's usual form)."""
    for p in list(model.parameters())[:n]:
        p.requires_grad_(False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=480)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    ap.add_argument("--freeze", type=int, default=0, metavar="N",
                    help="the first N parameters frozen (requires_grad=False), though in the optimizer")
    ap.add_argument("--shard", choices=("optimizer", "gradients"), default=None)
    ap.add_argument("--shard-replicas", type=int, default=1)
    ap.add_argument("--reduce-each-micro-batch", action="store_true")
    ap.add_argument("--bucket-mb", type=float, default=0.002)
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--checkpoint-every", type=int, default=None)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--grad-scaler", type=int, default=None, metavar="GROWTH_INTERVAL",
                    help="a CPU GradScaler (init scale 2**10) that doubles its scale every GROWTH_INTERVAL "
                         "steps; the result holds its state")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms (warn only: an op without a deterministic kernel "
                         "warns); on CUDA set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment too")
    ap.add_argument("--debug", action="store_true", help="the runtime's DEBUG lines (each move of the shards)")
    ap.add_argument("--result", type=Path, default=None)
    ap.add_argument("--progress", type=Path, default=None)
    ap.add_argument("--die-in-checkpoint", type=int, default=None, metavar="STEP",
                    help="a rank other than the writer SIGKILLs itself mid-transfer in the sharded checkpoint "
                         "of this step or a later one (after sending its shard's header, before its bytes)")
    ap.add_argument("--die-in-gather", default=None, metavar="STEP:BUCKETS",
                    help="rank 1 SIGKILLs itself in the parameter all-gather of step STEP or a later one, after "
                         "its shard's optimizer step and BUCKETS buckets' all-gathers")
    ap.add_argument("--abort-in-gather", default=None, metavar="STEP:BUCKETS",
                    help="as --die-in-gather, but rank 1 aborts the generation there (once) instead of dying")
    ap.add_argument("--abort-after-transfers", choices=("joiner", "member", "survivor"), default=None,
                    help="in its first join (as the joiner or a member) or planned leave (as a survivor), this "
                         "worker aborts the generation once right after its reshard's transfers, before it "
                         "takes up the new layout")
    ap.add_argument("--abort-before-restore-check", action="store_true",
                    help="the first restore this worker takes part in aborts its generation before the "
                         "checkpoint's hashes are confirmed")
    args = ap.parse_args()
    if args.abort_before_restore_check:
        abort_before_restore_check()
    if args.abort_after_transfers:
        abort_after_transfers(args.abort_after_transfers)
    if args.die_in_checkpoint is not None:
        die_in_checkpoint(args.die_in_checkpoint)
    if args.die_in_gather is not None:
        break_in_gather(args.die_in_gather, "die")
    if args.abort_in_gather is not None:
        break_in_gather(args.abort_in_gather, "abort")

    # The toy model's buffers are a few KB, below what a reshard's recycler takes
    # (hostmem.MIN_BYTES, 1 MiB): here it takes every one, so each reshard carves the new
    # layout's buffers out of the old pre-step copy (or a joiner's prepared memory) as a
    # real model's do, and every exactness check in these tests covers that path.
    from eltctl_runtime.train.zero import hostmem

    hostmem.MIN_BYTES = 1
    config = elt.RuntimeConfig.from_env()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {config.worker_id} %(levelname)s %(message)s")
    if args.debug:
        logging.getLogger("eltctl_runtime").setLevel(logging.DEBUG)
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(args.seed)
    model = toy.make_model(hidden=args.hidden, layers=args.layers, seed=args.seed)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    freeze(model, args.freeze)
    dataset = toy.make_dataset(n_samples=args.samples)
    scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=args.grad_scaler)
              if args.grad_scaler else None)
    job = elt.ElasticJob(model, optimizer, dataset, global_batch_size=args.batch, seed=args.seed,
                         max_steps=args.steps, micro_batch_size=args.micro_batch,
                         checkpoint_every_steps=args.checkpoint_every, config=config, bucket_mb=args.bucket_mb,
                         max_grad_norm=args.max_grad_norm, balance=False, shard=args.shard,
                         shard_replicas=args.shard_replicas, grad_scaler=scaler,
                         reduce_each_micro_batch=args.reduce_each_micro_batch)
    loss = None
    progress = args.progress.open("a", buffering=1) if args.progress else None
    with job:
        for batch in job:
            if args.step_sleep:
                time.sleep(args.step_sleep)
            step_loss = job.step(lambda: toy.loss_fn(model, batch))
            if step_loss is not None:
                loss = step_loss
                if progress:
                    c = job.last_commit
                    progress.write(f"{c.step} {c.generation} {c.world_size} {c.time:.6f} {c.loss:.10g}\n")
        if args.result:
            fp = job.fingerprint()
            if not job.left:
                torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                           str(args.result) + ".pt")
            args.result.write_text(json.dumps({
                "worker": config.worker_id, "step": job.step_count, "loss": loss, "rank": job.rank,
                "world_size": job.world_size, "generation": job.generation, "fingerprint": fp,
                "left": job.left, "scaler": scaler.state_dict() if scaler is not None else None,
                "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

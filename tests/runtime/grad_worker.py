"""A worker for the gradient-path tests, and the single-process reference it is compared with.

As a worker (under runtime_cluster, `script=GRAD_WORKER`) it trains a small
two-layer model whose layers may have different dtypes, with the job's
clipping, hook and GradScaler, and writes per step (in the result JSON): the
global gradient norm before clipping (job.grad_norm), the norm the hook saw
(after unscale and clipping), whether the step was skipped, the scale, and a
hash of the parameters after the step; the final state dict goes to
`<result>.pt`. `--inf-at S --inf-rank R`: rank R's loss is multiplied by inf
at step S.

`reference(...)` runs the same training in one process on the global batches
(plain backward, clip_grad_norm_, optimizer step): what the job must match.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import eltctl_runtime as elt
from eltctl_runtime.train import state as elt_state

DTYPES = {"32": torch.float32, "64": torch.float64}


def make_model(dtypes: str, seed: int = 0) -> nn.Module:
    first, second = (DTYPES[d] for d in dtypes.split(","))
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16).to(first), nn.Tanh(), nn.Linear(16, 2).to(second))


def forward_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    first, second = model[0].weight.dtype, model[2].weight.dtype
    h = model[1](model[0](x.to(first)))
    return nn.functional.mse_loss(model[2](h.to(second)).float(), y)


def make_dataset(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, torch.sin(x[:, :2] * 2) + 0.1 * torch.randn(n, 2, generator=g))


def params_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(elt_state.tensor_bytes(p.detach()))
    return h.hexdigest()[:16]


def reference(dtypes: str, steps: int, batch: int, lr: float, max_grad_norm: float | None) -> tuple[dict, list[float]]:
    """One process, the global batches in the job's order: (final state dict, norm per step)."""
    model = make_model(dtypes)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = make_dataset()
    sampler = elt.SamplerState(n_samples=len(data), global_batch=batch, seed=0)
    norms = []
    for _ in range(steps):
        idx = torch.tensor(sampler.global_indices())
        opt.zero_grad()
        forward_loss(model, data.tensors[0][idx], data.tensors[1][idx]).backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm else float("inf"))
        norms.append(float(norm))
        opt.step()
        sampler = sampler.advanced()
    return model.state_dict(), norms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="64,32", help="dtype of the first and the second layer")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--bucket-mb", type=float, default=0.0003)  # ~300 bytes: several buckets
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--scaler", action="store_true")
    ap.add_argument("--inf-at", type=int, default=None)
    ap.add_argument("--inf-rank", type=int, default=1)
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--progress", type=Path, required=True)
    args = ap.parse_args(argv)

    config = elt.RuntimeConfig.from_env()
    model = make_model(args.dtypes)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu") if args.scaler else None
    seen: dict = {}

    def hook(job) -> None:
        grads = [p.grad.double() for p in model.parameters()]
        seen["hook_norm"] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))

    job = elt.ElasticJob(model, opt, make_dataset(), global_batch_size=args.batch, max_steps=args.steps,
                         config=config, bucket_mb=args.bucket_mb, max_grad_norm=args.max_grad_norm,
                         before_optimizer_step=hook, grad_scaler=scaler)
    steps = []
    with job, args.progress.open("a", buffering=1) as progress:
        for x, y in job:
            loss = forward_loss(model, x, y)
            if args.inf_at == job.step_count + 1 and job.rank == args.inf_rank:
                loss = loss * float("inf")
            if job.step(loss) is None:
                continue
            c = job.last_commit
            steps.append({"step": c.step, "skipped": c.skipped, "norm": job.grad_norm,
                          "hook_norm": seen.get("hook_norm"), "params": params_hash(model),
                          "scale": scaler.get_scale() if scaler else None})
            progress.write(f"{c.step} {c.generation} {c.world_size} {c.time:.6f} {c.loss:.8g}\n")
        torch.save(model.state_dict(), args.result.with_suffix(".pt"))
        args.result.write_text(json.dumps({"worker": config.worker_id, "rank": job.rank, "step": job.step_count,
                                           "fingerprint": job.fingerprint(), "left": job.left, "steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

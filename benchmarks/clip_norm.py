"""Clipping benchmark: torch's clip_grad_norm_ against the job's float64 clipping, side by side.

`ElasticJob(max_grad_norm=...)` clips the global gradient on both gradient paths with
the norm's squares summed in float64, piece by piece (`gradients.add_squares`,
`clip_coefficient`); the replicated path called `torch.nn.utils.clip_grad_norm_`
before, whose norm is float32. For gradients of the sharded benchmark's model size
(about 50 M float32 elements, in the MLP's tensor shapes) this prints, per method:

  - the time of one whole clip (the norm and the gradients' scaling), median of --repeats;
  - the norm's relative error against the exact one (float64 over float64 copies);

and the ratio of the two times. Gradients are random normal, as a gradient's sign and
size are; the error of a float32 sum grows with the number of elements summed.

    .venv/bin/python benchmarks/clip_norm.py [--params 50] [--repeats 7] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def shapes(millions: float) -> list[tuple[int, ...]]:
    """An MLP's weight and bias shapes (hidden 4096) of about `millions` M elements."""
    hidden, out, total = 4096, [], 0
    while total + hidden * hidden + hidden <= millions * 1e6:
        out += [(hidden, hidden), (hidden,)]
        total += hidden * hidden + hidden
    rest = int(millions * 1e6) - total
    if rest >= hidden:  # the last layer, narrower
        out += [(rest // hidden, hidden)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=50.0, help="millions of gradient elements (default 50)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (a worker runs with 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from eltctl_runtime.train.gradients import clip_global_norm_

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes(args.params)]
    exact = sum(float(torch.sum(g.double() ** 2)) for g in grads) ** 0.5
    max_norm = exact / 2  # the clip is active: both methods scale every gradient

    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]  # what torch's clip reads .grad of

    def torch_clip(gs: list[torch.Tensor]) -> float:
        for p, g in zip(params, gs):
            p.grad = g
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def job_clip(gs: list[torch.Tensor]) -> float:
        return clip_global_norm_(gs, max_norm)  # what the replicated path's clip_grad_norm_ runs

    rows = {}
    for name, fn in (("torch clip_grad_norm_ (float32 norm)", torch_clip),
                     ("eltctl (float64 squares, 2 Mi pieces)", job_clip)):
        times, norm = [], None
        for _ in range(args.repeats + 1):  # the first is a warm-up
            work = [g.clone() for g in grads]
            t0 = time.perf_counter()
            norm = fn(work)
            times.append(time.perf_counter() - t0)
        rows[name] = {"s": statistics.median(times[1:]), "norm": norm, "rel_error": abs(norm - exact) / exact}
    names = list(rows)
    out = {"elements": sum(g.numel() for g in grads), "threads": args.threads, "exact_norm": exact,
           "methods": rows, "time_ratio": rows[names[1]]["s"] / rows[names[0]]["s"]}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['elements'] / 1e6:.1f} M float32 gradient elements, {args.threads} thread(s), "
          f"median of {args.repeats}")
    for name, r in rows.items():
        print(f"  {name:40s} {r['s'] * 1e3:8.1f} ms   norm's relative error {r['rel_error']:.1e}")
    print(f"  time ratio (eltctl / torch): {out['time_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the one-GPU sharded worker (tests/runtime/shard_worker.py, world 1 on NCCL) several
times per mode and print each run's final loss: a check that sharded training on CUDA is
as deterministic as replicated training (same data, same seed, same steps: the same loss
every time). For a machine with a GPU; no SSH, no eltctl controller.

    python3 scripts/gpu-repeat-sharded.py [--runs 6] [--parallel 6] [--modes replicated optimizer gradients]
                                          [--blocking] [--steps 30] [--json-out FILE]

`--blocking` adds each mode again with CUDA_LAUNCH_BLOCKING=1 (every kernel synchronous:
a run-to-run difference that goes away then is a stream-ordering race).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(store_port: int, tmp: Path, mode: str, steps: int, blocking: bool, k: int, device: str) -> dict:
    shim = tmp / "shim"
    d = tmp / f"{mode}-{'b' if blocking else 'n'}-{k}"
    d.mkdir()
    env = {**os.environ, "ELTCTL_STORE": f"127.0.0.1:{store_port}", "ELTCTL_JOB": f"r{uuid.uuid4().hex[:8]}",
           "ELTCTL_WORKER_ID": f"gpu/{device}/0", "ELTCTL_DEVICE": device, "ELTCTL_LOCAL_GPU": "0",
           "ELTCTL_CHECKPOINT_DIR": str(d / "ckpt"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), str(REPO), os.environ.get("PYTHONPATH")]))}
    if blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    result = d / "result.json"
    cmd = [sys.executable, str(REPO / "tests" / "runtime" / "shard_worker.py"), "--steps", str(steps),
           "--hidden", "2048", "--layers", "3", "--samples", "4096", "--batch", "64", "--bucket-mb", "4",
           "--checkpoint-every", "10", "--max-grad-norm", "1.0", "--result", str(result), "--progress",
           str(d / "progress")]
    if mode != "replicated":
        cmd += ["--shard", mode]
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    rec = {"mode": mode, "blocking": blocking, "run": k, "rc": out.returncode, "s": round(time.monotonic() - t0, 1)}
    if out.returncode == 0:
        r = json.loads(result.read_text())
        rec.update(loss=r["loss"], step=r["step"], peak_mib=round((r["cuda_peak_bytes"] or 0) / 2**20, 1))
        rec["losses"] = [float(line.split()[4]) for line in (d / "progress").read_text().splitlines()]
    else:
        rec["tail"] = out.stderr[-1500:]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--parallel", type=int, default=6)
    ap.add_argument("--modes", nargs="+", default=["replicated", "optimizer", "gradients"])
    ap.add_argument("--blocking", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: try the script out on a machine without a GPU")
    args = ap.parse_args()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    variants = [(m, False) for m in args.modes] + ([(m, True) for m in args.modes] if args.blocking else [])
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        (tmp / "shim").mkdir()
        (tmp / "shim" / "eltctl_runtime").symlink_to(REPO / "runtime")
        jobs = [(m, b, k) for m, b in variants for k in range(args.runs)]
        with ThreadPoolExecutor(args.parallel) as ex:
            recs = list(ex.map(lambda j: one_run(store.port, tmp, j[0], args.steps, j[1], j[2], args.device), jobs))
    summary = {}
    for m, b in variants:
        rs = [r for r in recs if r["mode"] == m and r["blocking"] == b]
        finals = [r.get("loss") for r in rs]
        first_diff = []
        ref = next((r["losses"] for r in rs if "losses" in r), None)
        for r in rs:
            if "losses" in r and ref is not None:
                diff = next((i + 1 for i, (a, c) in enumerate(zip(ref, r["losses"])) if a != c), None)
                first_diff.append(diff)
        summary[f"{m}{'+blocking' if b else ''}"] = {"final_losses": finals, "distinct": len(set(finals)),
                                                    "first_step_differing_from_run0": first_diff,
                                                    "rc": [r["rc"] for r in rs], "peak_mib": rs[0].get("peak_mib")}
        print(f"{m:10s} {'blocking' if b else 'async   '} finals {finals} first differing step {first_diff}",
              flush=True)
    for r in recs:
        if r["rc"] != 0:
            print(f"FAILED {r['mode']} run {r['run']}: {r.get('tail')}", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps({"summary": summary, "runs": recs}, indent=1))
    return 0 if all(r["rc"] == 0 for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())

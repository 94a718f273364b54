"""torchft's DiLoCo on the shaped bed, beside eltctl's local steps (benchmarks/network.py).

torchft (pip `torchft`, Meta's fault-tolerant training) has its own DiLoCo
(`torchft.local_sgd.DiLoCo`): every replica group steps its inner optimizer
locally and, every `sync_every` steps, a Manager asks the lighthouse (a Rust
server in the wheel, `torchft._torchft.LighthouseServer`) for a quorum,
all-reduces the pseudo-gradients (global parameters minus local ones) over a
reconfigurable gloo group, and an outer optimizer steps with their mean; a failed
round is discarded. This module runs it on the same bed as network.py's training
rows, with the same work as eltctl's `local` row, so the two stand side by side:

- one lighthouse on h1's bridge address (`LIGHTHOUSE_PORT`, min_replicas = world);
- one replica group per bed host, each one process in its namespace: a TCPStore of
  its own on its address (`REPLICA_STORE_PORT`; the quorum hands the first
  replica's store to all of them for the gloo group), torchft's `ProcessGroupGloo`
  over eth0 (GLOO_SOCKET_IFNAME), a `Manager` that advertises its bed address and
  `init_sync=False` (every replica builds the same model from the same seed, so
  step 0 needs no checkpoint transfer);
- the same model, corpus, held-out windows, inner AdamW (the same lr), outer
  `SGD(lr=0.7, momentum=0.9, nesterov=True)` (eltctl's default, the paper's) and H;
- the same samples: `steps` global batches of `batch` windows in ElasticJob's own
  order (the runtime's `epoch_order` for the same seed), each split into equal
  contiguous shares (`share_bounds`), as `ElasticJob(balance=False)` splits them;
- the job's end ends the last round early, as ElasticJob's does: a partial round is
  averaged with torchft's own fragment sync (outside the timed window, as eltctl's is).

The worker prints one record with the keys of _trainrank.py's `train_worker`, so the
row is `summarize_train`'s, with three differences: `wait_s` is the time each step
spent in DiLoCo's optimizer post-hook (the quorum, the all-reduce, the commit vote
and the outer step: torchft's whole synchronization); the job's own byte count is
None (torchft reports none; the interface's tx_bytes is measured as for eltctl);
and the training losses are the replicas' mean (`replica_fields`: ElasticJob's
step loss is the global batch's, a replica knows only its share's).

`import_problem` says why torchft cannot be used from a directory (install it
with --no-deps into its own directory: pip must never replace the host's torch).
Run as a script it is the worker: `python _torchft.py --worker SPEC_JSON`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bed  # noqa: E402  (beside this file)
import _textlm  # noqa: E402  (beside this file)

MODE = "torchft_diloco"
LIGHTHOUSE_PORT = 29510      # on h1 (each host has its own network stack)
REPLICA_STORE_PORT = 29520   # on every host: its replica group's TCPStore
MANAGER_PORT = 29530         # on every host: its replica group's ManagerServer
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
INSTALL = ("the DIRs hold `pip install --no-deps --target DIR torchft` and its pure-Python requirements "
           "opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http (never let pip "
           "replace the host's torch)")

_LIGHTHOUSE = """
import sys
from torchft._torchft import LighthouseServer
lh = LighthouseServer(bind=sys.argv[1], min_replicas=int(sys.argv[2]), join_timeout_ms=int(sys.argv[3]))
print("listening", flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
lh.shutdown()
"""


class TorchftFailed(Exception):
    """The torchft job ended without every replica's record (the message names the log)."""


# --- pure parts ------------------------------------------------------------------------

def rounds(steps: int, sync_every: int) -> int:
    """The synchronizations a job of `steps` steps makes: one every `sync_every` steps
    and one more for a partial last round (the job's end ends it early)."""
    if steps < 1 or sync_every < 1:
        raise ValueError(f"steps ({steps}) and sync_every ({sync_every}) must be at least 1")
    return -(-steps // sync_every)


def replica_fields(records: list[dict], steps: int, sync_every: int) -> dict:
    """What the row takes from every replica, not from rank 0 alone (`summarize_train`'s
    rule): the training losses as the job's, the mean over the replicas weighted by
    their shares (ElasticJob's step loss is the global batch's mean; a torchft replica
    knows only its own share's), and torchft's rounds: how many the job made and how
    many every replica committed (torchft drops a round whose commit vote fails and
    trains on, so a lower count means averaging was lost, not that the job failed)."""
    total = sum(r["share"] for r in records)

    def mean(key: str) -> float:
        return sum(r[key] * r["share"] for r in records) / total

    first = min(records, key=lambda r: r["rank"])
    start, end = mean("start_loss"), mean("end_loss")
    return {"start_loss": start, "end_loss": end, "halved": _textlm.halved(start, first["eval_loss"]),
            "rounds": rounds(steps, sync_every), "rounds_committed": min(r["commits"] for r in records)}


def pythonpath(where: str, runtime: str) -> str:
    """PYTHONPATH for a torchft process: the --torchft directories (DIR[:DIR], torchft
    and its dependencies), then the runtime's directory."""
    dirs = [d for d in where.split(os.pathsep) if d]
    if not dirs:
        raise ValueError(f"--torchft {where!r} names no directory: give DIR[:DIR] where torchft is installed")
    return os.pathsep.join([*dirs, runtime])


def import_problem(where: str) -> str | None:
    """Why torchft's DiLoCo cannot be used from `where` (DIR[:DIR]) by the host
    interpreter, with the exact error; None where it imports."""
    from tests.testbed.hostpython import HOST_PYTHON, runtime_path

    try:
        path = pythonpath(where, runtime_path())
    except ValueError as e:
        return str(e)
    code = "import torch, torchft, torchft.local_sgd as l; from torchft._torchft import LighthouseServer"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([HOST_PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"torchft does not import from {where} with the host's torch: {error}"
    return None


# --- the driver (one job on a started bed) -----------------------------------------------

def run_job(bed, world: int, name: str, plan: dict, sync_every: int, where: str, base_env: dict,
            workdir: Path) -> list[dict]:
    """One torchft DiLoCo job: a lighthouse on h1, a replica on each of h1..hN; the
    replicas' records (raises TorchftFailed naming the logs)."""
    from tests.testbed.hostpython import HOST_PYTHON, runtime_path

    env = {**base_env, "PYTHONPATH": pythonpath(where, runtime_path()), "TORCHFT_USE_OTEL": "false",
           "TORCHFT_MANAGER_PORT": str(MANAGER_PORT)}
    lighthouse_addr = bed.address("h1")
    lighthouse = [HOST_PYTHON, "-c", _LIGHTHOUSE, f"{lighthouse_addr}:{LIGHTHOUSE_PORT}", str(world), "60000"]
    procs: list[_bed.Rank] = []
    with (workdir / f"{name}-lighthouse.log").open("w") as lh_log, _bed.serving(
            bed, "h1", lighthouse, env, stderr=lh_log,
            failed=lambda status: TorchftFailed(f"failed: torchft's lighthouse did not start on {lighthouse_addr} "
                                                f"(exit {status}); see {lh_log.name}")):
        try:
            for r in range(world):
                host = f"h{r + 1}"
                spec = {**plan, "rank": r, "world": world, "address": bed.address(host), "sync_every": sync_every,
                        "lighthouse": f"http://{lighthouse_addr}:{LIGHTHOUSE_PORT}"}
                procs.append(_bed.start_rank(bed, host, [HOST_PYTHON, __file__, "--worker", json.dumps(spec)], env,
                                             workdir / f"{name}-{host}.log"))
            return _collect(procs, name, plan["timeout_s"])
        finally:
            _bed.stop_ranks(procs)


def _collect(procs: list, name: str, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    records = []
    for proc, log in procs:
        try:
            record = _bed.last_record(proc, deadline)
        except subprocess.TimeoutExpired:
            raise TorchftFailed(f"failed: torchft job {name} ran past {timeout_s:g} s; see {log.name}") from None
        if proc.returncode != 0 or record is None:
            log.flush()
            tail = [t for t in Path(log.name).read_text(errors="replace").splitlines() if t.strip()][-1:]
            raise TorchftFailed(f"failed: a replica of torchft job {name} exited {proc.returncode}"
                                f"{': ' + tail[0].strip() if tail else ''}; see {log.name}")
        records.append(record)
    return records


# --- the worker (host interpreter with torchft, inside a namespace) ----------------------

def worker(spec: dict) -> None:
    """One replica group of one rank: train `steps` steps under torchft's DiLoCo, then
    print one record (_trainrank.py's `train_worker` keys)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from eltctl_runtime.train.sampler import epoch_order, share_bounds

    T = _textlm
    rank, world, addr = spec["rank"], spec["world"], spec["address"]
    corpus, shape, windows, model = T.rank_setup(spec)  # the model first: make_model seeds torch's global RNG
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    steps, batch = spec["steps"], spec["batch"]
    order = epoch_order(windows.train_samples, spec["seed"], 0)  # ElasticJob's own order and shares
    lo, hi = share_bounds(batch, rank, world)
    span = torch.arange(shape.context)

    def local_batch(step: int):
        offs = torch.tensor([windows.train_offset(i) for i in order[step * batch + lo: step * batch + hi]])
        return data[offs[:, None] + span].long(), data[offs + shape.context].long()

    inner = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    outer = torch.optim.SGD(model.parameters(), **OUTER)
    heldout = T.heldout_batch(corpus, windows, spec["eval_samples"])
    first = rank == 0
    eval_start = T.evaluate(model, heldout) if first else None

    long = timedelta(seconds=spec["timeout_s"])
    store = dist.TCPStore(addr, REPLICA_STORE_PORT, is_master=True, wait_for_workers=False, timeout=long)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=long), min_replica_size=world, use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        timeout=long, quorum_timeout=long, connect_timeout=timedelta(seconds=120),
        rank=0, world_size=1, store_addr=addr, store_port=REPLICA_STORE_PORT, lighthouse_addr=spec["lighthouse"],
        replica_id=f"replica_{rank}", port=MANAGER_PORT, hostname=addr, init_sync=False)
    tx = _bed.tx_bytes_file()
    # registered before DiLoCo's own post-hook, so it runs first: the time from here to
    # the end of `inner.step()` is DiLoCo's synchronization (zero work between syncs)
    hook_at = [0.0]
    inner.register_step_post_hook(lambda *_: hook_at.__setitem__(0, time.perf_counter()))
    losses: list[float] = []
    wait = 0.0
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=spec["sync_every"], pin_memory=False) as diloco:
            for step in range(steps):
                x, y = local_batch(step)
                loss = F.cross_entropy(model(x), y)
                inner.zero_grad()
                loss.backward()
                inner.step()
                t1 = time.perf_counter()
                losses.append(float(loss))
                tx1 = int(tx.read_text())
                if len(losses) == spec["warmup"]:
                    t0, tx0 = t1, tx1
                elif len(losses) > spec["warmup"]:
                    wait += t1 - hook_at[0]
            if diloco._local_step:  # private: the job's end ends the round early, as ElasticJob's does
                manager.start_quorum()
                fragment = diloco._fragments[0]
                fragment.prepare_sync()
                fragment.perform_sync()
                diloco._local_step = 0
        commits = manager.current_step()
    finally:
        manager.shutdown(wait=False)
        del store
    tail = losses[-min(10, len(losses)):]
    print(json.dumps({
        "rank": rank, "steps": len(losses), "measured_steps": len(losses) - spec["warmup"], "window_s": t1 - t0,
        "wait_s": wait, "tx_bytes": tx1 - tx0, "job_bytes": None, "job_bytes_per_step": None,
        "start_loss": losses[0], "end_loss": sum(tail) / len(tail), "commits": commits, "share": hi - lo,
        "eval_loss_start": eval_start, "eval_loss": T.evaluate(model, heldout) if first else None,
    }), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 3:
        raise SystemExit("usage: _torchft.py --worker SPEC_JSON (benchmarks/network.py starts it)")
    worker(json.loads(sys.argv[2]))

"""Checkpoint mirroring benchmark: the mirror's throughput, and what mirroring costs training.

(a) Throughput, on one ~100 MB checkpoint written by runtime/checkpoint.py on a
    simulated host (tests/testbed, real sshd on loopback), median of --runs:
      - shared directory on the local disk: `Mirror.mirror_checkpoint` (the host runs
        eltctl/mirror_copy.py: copy + sha256 in two threads, fsync, compare with the
        source manifest, rename) against `cp -R` (fills the page cache, verifies
        nothing), `cp -R && sync` (durable) and `cp -R && sha256sum` (the same
        verification done the plain way); with this machine's one-core sha256 speed,
        the floor of any verified copy;
      - shared directory on a network filesystem: the same into an sshfs mount of
        another simulated host (FUSE over SSH, standing in for a lab's NFS: this
        machine has no nfsd), against `cp -R` into the same mount. Skipped (and said
        so) without `sshfs` (apt-get install sshfs) or with --no-netfs;
      - ssh://: `Mirror.mirror_checkpoint` (tar stream relayed by this process from the
        host's sshd to the mirror host's sshd, then hash, check and rename there in one
        command) against `scp -3 -r` (OpenSSH routing the same copy host -> here ->
        mirror host) and a plain `scp -r` from this machine to the mirror host.
    Target: mirror at least 0.8x the plain copy.

(b) Step time, two workers of the elastic runtime (real processes, gloo) training the
    example model scaled to ~100 MB of state (examples/toy.py, hidden 2048: 8.6 M
    parameters, Adam: 103 MB) for --seconds each run, checkpointing every
    --checkpoint-seconds (default 60; a 75 s run holds one, the final one at the stop
    falls after the measured window) with a `MirrorWorker` mirroring every committed
    checkpoint to a shared directory in the same run (this process plays the
    controller: it notices rank 0's new checkpoint and notifies the worker), against
    the same run with both off, and with checkpoints but no mirror (to tell the
    runtime's checkpoint cost from the mirror's), alternating (off, ckpt, on, on, ckpt,
    off) against load drift.
    The first 10 s of each run are not measured. Target: at most 5% slower.
    Two figures: the mean step time of each arm over its runs (drift of the machine's
    load between runs shows in it), and a load-normalized one: each run's mean step
    over its own median step (a checkpoint and a copy show as slow steps, load that
    drifts over minutes moves the median too), on against off.

    .venv/bin/python benchmarks/checkpoint.py [--json] [--runs 3] [--seconds 75] [--pairs 2]
        [--checkpoint-seconds 60] [--skip-steps] [--skip-throughput] [--no-netfs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

JOB = "bench"
HIDDEN = 2048
TARGET_THROUGHPUT = 0.8
TARGET_SLOWDOWN = 1.05


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- (a) throughput


def make_checkpoint(directory: Path, step: int, mb: int) -> int:
    import torch

    from eltctl_runtime.checkpoint.store import CheckpointStore

    floats = mb * 1_000_000 // 4
    info = CheckpointStore(directory, keep=10).save(step, {"w": torch.randn(floats), "step": step})
    return info.size + (info.path / "manifest.json").stat().st_size


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class NetFs:
    """A network filesystem mounted here: sshfs (FUSE over SSH) from the simulated
    host `store`, standing in for the NFS mount of a lab (this machine has no nfsd).
    Every byte written to `mount` crosses a real network protocol to `server_dir`."""

    def __init__(self, mount: Path, server_dir: Path) -> None:
        self.mount, self.server_dir = mount, server_dir

    def unmount(self) -> None:
        subprocess.run(["fusermount", "-u", str(self.mount)], check=False, capture_output=True)
        if os.path.ismount(self.mount):
            subprocess.run(["umount", "-l", str(self.mount)], check=False, capture_output=True)


def mount_sshfs(bed, store) -> tuple[NetFs | None, str]:
    """(the mount, "") or (None, why not)."""
    if shutil.which("sshfs") is None:
        return None, "sshfs is not installed (apt-get install sshfs)"
    server_dir = store.dir / "home" / "export"
    server_dir.mkdir(parents=True, exist_ok=True)
    mount = bed.dir / "netfs"
    mount.mkdir(exist_ok=True)
    cmd = ["sshfs", f"{bed.user}@{store.address}:{server_dir}", str(mount), "-p", str(store.port),
           "-o", f"IdentityFile={bed.client_key},UserKnownHostsFile={bed.known_hosts},StrictHostKeyChecking=yes,"
                 "BatchMode=yes,allow_other"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0 or not os.path.ismount(mount):
        return None, f"sshfs mount failed: {(r.stderr or r.stdout).strip()[-300:]}"
    return NetFs(mount, server_dir), ""


def sha256_speed() -> float:
    """This machine's sha256 speed on one core (MB/s): the floor of a verified copy."""
    import hashlib

    data = os.urandom(64 << 20)
    best = min(timed(lambda: hashlib.sha256(data).digest()) for _ in range(3))
    return round(len(data) / best / 1e6, 1)


def throughput(runs: int, mb: int, use_netfs: bool = True) -> dict:
    from eltctl.inventory import load_inventory
    from eltctl.mirror import Mirror, host_place, parse_target
    from eltctl.hosts.fleet import Fleet
    from tests.testbed import make_testbed

    out: dict = {}
    with make_testbed(0) as bed:
        h1 = bed.add_host("h1")
        store = bed.add_host("store")
        inv = load_inventory(bed.write_inventory())
        src_dir = h1.dir / "home" / ".eltctl" / "jobs" / JOB / "h1" / "checkpoints"
        nbytes = make_checkpoint(src_dir, 1, mb)
        src_step = src_dir / "step-00000001"
        shared = bed.dir / "shared"
        ssh_root = store.dir / "home" / "mirror"
        out["bytes"] = nbytes
        ssh_opts = ["-i", str(bed.client_key), "-o", f"UserKnownHostsFile={bed.known_hosts}",
                    "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-q"]

        def uri(host, path: Path) -> str:
            return f"scp://{bed.user}@{host.address}:{host.port}/{path}"

        def run_mirror(spec: str) -> float:
            """Seconds of `mirror_checkpoint` alone: the controller holds its connections open."""
            async def main() -> float:
                mirror = Mirror(parse_target(spec), JOB, keep=3, ssh=inv.ssh)
                async with Fleet(inv) as fleet:
                    src = await host_place(await fleet.transport(inv.host("h1")), JOB)
                    try:
                        await mirror.place()  # connect first, as a running controller has
                        t0 = time.perf_counter()
                        copied = await mirror.mirror_checkpoint(src, 1)
                        took = time.perf_counter() - t0
                        assert copied.verified
                    finally:
                        await mirror.close()
                return took
            return asyncio.run(main())

        def fresh(path: Path) -> None:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True, exist_ok=True)

        def one_ssh_run(_i: int) -> None:
            fresh(ssh_root)
            figures["ssh_scp3_s"].append(timed(lambda: subprocess.run(
                ["scp", "-3", "-r", *ssh_opts, uri(h1, src_step), uri(store, ssh_root / "copy")], check=True)))
            fresh(ssh_root)
            figures["ssh_scp_s"].append(timed(lambda: subprocess.run(
                ["scp", "-r", *ssh_opts, str(src_step), uri(store, ssh_root / "copy")], check=True)))
            fresh(ssh_root)
            figures["ssh_mirror_s"].append(run_mirror(f"ssh://{bed.user}@{store.address}:{store.port}{ssh_root}"))

        figures = {"dir_mirror_s": [], "dir_cp_s": [], "dir_cp_sync_s": [], "dir_cp_sha_s": [],
                   "ssh_mirror_s": [], "ssh_scp3_s": [], "ssh_scp_s": []}
        netfs, why_not = mount_sshfs(bed, store) if use_netfs else (None, "--no-netfs")
        if netfs is not None:
            figures.update({"netfs_mirror_s": [], "netfs_cp_s": []})
        else:
            out["netfs_skipped"] = why_not

        def sh(cmd: str) -> float:
            return timed(lambda: subprocess.run(["sh", "-c", cmd], check=True, stdout=subprocess.DEVNULL))

        copy = shlex.quote(str(shared / "copy"))
        src = shlex.quote(str(src_step))
        try:
            for i in range(runs):
                log(f"throughput run {i + 1}/{runs}")
                fresh(shared)
                figures["dir_cp_s"].append(sh(f"cp -R {src} {copy}"))
                fresh(shared)
                figures["dir_cp_sync_s"].append(sh(f"cp -R {src} {copy} && sync -f {copy}/*"))
                fresh(shared)
                figures["dir_cp_sha_s"].append(sh(f"cp -R {src} {copy} && sha256sum {copy}/*"))
                fresh(shared)
                figures["dir_mirror_s"].append(run_mirror(str(shared)))
                if netfs is not None:
                    # emptied through the mount: behind its back, sshfs's caches go stale
                    fresh(netfs.mount)
                    figures["netfs_cp_s"].append(sh(f"cp -R {src} {shlex.quote(str(netfs.mount / 'copy'))}"))
                    fresh(netfs.mount)
                    figures["netfs_mirror_s"].append(run_mirror(str(netfs.mount)))
                    fresh(netfs.mount)
                one_ssh_run(i)
        finally:
            if netfs is not None:
                netfs.unmount()
        med = {k: statistics.median(v) for k, v in figures.items()}
        out.update({k: round(v, 3) for k, v in med.items()})
        out["runs"] = {k: [round(x, 3) for x in v] for k, v in figures.items()}
        mbps = {k[:-2] + "_MBps": round(nbytes / v / 1e6, 1) for k, v in med.items()}
        out.update(mbps)
        out["dir_ratio_vs_cp"] = round(med["dir_cp_s"] / med["dir_mirror_s"], 3)
        out["dir_ratio_vs_cp_sync"] = round(med["dir_cp_sync_s"] / med["dir_mirror_s"], 3)
        out["dir_ratio_vs_cp_sha"] = round(med["dir_cp_sha_s"] / med["dir_mirror_s"], 3)
        if netfs is not None:
            out["netfs_ratio_vs_cp"] = round(med["netfs_cp_s"] / med["netfs_mirror_s"], 3)
        out["sha256_MBps"] = sha256_speed()
        out["ssh_ratio_vs_scp3"] = round(med["ssh_scp3_s"] / med["ssh_mirror_s"], 3)
        out["ssh_ratio_vs_scp"] = round(med["ssh_scp_s"] / med["ssh_mirror_s"], 3)
    return out


# --------------------------------------------------------------------------- (b) step time


def worker_main(args: argparse.Namespace) -> int:
    """One training worker (this file run with --worker): the toy model at ~100 MB of state."""
    import torch

    import eltctl_runtime as elt
    import toy

    torch.set_num_threads(1)
    config = elt.RuntimeConfig.from_env()
    model = toy.make_model(hidden=HIDDEN, layers=3, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    job = elt.ElasticJob(model, optimizer, toy.make_dataset(n_samples=8192), global_batch_size=32, seed=0,
                         max_steps=10**9, checkpoint_every_seconds=args.checkpoint_seconds or None,
                         config=config)
    with open(args.progress, "a", buffering=1) as progress, job:
        for batch in job:
            if job.step(toy.loss_fn(model, batch)) is not None:
                progress.write(f"{job.last_commit.step} {time.time():.6f}\n")
    return 0


def train_run(tmp: Path, seconds: float, checkpoint_seconds: float | None, mirror_dir: Path | None) -> dict:
    import torch.distributed as dist

    import eltctl_runtime as elt

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    job = f"b{uuid.uuid4().hex[:8]}"
    ckpt = tmp / "ckpt"
    procs = []
    progress = [tmp / f"w{i}.progress" for i in range(2)]
    for i in range(2):
        env = dict(os.environ)
        env.update({"ELTCTL_STORE": f"127.0.0.1:{store.port}", "ELTCTL_JOB": job,
                    "ELTCTL_WORKER_ID": f"w{i}", "ELTCTL_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
                    "ELTCTL_MIN_WORKERS": "2", "ELTCTL_HANG_TIMEOUT": "30"})
        if checkpoint_seconds:
            env["ELTCTL_CHECKPOINT_DIR"] = str(ckpt)
        cmd = [sys.executable, __file__, "--worker", "--progress", str(progress[i]),
               "--checkpoint-seconds", str(checkpoint_seconds or 0)]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=(tmp / f"w{i}.log").open("w"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
    mirrored: list[int] = []
    status: dict = {}
    try:
        asyncio.run(_drive(procs, progress[0], seconds, ckpt, mirror_dir, mirrored, status, store, job))
        deadline = time.monotonic() + 180
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    lines = [line.split() for line in progress[0].read_text().splitlines() if line.strip()]
    times = [(int(s), float(t)) for s, t in lines]
    t0 = times[0][1] + 10.0  # skip warm-up (process start, first allocations)
    window = [(s, t) for s, t in times if t0 <= t <= times[0][1] + seconds - 1.0]
    step_s = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
    # The run's typical step (median) against its mean: checkpoints and copies show as
    # slow steps, load that drifts over minutes moves the median as well, so
    # mean/median of one run is its own overhead at that run's load.
    dts = [(t1 - t0_) / max(1, s1 - s0) for (s0, t0_), (s1, t1) in zip(window, window[1:])]
    typical = statistics.median(dts)
    checkpoints = sorted(p.name for p in ckpt.glob("step-*")) if checkpoint_seconds else []
    return {"step_s": step_s, "median_step_s": typical, "mean_over_median": step_s / typical,
            "steps_measured": window[-1][0] - window[0][0],
            "window_s": round(window[-1][1] - window[0][1], 1), "checkpoints": len(checkpoints),
            "mirrored_steps": mirrored, "mirror_status": status}


async def _drive(procs, progress: Path, seconds: float, ckpt: Path, mirror_dir: Path | None,
                 mirrored: list[int], status: dict, store, job: str) -> None:
    """Wait for training to start, let it run `seconds`, mirroring as the controller would, then stop."""
    import eltctl_runtime as elt
    from eltctl.inventory import Host
    from eltctl.mirror import Mirror, MirrorWorker, Place, parse_target
    from eltctl.hosts.local import LocalTransport

    while not (progress.exists() and progress.stat().st_size > 0):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a worker exited before training started:\n"
                               + (progress.parent / "w0.log").read_text()[-3000:]
                               + (progress.parent / "w1.log").read_text()[-3000:])
        await asyncio.sleep(0.2)
    worker = None
    if mirror_dir is not None:
        here = Place("local", LocalTransport(Host(name="local", address="local")), str(ckpt))
        mirror = Mirror(parse_target(str(mirror_dir)), JOB, keep=2)

        async def source(_name):
            return here

        worker = MirrorWorker(mirror, source)
        await worker.start()
    end = time.monotonic() + seconds
    seen = -1
    while time.monotonic() < end:
        await asyncio.sleep(0.5)
        if worker is not None:  # rank 0's status says a new checkpoint: notify the mirror
            steps = [int(p.name[5:]) for p in ckpt.glob("step-*")]
            if steps and max(steps) > seen:
                seen = max(steps)
                worker.notify("local", seen)
    elt.request_stop(store, job)
    if worker is not None:
        await asyncio.sleep(1)
        await worker.flush(timeout=120)
        status.update(worker.status())
        mirrored.extend(sorted(int(p.name[5:]) for p in Path(mirror_dir, JOB).glob("step-*")))
        await worker.stop()


def step_times(seconds: float, checkpoint_seconds: float, pairs: int) -> dict:
    """Runs off and on alternately (off, on, on, off, ...) so that the load of a shared
    machine drifting over minutes weighs on both alike; the mean step time of each."""
    root = Path(tempfile.mkdtemp(prefix="eltbench-ckpt-"))
    runs: dict[str, list[dict]] = {"off": [], "ckpt": [], "on": []}
    try:
        order = []
        for i in range(pairs):
            order += ["off", "ckpt", "on"] if i % 2 == 0 else ["on", "ckpt", "off"]
        for n, arm in enumerate(order):
            tmp = root / f"{n}-{arm}"
            tmp.mkdir()
            if arm == "off":
                log(f"run {n + 1}/{len(order)}: no checkpoints, no mirroring ({seconds:g} s)")
                runs["off"].append(train_run(tmp, seconds, None, None))
            elif arm == "ckpt":
                log(f"run {n + 1}/{len(order)}: a checkpoint every {checkpoint_seconds:g} s, not mirrored ({seconds:g} s)")
                runs["ckpt"].append(train_run(tmp, seconds, checkpoint_seconds, None))
            else:
                log(f"run {n + 1}/{len(order)}: a checkpoint every {checkpoint_seconds:g} s, mirrored ({seconds:g} s)")
                runs["on"].append(train_run(tmp, seconds, checkpoint_seconds, tmp / "mirror"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def mean_step(arm: str) -> float:
        steps = sum(r["steps_measured"] for r in runs[arm])
        return sum(r["step_s"] * r["steps_measured"] for r in runs[arm]) / steps

    off, ck, on = mean_step("off"), mean_step("ckpt"), mean_step("on")

    def spread(arm: str) -> float:
        return statistics.mean(r["mean_over_median"] for r in runs[arm])

    return {"seconds_per_run": seconds, "checkpoint_every_s": checkpoint_seconds, "pairs": pairs,
            # each run against its own median step: insensitive to load drifting between runs
            "slowdown_load_normalized": round(spread("on") / spread("off"), 4),
            "slowdown_ckpt_only_load_normalized": round(spread("ckpt") / spread("off"), 4),
            "mean_over_median": {arm: [round(r["mean_over_median"], 4) for r in runs[arm]] for arm in runs},
            "step_s_off": round(off, 4), "step_s_ckpt_only": round(ck, 4), "step_s_on": round(on, 4),
            "slowdown": round(on / off, 4), "slowdown_ckpt_only": round(ck / off, 4),
            "mirror_share": round(on / ck, 4),
            "runs_off": [round(r["step_s"], 4) for r in runs["off"]],
            "runs_ckpt_only": [round(r["step_s"], 4) for r in runs["ckpt"]],
            "runs_on": [round(r["step_s"], 4) for r in runs["on"]],
            "steps_measured_off": sum(r["steps_measured"] for r in runs["off"]),
            "steps_measured_on": sum(r["steps_measured"] for r in runs["on"]),
            "checkpoints_written": [r["checkpoints"] for r in runs["on"]],
            "mirrored_steps": [r["mirrored_steps"] for r in runs["on"]],
            "mirror_status": [{k: r["mirror_status"].get(k) for k in ("step", "lag_steps", "last_error", "mirrored")}
                              for r in runs["on"]]}


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--runs", type=int, default=3, help="throughput runs (median)")
    ap.add_argument("--mb", type=int, default=100, help="checkpoint size for the throughput part")
    ap.add_argument("--seconds", type=float, default=75.0, help="training seconds per step-time run")
    ap.add_argument("--pairs", type=int, default=2, help="step-time runs with and without (alternating)")
    ap.add_argument("--checkpoint-seconds", type=float, default=60.0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--no-netfs", action="store_true", help="skip the sshfs (network filesystem) mirror")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    result: dict = {}
    if not args.skip_throughput:
        result["throughput"] = throughput(args.runs, args.mb, not args.no_netfs)
    if not args.skip_steps:
        result["step_time"] = step_times(args.seconds, args.checkpoint_seconds, args.pairs)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if "throughput" in result:
        t = result["throughput"]
        print(f"Mirror throughput, one checkpoint of {t['bytes'] / 1e6:.1f} MB (median of {args.runs}):")
        print(f"  shared dir, local disk: mirror {t['dir_mirror_s']:.3f} s ({t['dir_mirror_MBps']} MB/s)")
        print(f"      vs cp -R            {t['dir_cp_s']:.3f} s ({t['dir_cp_MBps']} MB/s)  ratio "
              f"{t['dir_ratio_vs_cp']:.2f}x (target >= {TARGET_THROUGHPUT}; cp only fills the page cache)")
        print(f"      vs cp -R && sync    {t['dir_cp_sync_s']:.3f} s ({t['dir_cp_sync_MBps']} MB/s)  ratio "
              f"{t['dir_ratio_vs_cp_sync']:.2f}x")
        print(f"      vs cp -R && sha256sum {t['dir_cp_sha_s']:.3f} s ({t['dir_cp_sha_MBps']} MB/s)  ratio "
              f"{t['dir_ratio_vs_cp_sha']:.2f}x (the same verification, done after the copy)")
        print(f"      sha256 on one core here: {t['sha256_MBps']} MB/s (a verified copy cannot beat it)")
        if "netfs_mirror_s" in t:
            print(f"  shared dir, network filesystem (sshfs): mirror {t['netfs_mirror_s']:.3f} s "
                  f"({t['netfs_mirror_MBps']} MB/s)  cp -R {t['netfs_cp_s']:.3f} s ({t['netfs_cp_MBps']} MB/s)  "
                  f"ratio {t['netfs_ratio_vs_cp']:.2f}x (target >= {TARGET_THROUGHPUT})")
        else:
            print(f"  shared dir, network filesystem: skipped ({t.get('netfs_skipped')})")
        print(f"  ssh://     : mirror {t['ssh_mirror_s']:.3f} s ({t['ssh_mirror_MBps']} MB/s)  "
              f"scp -3 {t['ssh_scp3_s']:.3f} s ({t['ssh_scp3_MBps']} MB/s)  ratio {t['ssh_ratio_vs_scp3']:.2f}x; "
              f"scp from here {t['ssh_scp_s']:.3f} s ({t['ssh_scp_MBps']} MB/s)  ratio {t['ssh_ratio_vs_scp']:.2f}x "
              f"(target >= {TARGET_THROUGHPUT})")
    if "step_time" in result:
        s = result["step_time"]
        print(f"Step time, 2 workers, ~100 MB state, {s['pairs']} runs of {s['seconds_per_run']:g} s each way "
              f"(per run, s/step: off {s['runs_off']}, checkpoint only {s['runs_ckpt_only']}, "
              f"checkpoint + mirror {s['runs_on']}):")
        print(f"  off: {s['step_s_off'] * 1000:.1f} ms/step ({s['steps_measured_off']} steps)   "
              f"on (checkpoint every {s['checkpoint_every_s']:g} s + mirror): {s['step_s_on'] * 1000:.1f} ms/step "
              f"({s['steps_measured_on']} steps)   ratio {s['slowdown']:.3f} (target <= {TARGET_SLOWDOWN})")
        print(f"  load-normalized (each run's mean step over its own median step, on vs off): "
              f"{s['slowdown_load_normalized']:.3f} (target <= {TARGET_SLOWDOWN}); checkpoint only: "
              f"{s['slowdown_ckpt_only_load_normalized']:.3f}; per run {s['mean_over_median']}")
        print(f"  checkpoint only (no mirror): {s['step_s_ckpt_only'] * 1000:.1f} ms/step, ratio "
              f"{s['slowdown_ckpt_only']:.3f}; the mirror's own share (on / checkpoint only): {s['mirror_share']:.3f}")
        print(f"  checkpoints on the host: {s['checkpoints_written']}, mirrored: {s['mirrored_steps']}, "
              f"mirror status: {s['mirror_status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

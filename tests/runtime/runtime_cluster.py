"""The runtime tests' launcher: a TCPStore hosted here, workers as real processes.

`cluster` plays the launcher's and the host daemon's parts: it hosts the job's
store (port 0), starts `examples/train.py` workers (or another `script` with the
same flags and files) with the environment contract, as the daemon does: forked
from a fork server (eltctl_runtime.daemon.forkserver; one zygote for the whole test
session, so a worker costs no import of torch), else as plain processes,
each in its own session so teardown kills all of them, and reports a worker
whose process exits with an error or a signal as dead (report_dead), as the
host daemon will.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import eltctl_runtime as elt
from eltctl_runtime.store import auth
from eltctl_runtime import protocol
from eltctl_runtime.daemon.forkserver import ForkServer
from tests.testbed.hostpython import HOST_PYTHON, host_env

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
TRAIN_REAL = ROOT / "examples" / "train_real.py"
GRAD_WORKER = Path(__file__).resolve().parent / "grad_worker.py"
PYTHON = HOST_PYTHON  # workers run as on a host: Python and torch only

_FORKS: ForkServer | None = None


def fork_server() -> ForkServer:
    """This test process's fork server (made at its first worker, closed at its exit)."""
    global _FORKS
    if _FORKS is None:
        _FORKS = ForkServer("cluster", output=subprocess.DEVNULL)
        atexit.register(_FORKS.close)
    return _FORKS


# Small model and data: the suite must stay fast on a busy 2-core machine.
SMALL = ["--hidden", "32", "--layers", "2", "--samples", "480", "--batch", "24", "--lr", "3e-3"]


@dataclass
class Worker:
    id: str
    proc: subprocess.Popen
    log: Path
    result: Path
    progress: Path
    reported: bool = False

    def read_result(self) -> dict | None:
        return json.loads(self.result.read_text()) if self.result.exists() else None

    def last_progress(self) -> tuple[int, int, int]:
        """(step, generation, world_size) of this worker's last committed step."""
        try:
            lines = self.progress.read_text().splitlines()
        except FileNotFoundError:
            return (0, -1, 0)
        if not lines:
            return (0, -1, 0)
        step, gen, world = lines[-1].split()[:3]  # then time, loss (and the LR, in train_real.py)
        return int(step), int(gen), int(world)

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


@dataclass
class Cluster:
    tmp: Path
    hang_timeout: float = 10.0
    min_workers: int = 1
    report_deaths: bool = True  # False: a host that vanishes has no daemon to report it
    args: list[str] = field(default_factory=lambda: list(SMALL))
    script: Path = TRAIN
    workers: list[Worker] = field(default_factory=list)
    job: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}")
    secret: bytes | None = None  # the job's secret: workers get ELTCTL_SECRET_FILE, and this launcher signs
    _n: int = 0

    def __post_init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        # The job's store as this launcher (the daemon's part) sees it: signed with the secret, if any.
        self.js = auth.signed(protocol.scope(self.store, self.job), protocol.job_prefix(self.job), self.secret)
        self.secret_file: Path | None = None  # written with the first worker's environment
        self.audit = self.tmp / "audit.jsonl"
        self.ckpt = self.tmp / "ckpt"
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, daemon=True)
        self._monitor.start()

    @property
    def store_spec(self) -> str:
        """ELTCTL_STORE for the workers (eltctl_runtime.store.server's grammar)."""
        return f"127.0.0.1:{self.store.port}"

    def env(self, worker_id: str) -> dict:
        env = host_env(dict(os.environ))
        env.pop("PYTEST_CURRENT_TEST", None)  # pytest's, different in each test: the workers need not see it
        env.update({
            "ELTCTL_STORE": self.store_spec, "ELTCTL_JOB": self.job,
            "ELTCTL_WORKER_ID": worker_id, "ELTCTL_DEVICE": "cpu", "ELTCTL_AUDIT": str(self.audit),
            "ELTCTL_CHECKPOINT_DIR": str(self.ckpt), "ELTCTL_HANG_TIMEOUT": str(self.hang_timeout),
            "OMP_NUM_THREADS": "1", "ELTCTL_MIN_WORKERS": str(self.min_workers),
        })
        if self.secret is not None:
            if self.secret_file is None:
                self.secret_file = self.tmp / "secret"
                auth.write_secret(self.secret_file, self.secret)
            env[auth.ENV_SECRET_FILE] = str(self.secret_file)
        return env

    def start(self, n: int = 1, extra: list[str] | None = None, env: dict[str, str] | None = None) -> list[Worker]:
        """Start n workers of examples/train.py; `extra` arguments and `env` variables for these alone."""
        new = []
        for _ in range(n):
            wid = f"host{self._n}/cpu/{os.getpid()}"
            i = self._n
            self._n += 1
            log = self.tmp / f"w{i}.log"
            w = Worker(wid, None, log, self.tmp / f"w{i}.result.json", self.tmp / f"w{i}.progress")  # type: ignore[arg-type]
            cmd = [PYTHON, str(self.script), *self.args, *(extra or []), "--result", str(w.result),
                   "--progress", str(w.progress)]
            wenv = {**self.env(wid), **(env or {})}
            w.proc = fork_server().spawn(cmd, wenv, ROOT, log) or subprocess.Popen(  # type: ignore[assignment]
                cmd, env=wenv, stdin=subprocess.DEVNULL, stdout=log.open("w"), stderr=subprocess.STDOUT,
                start_new_session=True, cwd=ROOT)
            new.append(w)
        self.workers += new
        return new

    def _watch(self) -> None:
        while not self._stop.is_set():
            for w in list(self.workers):
                rc = w.proc.poll()
                if rc is not None and rc != 0 and not w.reported and self.report_deaths:
                    w.reported = True
                    protocol.put_dead(self.js, w.id)
            self._stop.wait(0.05)

    # -- faults and requests -------------------------------------------------
    def leave(self, w: Worker) -> None:
        protocol.put_leave(self.js, w.id)

    def stop(self) -> None:
        protocol.put_stop(self.js)

    def kill(self, w: Worker, sig: int = signal.SIGKILL) -> None:
        os.kill(w.proc.pid, sig)

    # -- observation -------------------------------------------------------------
    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None]

    def wait_for(self, pred, timeout: float = 90.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; logs:\n{self.dump_logs()}")

    def progress(self) -> tuple[int, int, int]:
        """Newest (step, generation, world_size) over all workers."""
        return max((w.last_progress() for w in self.workers), default=(0, -1, 0))

    def wait_step(self, step: int, timeout: float = 90.0) -> None:
        self.wait_for(lambda: self.progress()[0] >= step, timeout, f"step {step}")

    def wait_world(self, world: int, min_gen: int = 0, steps_after: int = 1, timeout: float = 90.0) -> int:
        """Wait until steps commit at `world_size` in a generation >= min_gen; returns that generation."""
        box = {}

        def ok() -> bool:
            step, gen, ws = self.progress()
            if ws == world and gen >= min_gen:
                box.setdefault("first", step)
                return step >= box["first"] + steps_after
            return False

        self.wait_for(ok, timeout, f"world size {world} in generation >= {min_gen}")
        return self.progress()[1]

    def wait_exit(self, workers: list[Worker], timeout: float = 120.0) -> None:
        self.wait_for(lambda: all(w.proc.poll() is not None for w in workers), timeout, "workers to exit")

    def dump_logs(self) -> str:
        return "\n".join(f"--- {w.id} rc={w.proc.poll()}\n{w.log_text()[-3000:]}" for w in self.workers)

    def events(self) -> list[dict]:
        return protocol.get_events(self.js)

    def status(self) -> dict | None:
        """Rank 0's newest (verified) status document."""
        return protocol.get_status(self.js)

    def wait_for_status(self, pred, timeout: float = 60.0) -> dict:
        """Rank 0's first status document for which `pred` holds."""
        box: dict = {}

        def ok() -> bool:
            box["status"] = self.status()
            return box["status"] is not None and pred(box["status"])

        self.wait_for(ok, timeout, "a status document")
        return box["status"]

    def close(self) -> None:
        self._stop.set()
        for w in self.workers:
            if w.proc.poll() is None:
                try:
                    os.killpg(w.proc.pid, signal.SIGCONT)
                    os.killpg(w.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                w.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, ChildProcessError):  # the latter: its fork server died
                pass


# -- what must hold after every scenario ----------------------------------------


def committed_lineage(audit: Path) -> dict[int, list[dict]]:
    """step -> the audit records of the generation whose commit of that step
    stands (a step redone after a crash or a restore is taken from the newest
    generation)."""
    by_step: dict[int, dict[int, list[dict]]] = {}
    for line in audit.read_text().splitlines():
        r = json.loads(line)
        by_step.setdefault(r["step"], {}).setdefault(r["generation"], []).append(r)
    return {s: gens[max(gens)] for s, gens in by_step.items()}


def assert_exactly_once(audit: Path, n_samples: int, batch: int, final_step: int) -> dict[int, list[int]]:
    """Every committed step 1..final_step is in the audit; within each epoch no
    index repeats, every step took a full global batch (but an epoch's last),
    and every completed epoch used every index exactly once.

    Each rank records its own share and the step's whole slice. All ranks of
    the generation must have recorded the step, with shares that tile the slice
    in rank order, except at the last step of a generation that broke: a crash
    can land after one rank's all-reduce finished (it commits: every share was
    in the sum) and before another's did (it drops the step and adopts the
    committed state), and the dead rank writes nothing."""
    lineage = committed_lineage(audit)
    assert sorted(lineage) == list(range(1, final_step + 1)), f"committed steps {sorted(lineage)[:5]}..."
    last_of_gen: dict[int, int] = {}
    for line in audit.read_text().splitlines():
        r = json.loads(line)
        last_of_gen[r["generation"]] = max(last_of_gen.get(r["generation"], 0), r["step"])
    epochs: dict[int, list[int]] = {}
    for step in sorted(lineage):
        recs = sorted(lineage[step], key=lambda r: r["rank"])
        world, gen = recs[0]["world_size"], recs[0]["generation"]
        slice_ = recs[0]["step_indices"]
        assert all(r["step_indices"] == slice_ and r["epoch"] == recs[0]["epoch"] for r in recs), step
        ranks = [r["rank"] for r in recs]
        assert len(set(ranks)) == len(ranks)
        if ranks == list(range(world)):
            assert [i for r in recs for i in r["indices"]] == slice_, f"step {step}: shares do not tile the slice"
        else:
            assert step == last_of_gen[gen], f"step {step}: ranks {ranks} of {world} recorded it"
            assert all(set(r["indices"]) <= set(slice_) for r in recs)
        seen = epochs.setdefault(recs[0]["epoch"], [])
        assert len(slice_) == batch or len(seen) + len(slice_) == n_samples, f"step {step} took {len(slice_)}"
        seen += slice_
    for epoch, seen in epochs.items():
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample was used twice"
        if epoch < max(epochs):
            assert sorted(seen) == list(range(n_samples)), f"epoch {epoch} incomplete"
    return epochs


def assert_identical_state(results: list[dict]) -> None:
    assert results, "no worker reported a result"
    prints = {r["fingerprint"] for r in results}
    assert len(prints) == 1, f"ranks disagree: {results}"
    assert len({r["step"] for r in results}) == 1


def flip_middle_byte(path: Path) -> None:
    """Damage a file as a bad disk or a stray write would: one byte in its middle
    flipped, its size unchanged (only a hash can tell)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))


def gloo_group(store, name: str, rank: int, size: int):
    """A gloo group of `size` on 127.0.0.1 over `store` (a HashStore for threads), prefixed `name`."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=30)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, opts)


def run_threads(fns: dict[str, callable]) -> dict[str, object]:
    """Run each worker's function in its own thread; re-raise the first failure."""
    out: dict[str, object] = {}
    errors: list[BaseException] = []

    def wrap(name, fn):
        try:
            out[name] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(n, f), daemon=True) for n, f in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out

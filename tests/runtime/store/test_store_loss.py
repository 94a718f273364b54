"""Workers ride through a lost store (runtime/storeloss.py).

The job's store is served by a store keeper process of its own (eltctl/storekeeper.py,
as the controller runs it, on a Unix socket), so the test can SIGKILL it and start a
new one on the same socket the way the controller does. Plans:

* 2 workers train; the keeper is killed; steps go on committing with no store;
  a new keeper comes up on the same socket; rank 0 re-publishes the generation's
  plan; a planned leave and a join work afterwards; a stop ends the job with
  identical state and exactly-once data.
* 2 workers with a 3 s store-loss timeout; the keeper is killed and not brought
  back: both end cleanly at the same step and rank 0's checkpoint holds it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eltctl_runtime.store import auth, client as storeclient
from eltctl_runtime import protocol
from eltctl_runtime.checkpoint.store import CheckpointStore
from eltctl_runtime.protocol import Keys, first_generation
from runtime_cluster import ROOT, SMALL, Cluster, assert_exactly_once, assert_identical_state

N_SAMPLES = int(SMALL[SMALL.index("--samples") + 1])
BATCH = int(SMALL[SMALL.index("--batch") + 1])
FOREVER = ["--steps", "100000", "--step-sleep", "0.03"]

pytestmark = pytest.mark.slow


class KeptCluster(Cluster):
    """A Cluster whose store is served by a store keeper process on a fixed Unix socket."""

    def __post_init__(self) -> None:
        self.socket = self.tmp / "state" / "store.sock"
        self.keeper: subprocess.Popen | None = None
        self.secret_file = None
        self.start_keeper(restarted=False)
        self.audit = self.tmp / "audit.jsonl"
        self.ckpt = self.tmp / "ckpt"
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, daemon=True)
        self._monitor.start()

    def start_keeper(self, restarted: bool = True) -> None:
        info = self.tmp / "keeper.json"
        info.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "eltctl.storekeeper", "--socket", str(self.socket),
               "--info", str(info)] + (["--restarted-job", self.job] if restarted else [])
        if restarted and self.secret_file is not None:  # the restarted mark signed, as the controller has it
            cmd += ["--secret-file", str(self.secret_file)]
        self.keeper = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True,
                                       stdout=(self.tmp / "keeper.log").open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not info.exists():
            assert self.keeper.poll() is None and time.monotonic() < deadline, (self.tmp / "keeper.log").read_text()
            time.sleep(0.05)
        self.store = storeclient.connect(self.store_spec, 30)
        # Signed in the keeper's run (a new run id at every keeper start), as the controller reads it.
        self.js = auth.signed(protocol.scope(self.store, self.job), protocol.job_prefix(self.job), self.secret,
                              run=auth.read_run_id(self.run_file))

    @property
    def run_file(self) -> Path:
        return self.tmp / auth.RUN_FILE_NAME  # the keeper writes it beside its --info file

    def env(self, worker_id: str) -> dict:
        return {**super().env(worker_id), auth.ENV_RUN_FILE: str(self.run_file)}  # read at every (re)connect

    @property
    def store_spec(self) -> str:
        return f"unix:{self.socket}"

    def kill_keeper(self) -> None:
        self.keeper.kill()
        self.keeper.wait()

    def _watch(self) -> None:
        try:
            super()._watch()
        except Exception:  # noqa: BLE001 - the store is away: nobody reports deaths meanwhile
            pass

    def close(self) -> None:
        super().close()
        if self.keeper is not None and self.keeper.poll() is None:
            self.keeper.kill()
            self.keeper.wait()


@pytest.fixture
def kept(tmp_path):
    made: list[KeptCluster] = []

    def make(**kw) -> KeptCluster:
        tmp = tmp_path / f"c{len(made)}"
        tmp.mkdir()
        c = KeptCluster(tmp, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_workers_train_through_a_keeper_restart_then_leave_and_join(kept):
    cluster = kept(min_workers=2, secret=auth.new_secret())  # signed, as under eltctl's controller
    a, b = cluster.start(2, FOREVER)
    cluster.wait_world(2, steps_after=3)
    step, gen, _ = cluster.progress()

    cluster.kill_keeper()
    cluster.wait_step(step + 15)  # training goes on with no store at all

    cluster.start_keeper()
    js = cluster.js
    assert js.check([Keys.STORE_RESTARTED])  # signed by the keeper with the job's secret
    cluster.wait_for(lambda: js.check([Keys.plan(gen)]), 60, "rank 0 to re-publish the generation's plan")
    assert first_generation(js) == gen
    cluster.wait_for(lambda: (protocol.get_status(js) or {}).get("step", 0) > step + 15, 60,
                     "rank 0's status in the new store")

    cluster.leave(b)  # a planned leave after the restart
    g = cluster.wait_world(1, min_gen=gen + 1, steps_after=3)
    cluster.wait_exit([b])
    assert b.proc.returncode == 0 and b.read_result()["left"], cluster.dump_logs()
    (c,) = cluster.start(1, FOREVER)  # and a join
    cluster.wait_world(2, min_gen=g + 1, steps_after=3)

    cluster.stop()
    cluster.wait_exit([a, c])
    results = [w.read_result() for w in (a, c)]
    assert all(w.proc.returncode == 0 for w in (a, c)), cluster.dump_logs()
    assert_identical_state(results)
    assert_exactly_once(cluster.audit, N_SAMPLES, BATCH, results[0]["step"])
    assert "the store is away" in a.log_text() + b.log_text(), cluster.dump_logs()
    kinds = [ev["kind"] for ev in cluster.events()]
    assert "leave" in kinds and "join" in kinds, kinds


def test_a_long_store_loss_ends_the_workers_cleanly_with_a_checkpoint(kept):
    cluster = kept(min_workers=2)
    a, b = cluster.start(2, FOREVER, env={"ELTCTL_STORE_LOSS_TIMEOUT": "3"})
    cluster.wait_world(2, steps_after=3)
    step, _, _ = cluster.progress()

    cluster.kill_keeper()
    cluster.wait_exit([a, b], timeout=90)

    assert all(w.proc.returncode == 0 for w in (a, b)), cluster.dump_logs()
    results = [w.read_result() for w in (a, b)]
    assert_identical_state(results)
    final = results[0]["step"]
    assert final > step, (final, step)
    info, _ = CheckpointStore(cluster.ckpt).latest_valid()
    assert info.step == final, (info.step, final)
    assert "checkpointing at step" in a.log_text() + b.log_text(), cluster.dump_logs()
    assert_exactly_once(cluster.audit, N_SAMPLES, BATCH, final)

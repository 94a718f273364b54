"""examples/train.py's sharding options reach the job: `--shard`, `--shard-replicas`
and `--optimizer adamw` (the benchmarks drive the job through them)."""

from __future__ import annotations

import pytest

from runtime_cluster import SMALL, assert_exactly_once, assert_identical_state

N_SAMPLES = int(SMALL[SMALL.index("--samples") + 1])
BATCH = int(SMALL[SMALL.index("--batch") + 1])

pytestmark = pytest.mark.slow


def test_train_py_trains_sharded_with_adamw_and_the_job_reports_the_setting(cluster):
    cluster.min_workers = 2
    members = cluster.start(2, ["--steps", "4", "--optimizer", "adamw", "--shard", "gradients",
                                "--shard-replicas", "2"])
    cluster.wait_exit(members)
    assert all(w.proc.returncode == 0 for w in members), cluster.dump_logs()
    results = [w.read_result() for w in members]
    assert all(r["step"] == 4 and r["world_size"] == 2 for r in results), results
    assert_identical_state(results)
    assert_exactly_once(cluster.audit, N_SAMPLES, BATCH, 4)
    status = cluster.status()
    assert status["shard"] == "gradients" and status["shard_replicas"] == 2, status


def test_train_py_refuses_shard_replicas_without_shard(cluster):
    (w,) = cluster.start(1, ["--steps", "2", "--shard-replicas", "2"])
    cluster.wait_exit([w])
    assert w.proc.returncode != 0
    assert "shard_replicas applies to sharded training" in w.log_text()

"""The host daemon of a job with a secret and an attacker on the store: a forged
desired document (stop, every slot) is ignored, counted in the daemon's state
document and logged once; the controller's signed documents still work."""

from __future__ import annotations

import json
import secrets
from datetime import timedelta

import pytest
import torch.distributed as dist

from daemon_fixtures import SimHost
from eltctl_runtime.store import auth
from eltctl_runtime.protocol import desired_key, job_prefix

pytestmark = pytest.mark.slow


def test_a_forged_desired_document_is_ignored_and_counted(tmp_path):
    host = SimHost(tmp_path, secret=secrets.token_bytes(auth.SECRET_BYTES))
    try:
        host.start_daemon()
        seq = host.desire([0])
        host.wait_world(1)
        (worker,) = host.live_workers().values()

        tcp = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10))
        evil = dist.PrefixStore(job_prefix(host.job), tcp)
        evil.set(desired_key(host.name), json.dumps({"seq": seq + 100, "slots": [0, 1], "stop": True}))

        # Several polls of the daemon have met the forgery (its link reads every 0.25 s).
        state = host.wait_for(lambda: (s := host.state()) and s["forged"].get("daemon/desired", 0) >= 4 and s,
                              "the forged desired document counted")
        assert state["seq_applied"] == seq and state["phase"] == "running", state
        assert state["wanted"] == [0], state
        assert [w["worker_id"] for w in host.live_workers().values()] == [worker["worker_id"]]
        assert host.log().count("not signed with the job's secret") == 1, host.log()

        # The controller's next (signed) document is obeyed.
        host.desire([0, 1])
        host.wait_world(2)
        assert sorted(host.live_workers()) == [0, 1]
        assert host.state()["forged"]["daemon/desired"] >= 4
    finally:
        host.close()

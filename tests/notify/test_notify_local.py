"""End to end on this machine (`address = "local"`, the test bed of tests/commands/test_up.py):
a real controller trains a short job with `[notify] webhook` pointing at an HTTP server
of the test and `[controller] metrics_file` set. While it trains the metrics file parses
strictly and agrees with the status document written with it; when the training returns,
the server receives the `finished` notification with the documented body, and
`status --json` records the delivery."""

from __future__ import annotations

import json

import pytest

from tests.commands.test_up import local_job  # noqa: F401 - the fixture
from tests.notify.test_delivery import Endpoint, wait
from tests.testbed.hostpython import HOST_PYTHON
from tests.testbed.promtext import parse, value

STEPS = 60


def agreeing(lj, prom):
    """(status document, metrics families) written by the same status write."""
    for _ in range(200):
        before = lj.status()
        try:
            fams = parse(prom.read_text())
        except FileNotFoundError:
            fams = {}
        after = lj.status()
        if fams and before.get("updated") == after.get("updated") == value(
                fams, "eltctl_status_updated_timestamp_seconds"):
            return after, fams
        import time

        time.sleep(0.05)
    raise AssertionError("the metrics file never matched status.json")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_finished_job_is_notified_and_its_metrics_agree_with_its_status(local_job):  # noqa: F811
    lj = local_job
    prom = lj.root / "metrics" / f"{lj.job}.prom"
    prom.parent.mkdir()
    with Endpoint().running() as ep:
        lj.write({"h1": HOST_PYTHON}, command=["python", "train.py", "--steps", str(STEPS), "--hidden", "16",
                                               "--layers", "1", "--samples", "512", "--batch", "8",
                                               "--step-sleep", "0.05"])
        with open(lj.inventory, "a") as f:
            f.write(f'\n[controller]\nmetrics_file = {json.dumps(str(prom))}\n'
                    f'\n[notify]\nwebhook = "{ep.url}/hook"\nstall_after = "10m"\n')
        out, _ = lj.eltctl("up", "--timeout", "240")
        assert out.returncode == 0, out.stdout + out.stderr

        doc, fams = agreeing(lj, prom)
        job = {"job": lj.job}
        assert value(fams, "eltctl_world_size", **job) == doc["world_size"]
        assert value(fams, "eltctl_step", **job) == doc.get("step")
        assert value(fams, "eltctl_controller_up", **job) == 1
        assert value(fams, "eltctl_info", state=doc["state"], phase=doc["phase"]) == 1
        assert value(fams, "eltctl_hosts", state=doc["hosts"][0]["state"]) == 1

        wait(lambda: any(b.get("kind") == "finished" for _, _, b in ep.received), timeout=240)
        [(path, headers, body)] = [r for r in ep.received if r[2].get("kind") == "finished"]
        assert path == "/hook" and headers["Content-Type"] == "application/json"
        assert body["job"] == lj.job and body["detail"] == f"the training finished at step {STEPS}"
        assert body["text"] == f"eltctl job {lj.job}: finished: the training finished at step {STEPS}"
        wait(lambda: (lj.status().get("notify") or {}).get("delivered", 0) >= 1, timeout=30)
        assert lj.status()["notify"]["last_failure"] is None
        assert lj.status()["done"]["reason"] == "finished"

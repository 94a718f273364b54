"""The controller's outputs (controller/outputs.py) as the loop drives them: the store's
`done` key and the resizes among new events are read, the status document carries
`done`, `resizes` and `notify`, each published document queues its notifications and
rewrites `[controller] metrics_file`; an endpoint that never answers holds none of
the loop's passes."""

from __future__ import annotations

import asyncio
import json

import pytest

from eltctl.controller.outputs import Outputs
from eltctl.controller.statedir import StateDir
from eltctl.inventory import parse_inventory
from eltctl.notify import delivery
from eltctl_runtime.protocol import Keys
from tests.notify.test_delivery import Endpoint, wait
from tests.testbed.promtext import parse, value

T0 = 1_700_000_000.0


class DoneStore:
    def __init__(self) -> None:
        self.values: dict = {}

    async def get_json(self, key):
        return self.values.get(key)


def inventory(tmp_path, url: str):
    text = (f'[job]\nname = "bert"\ncommand = "python t.py"\n[controller]\nmetrics_file = "bert.prom"\n'
            f'[notify]\nwebhook = "{url}/hook"\ntimeout = "1s"\nretries = 0\n'
            '[[hosts]]\nname = "a"\naddress = "local"\n')
    (tmp_path / "hosts.toml").write_text(text)
    return parse_inventory(text, tmp_path / "hosts.toml")


def document(**over):
    doc = {"job": "bert", "state": "training", "phase": "training", "message": "", "step": 10, "world_size": 1,
           "hosts": [{"name": "a", "state": "running", "workers": 1}], "forged": {"total": 0},
           "controller": {"pid": 1, "alive": True}}
    doc.update(over)
    return doc


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(delivery, "BACKOFF_S", 0.01)


def test_a_finished_job_is_told_and_the_metrics_file_follows_the_document(tmp_path):
    with Endpoint().running() as ep:
        out = Outputs(inventory(tmp_path, ep.url), StateDir(tmp_path / "state"))
        (tmp_path / "state").mkdir()
        out.start()
        try:
            store = DoneStore()
            events = [{"kind": "join", "pause_s": 1.5}, {"kind": "crash", "pause_s": None}]
            asyncio.run(out.observe(store, events))
            events.append({"kind": "leave", "pause_s": 0.25})  # the log as the Observer keeps it: one new event
            asyncio.run(out.observe(store, events))
            doc = out.extend(document())
            assert doc["resizes"] == {"count": 2, "pause_s": 1.75, "last_pause_s": 0.25} and doc["done"] is None
            out.published(doc, T0)  # the first document: the memory, no notification
            store.values[Keys.DONE] = {"step": 99, "reason": "finished"}
            asyncio.run(out.observe(store, events))
            doc = out.extend(document(step=99))
            assert doc["done"] == {"step": 99, "reason": "finished"}
            out.published(doc, T0 + 1)
            wait(lambda: out.notifier.status()["delivered"] == 1)
            fams = parse((tmp_path / "bert.prom").read_text())
        finally:
            out.stop()
    [(path, _, body)] = ep.received
    assert path == "/hook" and body["kind"] == "finished" and body["detail"] == "the training finished at step 99"
    assert value(fams, "eltctl_step", job="bert") == 99 and value(fams, "eltctl_resize_pauses_total") == 2
    assert oct((tmp_path / "bert.prom").stat().st_mode & 0o777) == "0o644"  # node_exporter's account reads it
    assert json.loads((tmp_path / "state" / "notify.json").read_text())["delivered"] == 1


def test_an_endpoint_that_never_answers_holds_none_of_the_loops_passes(tmp_path):
    with Endpoint(answers=["hang"] * 5).running() as ep:
        out = Outputs(inventory(tmp_path, ep.url), StateDir(tmp_path / "state"))
        (tmp_path / "state").mkdir()
        out.start()
        try:
            out.published(document(), T0)
            out.published(document(state="paused"), T0 + 1)  # -> "paused", sent into the void
            assert ep.got.wait(20)  # the notifier's thread is inside that request now
            passes = 0
            for i in range(20):  # the loop's next passes, each publishing its document
                out.published(document(state="paused" if i % 2 else "training", step=10 + i), T0 + 2 + i)
                passes += 1
            assert passes == 20 and out.notifier.status()["pending"] >= 2
            assert value(parse((tmp_path / "bert.prom").read_text()), "eltctl_step") == 29  # metrics kept up
        finally:
            ep.release.set()
            out.stop(timeout=0.1)


def test_a_failure_of_the_outputs_never_stops_the_loop(tmp_path, monkeypatch, caplog):
    import eltctl.metrics

    out = Outputs(inventory(tmp_path, "http://127.0.0.1:9"), StateDir(tmp_path / "state"))
    out.published({"job": "bert", "hosts": "not a list", "forged": None, "step": object()}, T0)  # no raise
    monkeypatch.setattr(eltctl.metrics, "render", lambda *a, **k: 1 / 0)
    out.published(document(), T0 + 1)  # no raise: logged
    assert "Notifications or metrics failed" in caplog.text
    monkeypatch.undo()
    out.published(document(step=11), T0 + 2)
    assert value(parse((tmp_path / "bert.prom").read_text()), "eltctl_step") == 11

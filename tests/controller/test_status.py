"""The controller's phase after a pass, and the shape of the status document, as tables."""

from __future__ import annotations

import pytest

from eltctl.controller.observe import DaemonSeen
from eltctl.controller.policy import Decision, GpuUse, HostRecord, HostView, Reach, SlotView
from eltctl.controller.status import Phase, job_state, next_phase, status_document
from eltctl.inventory import parse_inventory

NOW = 10_000.0
INV = parse_inventory('[job]\nname = "j"\ncommand = "python t.py"\nmin_workers = 1\nmax_workers = 4\n'
                      '[policy]\nhang_timeout = 10\n'
                      '[[hosts]]\nname = "a"\naddress = "a.lab"\n[[hosts]]\nname = "b"\naddress = "b.lab"\n',
                      "hosts.toml")


def decision(waiting=False, message="") -> Decision:
    return Decision(actions=(), desired={}, usable=0, waiting=waiting, message=message)


RUNNING = {"a": HostView("a", Reach.OK, workers=(0,)), "b": HostView("b", Reach.OK)}
IDLE = {"a": HostView("a", Reach.OK), "b": HostView("b", Reach.OK)}
TRAINING_STATUS = {"time": NOW - 1, "world_size": 1}
WANTED = {"a": HostRecord(desired=(0,))}

# (case, phase before, runtime status, views, records, decision, daemons starting, phase and message after)
PHASES = [
    ("rank 0 reports a world and workers run: training", Phase.STARTING, TRAINING_STATUS, RUNNING, WANTED,
     decision(), False, (Phase.TRAINING, "")),
    ("a stale rank 0 status is not training", Phase.TRAINING, {"time": NOW - 31, "world_size": 1}, RUNNING, WANTED,
     decision(), False, (Phase.STARTING, "waiting for the first step")),
    ("too few GPUs and nothing runs: waiting, with the policy's reason", Phase.PROBING, None, IDLE, {},
     decision(waiting=True, message="1 usable slot(s), min_workers is 2"), False,
     (Phase.WAITING, "1 usable slot(s), min_workers is 2")),
    ("nothing wanted yet, the policy says why: starting with its reason", Phase.PROBING, None, IDLE, {},
     decision(message="GPU 0 of a free for 3 s of idle_for 10 s"), False,
     (Phase.STARTING, "GPU 0 of a free for 3 s of idle_for 10 s")),
    ("daemons being started from probing: shipping", Phase.PROBING, None, IDLE, WANTED, decision(), True,
     (Phase.SHIPPING, "old")),
    ("daemons being started later: the phase stays", Phase.STARTING, None, IDLE, WANTED, decision(), True,
     (Phase.STARTING, "old")),
    ("slots wanted, no worker yet: starting workers", Phase.SHIPPING, None, IDLE, WANTED, decision(), False,
     (Phase.STARTING, "starting workers")),
    ("nothing wanted and nothing to say: unchanged", Phase.PROBING, None, IDLE, {}, decision(), False,
     (Phase.PROBING, "old")),
]


@pytest.mark.parametrize("case, phase, rs, views, records, dec, starting, expected", PHASES,
                         ids=[c[0] for c in PHASES])
def test_next_phase(case, phase, rs, views, records, dec, starting, expected):
    assert next_phase(phase, "old", now=NOW, inventory=INV, runtime_status=rs, views=views, records=records,
                      decision=dec, starting_daemons=starting) == expected


@pytest.mark.parametrize("phase, state", [(Phase.TRAINING, "training"), (Phase.WAITING, "waiting"),
                                          (Phase.STOPPING, "stopping"), (Phase.STOPPED, "stopped"),
                                          (Phase.CONNECTING, "starting"), (Phase.SHIPPING, "starting")])
def test_job_state(phase, state):
    assert job_state(phase) == state


def test_status_document_shape():
    views = {"a": HostView("a", Reach.OK, slots=(SlotView(0, GpuUse.FREE), SlotView(1, GpuUse.BUSY, "pid 9")),
                           daemon_alive=True, workers=(0,)),
             "b": HostView("b", Reach.UNREACHABLE, reason="timeout")}
    records = {"a": HostRecord(desired=(0,), cooldown_until=NOW + 5, benched_until=NOW - 1)}
    rs = {"time": NOW - 2, "generation": 3, "world_size": 1, "members": ["a/0/0"], "step": 12, "epoch": 0,
          "samples_per_s": 99.0, "loss": 0.5, "checkpoint": {"step": 10, "time": NOW - 4, "path": "/c"}}
    events = [{"kind": "join", "time": float(i)} for i in range(25)]
    doc = status_document(now=NOW, inventory=INV, phase=Phase.TRAINING, message="", runtime_status=rs,
                          views=views, records=records, seen={"a": DaemonSeen(b"{}", NOW - 0.5, {})},
                          events=events, store_endpoint="127.0.0.1:29500", mirror=None)
    assert list(doc) == ["job", "state", "phase", "message", "updated", "generation", "world_size", "members",
                         "min_workers", "max_workers", "step", "epoch", "samples_per_s", "loss", "checkpoint",
                         "runtime_status_age_s", "controller", "store", "hosts", "events", "mirror"]
    assert (doc["job"], doc["state"], doc["world_size"], doc["min_workers"], doc["max_workers"]) == ("j", "training", 1,
                                                                                                    1, 4)
    assert doc["checkpoint"] == {"step": 10, "time": NOW - 4, "path": "/c", "age_s": 4.0}
    assert doc["runtime_status_age_s"] == 2.0
    assert doc["events"] == events[-20:]
    a, b = doc["hosts"]
    assert a == {"name": "a", "state": "running", "reason": "1 worker(s)", "workers": 1, "heartbeat_age_s": 0.5,
                 "benched_until": None, "cooldown_until": NOW + 5, "failures": 0, "desired": [0],
                 "gpus": [{"index": 0, "state": "ours", "reason": ""}, {"index": 1, "state": "busy", "reason": "pid 9"}]}
    assert (b["state"], b["reason"], b["heartbeat_age_s"], b["gpus"]) == ("unreachable", "timeout", None, [])

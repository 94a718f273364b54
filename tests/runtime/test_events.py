"""The job's event log is one log: the runtime (rank 0) and the host daemons
append through the same helper, so their entries share one numbering and one
vocabulary (EventKind)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

import eltctl_runtime as elt
from eltctl_runtime import EventKind


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def test_runtime_and_daemon_events_share_one_numbering(store):
    job = f"e{uuid.uuid4().hex[:8]}"
    n1 = elt.append_event(store, job, {"kind": EventKind.START, "generation": 0, "world_size": 2})
    n2 = elt.append_event(store, job, {"kind": "yield", "host": "ws1", "workers": ["ws1/0/5"], "pause_s": None,
                                       "detail": "ann (pid 42) took GPU 0; worker ws1/0/5 leaves", "time": 12.5})
    n3 = elt.append_event(store, job, {"kind": EventKind.LEAVE, "generation": 1, "left": ["ws1/0/5"]})
    assert (n1, n2, n3) == (1, 2, 3)
    events = elt.read_events(store, job)
    assert [e["kind"] for e in events] == ["start", "yield", "leave"]
    assert events[1]["time"] == 12.5 and events[1]["host"] == "ws1"  # a given time is kept
    assert all(isinstance(e["time"], float) for e in events)
    assert elt.read_events(store, job, start=3) == events[2:]


def test_an_unknown_event_kind_is_refused(store):
    job = f"e{uuid.uuid4().hex[:8]}"
    with pytest.raises(ValueError):
        elt.append_event(store, job, {"kind": "reboot"})
    assert elt.read_events(store, job) == []


def test_every_kind_the_daemon_writes_is_an_event_kind():
    for kind in ("yield", "crash"):
        assert EventKind(kind).value == kind

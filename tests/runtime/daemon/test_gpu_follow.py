"""A daemon follows its host's GPU list (issue 49): a daemon whose GPUs came from the
probe (daemon.json's `follow_gpus`) takes its slots from what nvidia-smi lists, and a
slot the applied desired document listed but the host did not have is taken up once
it is listed, with no new daemon and no new desired document.

Why (a clean-clone CI run): a host's daemon configured while its GPUs were briefly not
seen kept what it was started with and refused `desired seq 1 lists slot(s) [1] that
host h3 does not have`; the job stayed at world 5 of 6. The pure rules are tested by
tables; one real daemon on the GPU simulator shows the whole path.
"""

from __future__ import annotations

import json

import pytest

from eltctl_runtime.daemon import DaemonConfig
from eltctl_runtime.daemon.logic import Memory, Note, Start, View, decide, followed_slots, late_slots
from eltctl_runtime.protocol import Desired
from tests.runtime.daemon.daemon_fixtures import SimHost


@pytest.mark.parametrize("listed, wanted, valid, expected", [
    ((0, 1), {0}, {0, 1}, {1}),  # GPU 1 listed now: taken up
    ((0, 1), {0}, {0}, set()),  # still not there
    ((0, 1), {0, 1}, {0, 1}, set()),  # nothing was refused
    ((0, 5), {0}, None, {5}),  # any GPU
    ((), set(), {0, 1}, set()),  # the document lists none
])
def test_late_slots_are_those_refused_at_the_apply_and_had_now(listed, wanted, valid, expected):
    assert late_slots(listed, frozenset(wanted), None if valid is None else frozenset(valid)) == frozenset(expected)


@pytest.mark.parametrize("current, listed, expected", [
    ({0}, (0, 1), {0, 1}),  # a GPU appeared
    ({0, 1}, (0,), {0}),  # one went away: later documents asking it are refused
    ({0, 1}, (), {0, 1}),  # an empty list says nothing
    (None, (0, 1), {0, 1}),
])
def test_followed_slots_are_nvidia_smis_list_unless_it_is_empty(current, listed, expected):
    assert followed_slots(None if current is None else frozenset(current), listed) == frozenset(expected)


def _view(desired, memory, valid, **kw) -> View:
    return View(now=100.0, wall=1000.0, host="h1", desired=desired, memory=memory, valid_slots=frozenset(valid),
                leave_timeout=60, stop_timeout=300, **kw)


def test_a_slot_refused_at_the_apply_is_started_once_the_host_has_it():
    applied = decide(_view(Desired(1, (0, 1)), Memory(next_incarnation=1), {0}))
    assert [type(a) for a in applied.actions if not isinstance(a, Note)] == [Start]
    assert applied.memory.wanted == {0}
    later = decide(_view(Desired(1, (0, 1)), applied.memory, {0, 1}))
    assert [(a.slot, a.worker_id) for a in later.actions if isinstance(a, Start)] == [(1, "h1/1/2")]
    assert later.memory.wanted == {0, 1} and later.memory.armed == frozenset()
    assert any("now has slot(s) [1]" in a.message for a in later.actions if isinstance(a, Note))
    again = decide(_view(Desired(1, (0, 1)), later.memory, {0, 1}))
    assert not [a for a in again.actions if isinstance(a, Start)]  # armed once, as at an apply


def test_a_stopping_job_takes_up_nothing():
    m = Memory(seq_applied=1, wanted=frozenset({0}), next_incarnation=2)
    d = decide(_view(Desired(1, (0, 1)), m, {0, 1}, terminating=True))
    assert not [a for a in d.actions if isinstance(a, Start)] and d.memory.wanted == {0}


def test_follow_gpus_is_read_and_means_nothing_without_gpus():
    base = {"job": "j", "host": "h", "store": "127.0.0.1:1", "job_dir": "/tmp/j", "code_dir": "/tmp/j",
            "command": ["python", "t.py"]}
    assert DaemonConfig.from_json(json.dumps({**base, "gpus": [0], "follow_gpus": True})).follow_gpus
    assert not DaemonConfig.from_json(json.dumps({**base, "gpus": None, "follow_gpus": True})).follow_gpus
    assert not DaemonConfig.from_json(json.dumps({**base, "gpus": [0]})).follow_gpus
    with pytest.raises(Exception, match="follow_gpus"):
        DaemonConfig.from_json(json.dumps({**base, "gpus": [0], "follow_gpus": "yes"}))


@pytest.mark.slow
def test_a_running_daemon_follows_its_hosts_gpu_list(tmp_path):
    """The host shows one GPU when the daemon starts; the controller's document asks for
    GPUs 0 and 1 (GPU 1 refused). GPU 1 appears: the same daemon takes it up under the
    same document, and the worker on GPU 0 trains on. GPU 1 goes: the daemon's list
    follows (its worker there is the controller's to stop)."""
    host = SimHost(tmp_path, n_gpus=1, overrides={"follow_gpus": True})
    try:
        daemon = host.start_daemon()
        host.desire([0, 1])
        host.wait_world(1)
        st = host.state()
        assert (st["valid_slots"], st["follows_gpus"]) == ([0], True)
        first = host.live_workers()
        assert sorted(first) == [0]

        host.gpu.set_gpus(2)
        host.wait_world(2)
        st = host.state()
        assert st["valid_slots"] == [0, 1] and st["pid"] == daemon.pid and daemon.poll() is None
        workers = host.live_workers()
        assert sorted(workers) == [0, 1] and workers[0]["pid"] == first[0]["pid"]  # untouched
        log = host.log()
        assert "nvidia-smi now lists GPUs [0, 1] (the daemon had [0])" in log
        assert "now has slot(s) [1] that desired seq 1 lists" in log

        host.desire([0])  # the controller drops GPU 1 first, as its probe sees it go
        host.wait_world(1)
        host.gpu.set_gpus(1)
        host.wait_for(lambda: (s := host.state()) and s["valid_slots"] == [0], "the daemon's list to drop GPU 1")
        assert host.live_workers()[0]["pid"] == first[0]["pid"]
    finally:
        host.close()

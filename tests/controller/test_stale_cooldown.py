"""Issue 50, finding 8: a failure cooldown that a person's word used up never comes back.

A `scale --add` waives a failure cooldown once; the cooldown stayed in the record, hid
under the host's workers, and came back with its old reason ("its daemon did not
report") once they left: after a cordon and uncordon the working host sat out the rest
of an old cooldown. `uncordon` ("its free GPUs are used again") and `up` ("after a fix
`eltctl up` retries at once") did not clear it either. Pure: the policy's functions
with a fixed clock, in the order the controller calls them.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from eltctl.controller import client
from eltctl.controller.policy import (
    HostPhase,
    HostRecord,
    applied,
    eligible_slots,
    failure_cleared,
    host_state,
    record_failure,
    retried,
)
from eltctl.controller.statedir import StateDir
from tests.controller.test_policy import NOW, free_for, inventory, view

DID_NOT_REPORT = "its daemon did not report (see its daemon.log)"


def test_a_cooldown_waived_by_scale_add_does_not_come_back_when_the_workers_leave():
    inv = inventory(cooldown=300)
    free = view("a", "free")
    rec = record_failure(HostRecord(free_since=free_for(99, 0)), inv, NOW, DID_NOT_REPORT)
    assert eligible_slots(free, rec, inv, NOW + 1) == []  # the cooldown holds
    rec = replace(rec, join_now=True)  # `scale --add a`
    assert eligible_slots(free, rec, inv, NOW + 1) == [0]
    rec = applied(rec, (0,))  # its slot written: the waiver is used
    running = view("a", "ours", alive=True, workers=(0,))
    assert host_state(running, rec, NOW + 2)[0] is HostPhase.RUNNING
    rec = applied(rec, ())  # a cordon (or any planned leave) takes the slot away; then uncordon
    phase, reason = host_state(free, rec, NOW + 60)
    assert phase is HostPhase.IDLE and DID_NOT_REPORT not in reason, reason
    assert eligible_slots(free, rec, inv, NOW + 60) == [0]
    assert rec.failures == 1  # the count stays: a host that keeps failing is still benched


def test_uncordon_clears_a_failure_cooldown_but_not_an_owner_cooldown_nor_a_benching():
    failed = record_failure(HostRecord(cordoned=True), inventory(cooldown=300), NOW, DID_NOT_REPORT)
    assert failed.cooldown_until == NOW + 300
    cleared = failure_cleared(failed)
    assert cleared.cooldown_until == 0.0 and cleared.last_problem == "" and cleared.failures == 1
    owner = replace(failed, owner_until=NOW + 100, owner_note="its owner took GPU 0")
    assert failure_cleared(owner).owner_until == NOW + 100
    benched = replace(failed, benched_until=NOW + 600, last_problem="benched after 3 failures in a row; last: x")
    kept = failure_cleared(benched)
    assert kept.benched_until == NOW + 600 and kept.last_problem == benched.last_problem


def test_up_retries_the_hosts_held_by_a_failure_and_leaves_the_others():
    inv = inventory(cooldown=300, hosts=("a", "b", "c"))
    records = {"a": record_failure(HostRecord(), inv, NOW, DID_NOT_REPORT),
               "b": HostRecord(benched_until=NOW + 600, bench_count=1, last_problem="benched after 3 failures"),
               "c": HostRecord(owner_until=NOW + 100, owner_note="its owner took GPU 0", desired=(0,))}
    out = retried(records, NOW + 1)
    assert out["a"].cooldown_until == 0.0 and out["a"].failures == 0 and out["a"].last_problem == ""
    assert out["b"].benched_until == 0.0 and out["b"].bench_count == 0
    assert out["c"] is records["c"]  # an owner's cooldown protects a person: kept


def test_up_with_no_controller_retries_in_hosts_json(tmp_path):
    # The controller `up` starts reads hosts.json: the retry is written there first.
    inv = inventory(cooldown=300, hosts=("a", "b"))
    state = StateDir(tmp_path / inv.job.name)
    state.create()
    now = time.time()
    failed = record_failure(HostRecord(), inv, now, DID_NOT_REPORT)
    owner = HostRecord(owner_until=now + 100, owner_note="its owner took GPU 0")
    state.hosts_json.write_text(json.dumps({"hosts": {"a": failed.to_json(), "b": owner.to_json()},
                                            "desired_seq": 7}))
    client._retry_stopped(inv, state)
    doc = json.loads(state.hosts_json.read_text())
    assert doc["desired_seq"] == 7
    assert HostRecord.from_json(doc["hosts"]["a"]).cooldown_until == 0.0
    assert HostRecord.from_json(doc["hosts"]["b"]) == owner

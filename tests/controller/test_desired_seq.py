"""Desired documents only move forward (issue 21, part C): a daemon ignores a seq
lower than one it applied (a replay), so the controller's seq counter outlives a run:
hosts.json keeps the highest seq ever sent, and every host continues above it, also
one whose record was dropped."""

from __future__ import annotations

from eltctl.controller import policy as pol
from eltctl.controller.loop import Controller
from eltctl.controller.statedir import StateDir
from eltctl.inventory import parse_inventory
from eltctl_runtime.files import read_json, write_json_atomic

INV = parse_inventory(
    '[job]\nname = "j"\ncommand = "python t.py"\n'
    '[[hosts]]\nname = "a"\naddress = "a.lab"\n'
    '[[hosts]]\nname = "b"\naddress = "b.lab"\n', "hosts.toml")


def controller(state: StateDir) -> Controller:
    ctl = Controller(INV, state, store=None, fleet=None, store_endpoint="127.0.0.1:1")  # type: ignore[arg-type]
    ctl.load_records()
    return ctl


def test_the_desired_seq_continues_above_every_earlier_run(tmp_path):
    state = StateDir(tmp_path / "j")
    state.path.mkdir()
    write_json_atomic(state.hosts_json, {"hosts": {"a": pol.HostRecord(seq=41).to_json()}})
    first = controller(state)
    assert first.records["a"].seq == 41 and first.records["b"].seq == 41  # b: never sent one, above a's
    first.records["a"] = pol.applied(first.records["a"], (0,))  # seq 42 sent
    del first.records["b"]
    first.save_records()
    assert read_json(state.hosts_json)["desired_seq"] == 42

    # the next run (a new `up`): a's record dropped too; both continue above 42
    doc = read_json(state.hosts_json)
    write_json_atomic(state.hosts_json, {**doc, "hosts": {}})
    second = controller(state)
    assert second.records["a"].seq == second.records["b"].seq == 42
    assert pol.applied(second.records["b"], (0,)).seq == 43

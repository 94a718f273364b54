"""The wire protocol lives in one module (runtime/protocol.py): no other module
spells a store key, and the documents it defines keep the exact shape the
controller, the host daemons and the runtime have always written."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from dictstore import DictStore
from eltctl_runtime import protocol
from eltctl_runtime.protocol import Desired, EventKind, Keys

ROOT = Path(__file__).resolve().parents[2]
KEY_LITERAL = re.compile(r"^(daemon|events|gen|join|leave|dead|hb|eltctl)/")


def key_literals(path: Path) -> list[str]:
    """`file:line: text` for each string literal (or f-string's leading text) in
    `path` that begins like a store key; docstrings do not count."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    inside_fstring = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            text = head.value if isinstance(head, ast.Constant) and isinstance(head.value, str) else ""
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and id(node) not in inside_fstring):
            text = node.value
        else:
            continue
        if KEY_LITERAL.match(text) or text == "events/seq":
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            found.append(f"{where}:{node.lineno}: {text!r}")
    return found


def spelled_keys(folder: str) -> list[str]:
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path != ROOT / "runtime" / "protocol.py":
            out += key_literals(path)
    return out


def test_no_runtime_module_but_protocol_spells_a_store_key():
    assert spelled_keys("runtime") == []


def test_no_control_side_module_spells_a_store_key():
    assert spelled_keys("eltctl") == []


def test_the_scan_finds_keys_spelled_by_hand(tmp_path):
    probe = tmp_path / "keys.py"
    probe.write_text('"""daemon/<host>/desired in a docstring is fine."""\n'
                     'a = f"daemon/{host}/desired"\nb = "events/seq"\nc = "gen/3/plan"\nd = "status"\n')
    assert [line.split(": ", 1)[1] for line in key_literals(probe)] == ["'daemon/'", "'events/seq'", "'gen/3/plan'"]


def test_the_protocol_and_the_helpers_import_without_torch():
    code = ("import sys\nimport eltctl_runtime.protocol, eltctl_runtime.files, eltctl_runtime.pids, "
            "eltctl_runtime.nvsmi\nassert 'torch' not in sys.modules\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------- keys


def test_keys_are_the_ones_every_side_has_always_used():
    assert protocol.job_prefix("mnist") == "eltctl/mnist"
    assert protocol.KEEPER_KEY == "eltctl/storekeeper"
    assert protocol.desired_key("ws1") == Keys.desired("ws1") == "daemon/ws1/desired"
    assert protocol.state_key("ws1") == Keys.daemon_state("ws1") == "daemon/ws1/state"
    assert (Keys.EVENTS_SEQ, Keys.event(7), Keys.STATUS, Keys.STOP, Keys.DONE) == (
        "events/seq", "events/7", "status", "stop", "done")
    assert (Keys.plan(3), Keys.abort(3), Keys.alive(3, "w"), Keys.pg_prefix(3)) == (
        "gen/3/plan", "gen/3/abort", "gen/3/alive/w", "gen/3/pg")
    assert (Keys.join(2), Keys.heartbeat("w"), Keys.leave("w"), Keys.dead("w"), Keys.JOIN_SEQ, Keys.DEAD_SEQ) == (
        "join/2", "hb/w", "leave/w", "dead/w", "join/seq", "dead/seq")


def test_the_scope_reads_and_writes_the_same_keys_as_c10ds_prefix_store():
    dist = pytest.importorskip("torch.distributed")
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    job = f"p{uuid.uuid4().hex[:8]}"
    prefixed = dist.PrefixStore(protocol.job_prefix(job), tcp)
    scoped = protocol.scope(tcp, job)
    scoped.set(Keys.desired("ws1"), Desired(3, (1, 0)).to_json())
    assert Desired.from_json(prefixed.get(Keys.desired("ws1"))) == Desired(3, (0, 1))
    prefixed.set(Keys.STATUS, json.dumps({"step": 5}))
    assert protocol.read_status(tcp, job) == {"step": 5}
    assert protocol.add_event(prefixed, {"kind": "bench", "host": "ws2", "time": 1.0}) == 1
    assert protocol.read_events(tcp, job) == [{"kind": "bench", "host": "ws2", "time": 1.0}]
    assert scoped.check([Keys.EVENTS_SEQ]) and tcp.check([f"eltctl/{job}/events/1"])


# ---------------------------------------------------------------------------- documents


def test_desired_is_byte_for_byte_what_the_controller_writes():
    # eltctl/controller/loop.py writes json.dumps({"seq", "slots", "stop"}).
    assert Desired(4, (0, 2)).to_json() == json.dumps({"seq": 4, "slots": [0, 2], "stop": False})
    assert Desired(5, (), stop=True).to_json() == json.dumps({"seq": 5, "slots": [], "stop": True})
    js = DictStore()
    assert protocol.get_desired(js, "ws1") is None
    protocol.put_desired(js, "ws1", Desired(1, (3,)))
    assert js.data["daemon/ws1/desired"] == b'{"seq": 1, "slots": [3], "stop": false}'
    assert protocol.get_desired(js, "ws1") == Desired(1, (3,))
    js.set("daemon/ws1/desired", "{}")
    with pytest.raises(ValueError):
        protocol.get_desired(js, "ws1")


def test_event_document_has_the_shape_daemons_and_the_controller_write():
    # eltctl/controller/loop.py `_event` and the daemon's `_event`, as they were written by hand.
    by_hand = {"time": 12.5, "kind": "restore", "host": None, "workers": [], "pause_s": None,
               "detail": "step 40 from ws1", "step": 40, "where": "ws1"}
    doc = protocol.event_document("restore", host=None, detail="step 40 from ws1", time=12.5, step=40, where="ws1")
    assert json.dumps(doc) == json.dumps(by_hand)
    daemon = {"time": 3.0, "kind": "yield", "host": "ws1", "workers": ["ws1/0/5"], "pause_s": None,
              "detail": "ann (pid 42) took GPU 0"}
    assert json.dumps(protocol.event_document(EventKind.YIELD, host="ws1", workers=["ws1/0/5"],
                                              detail="ann (pid 42) took GPU 0", time=3.0)) == json.dumps(daemon)
    assert isinstance(protocol.event_document("bench", host="ws2", detail="x")["time"], float)
    with pytest.raises(ValueError):
        protocol.event_document("reboot", host=None, detail="")


def test_every_kind_the_controller_writes_is_an_event_kind():
    for kind in ("bench", "add", "remove", "restore"):
        assert EventKind(kind).value == kind


def test_add_event_writes_what_the_controllers_event_did():
    # eltctl/controller/store.py JobStore.event: add events/seq, set events/<n> = json.dumps(document).
    js = DictStore()
    doc = protocol.event_document("add", host="ws3", detail="added by eltctl scale --add", time=7.0)
    assert protocol.add_event(js, doc) == 1
    assert js.data["events/1"] == json.dumps(doc).encode()
    assert protocol.add_event(js, {"kind": EventKind.STOP, "generation": 2, "step": 9}) == 2
    assert [e["kind"] for e in protocol.get_events(js)] == ["add", "stop"]
    assert protocol.get_events(js, start=2)[0]["step"] == 9


def test_requests_on_a_scoped_store():
    js = DictStore()
    protocol.put_dead(js, "h/0/1")
    protocol.put_dead(js, "h/1/2")
    protocol.put_leave(js, "h/2/3")
    protocol.put_stop(js)
    assert js.check(["dead/h/0/1", "dead/h/1/2", "leave/h/2/3", "stop"]) and js.add("dead/seq", 0) == 2
    assert protocol.get_status(js) is None


def test_status_document_keeps_its_fields_in_order():
    doc = protocol.status_document(generation=1, world_size=2, members=("a", "b"), step=3, epoch=0, position=48,
                                   samples_per_s=12.5, loss=0.25, checkpoint=None, time=9.0)
    assert list(doc) == ["generation", "world_size", "members", "step", "epoch", "position", "samples_per_s",
                         "loss", "checkpoint", "time"]
    assert doc["members"] == ["a", "b"]

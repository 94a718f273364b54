"""The store's own operations (store/ops.py): each declared once, served by the server
and offered by every client and prefix store from that one declaration."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import eltctl_runtime
from eltctl_runtime.store.client import PlainPrefixStore, PlainSocketStore, connect, prefix_store
from eltctl_runtime.store.ops import C10D, OWN, Op, StoreOp, check_table
from eltctl_runtime.store.server import StoreServer


@pytest.fixture
def server(tmp_path):
    srv = StoreServer()
    srv.listen_unix(tmp_path / "s.sock")
    srv.start()
    yield srv
    srv.stop()


def test_every_operation_has_one_number_and_name_and_the_own_ones_follow_c10ds():
    assert {op.name: int(op) for op in Op} == {**C10D, **{o.name: o.code for o in OWN}}
    assert min(o.code for o in OWN) > max(C10D.values())
    clash = StoreOp(3, "SIZES", "value_sizes", lambda srv, items: [], lambda: [], lambda out: out)
    with pytest.raises(ValueError, match="unique numbers"):
        check_table(OWN + (clash,))


def test_the_own_operations_reach_the_server_through_every_client_and_prefix(server):
    spec = f"unix:{server.unix_path}"
    plain = connect(spec, 5, plain=True)
    assert isinstance(plain, PlainSocketStore)
    plain.set("job/a", b"1")
    plain.ping()
    assert plain.peek_many(["job/a", "job/b"]) == [b"1", None]
    assert sorted(plain.list_keys()) == ["job/a"]
    under = prefix_store("job", plain)
    assert isinstance(under, PlainPrefixStore) and under.peek_many(["a", "b"]) == [b"1", None]
    assert not hasattr(under, "list_keys")  # the whole store's keys: not offered under a prefix
    torch_store = connect(spec, 5)  # a torch SocketStore (a c10d Store)
    assert torch_store.peek_many(["job/a"]) == [b"1"]
    assert prefix_store("job", torch_store).peek_many(["b", "a"]) == [None, b"1"]
    by_op = server.stats()["requests_by_op"]
    assert by_op["PEEK"] == 4 and by_op["PING"] == 1 and by_op["LIST_KEYS"] == 1


def test_peek_under_a_prefix_of_c10ds_own_store_falls_back_to_compare_set():
    import torch.distributed as dist

    base = dist.HashStore()
    under = prefix_store("job", base)
    under.set("a", "1")
    assert under.peek_many(["a", "b"]) == [b"1", None]
    assert base.num_keys() == 1  # the fallback created nothing


NEW_OP = '''
def _serve_sizes(srv, items):
    return [str(len(srv._data[k.decode()])).encode() if k.decode() in srv._data else b"-1"
            for k in map(srv._check_key, items)]


SIZES = StoreOp(15, "SIZES", "value_sizes", _serve_sizes,
                request=lambda keys: [as_bytes(k) for k in keys],
                answer=lambda out: [None if v == b"-1" else int(v) for v in out],
                keys=lambda under, args: ([under(k) for k in args[0]],))

'''

USE_IT = '''
import sys
from eltctl_runtime.store.client import connect, prefix_store
from eltctl_runtime.store.server import StoreServer

srv = StoreServer()
srv.listen_unix(sys.argv[1])
srv.start()
plain = connect(f"unix:{sys.argv[1]}", 5, plain=True)
plain.set("job/a", b"hello")
assert plain.value_sizes(["job/a", "job/b"]) == [5, None]
assert prefix_store("job", plain).value_sizes(["a"]) == [5]
torch_store = connect(f"unix:{sys.argv[1]}", 5)
assert torch_store.value_sizes(["job/a"]) == [5]
assert prefix_store("job", torch_store).value_sizes(["b", "a"]) == [None, 5]
assert srv.stats()["requests_by_op"]["SIZES"] == 4
srv.stop()
print("served")
'''


def test_a_new_operation_is_one_storeop_in_ops_py(tmp_path):
    """The claim in runtime/README.md's "Where a change goes": a copy of the runtime
    where only store/ops.py gains an operation serves it end to end (the server, the
    plain client, the torch SocketStore and both prefix stores)."""
    copy = tmp_path / "eltctl_runtime"
    shutil.copytree(Path(eltctl_runtime.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    ops = copy / "store" / "ops.py"
    before = "OWN: tuple[StoreOp, ...] = (LIST_KEYS, PING, PEEK)"
    text = ops.read_text()
    assert before in text
    ops.write_text(text.replace(before, NEW_OP + before.replace("PEEK)", "PEEK, SIZES)")))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(USE_IT), str(tmp_path / "s.sock")],
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "served", out.stderr[-3000:]

"""runtime/README.md's "Where a change goes", checked: on a copy of the runtime where
only the file the table names changed, the new thing works end to end. (The store's
new operation: tests/runtime/store/test_store_ops.py. A sharding optimizer is an entry of
train/zero/optim.py's SUPPORTED_OPTIMIZERS with its state's names; the sharded tests
run each one there against its unsharded self.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import eltctl_runtime


def runtime_with(tmp_path: Path, relative: str, before: str, after: str) -> Path:
    """A copy of eltctl_runtime under tmp_path where `relative` alone has `before`
    replaced by `after`; the folder to put on PYTHONPATH."""
    copy = tmp_path / "eltctl_runtime"
    shutil.copytree(Path(eltctl_runtime.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / relative
    text = path.read_text()
    assert text.count(before) == 1, f"{relative} no longer holds {before!r}: update this test with the README"
    path.write_text(text.replace(before, after))
    return tmp_path


def run(root: Path, script: str) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env={"PYTHONPATH": str(root),
                         "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_a_new_control_tail_field_is_one_line_in_control(tmp_path):
    """A scalar and a per-rank field added to train/tail.py's Control (and PER_RANK)
    ride every rank's step and come back summed by name; the others keep their values."""
    root = runtime_with(tmp_path, "train/tail.py",
                        '    averaging: bool = False  #',
                        '    drain: bool = False\n    queue: int = 0\n    averaging: bool = False  #')
    tail = root / "eltctl_runtime" / "train" / "tail.py"
    tail.write_text(tail.read_text().replace('PER_RANK = ("leave", "pace", "oom")',
                                             'PER_RANK = ("leave", "pace", "oom", "queue")'))
    run(root, """
        from eltctl_runtime.train.tail import Control, layout
        lay = layout(3)
        parts = [Control(samples=2, drain=r == 1, queue=5 * r, pace=0.5) for r in range(3)]
        got = lay.decode(sum(lay.encode(r, c) for r, c in enumerate(parts)))
        assert got.drain == 1.0 and got.queue == [0.0, 5.0, 10.0], got
        assert got.samples == 6.0 and got.pace == [0.5, 0.5, 0.5] and got.averaging == 0.0, got
        assert lay.size == 9 + 4 * 3
        print("ok")
    """)


def test_a_new_membership_event_is_its_kind_and_meaning_in_protocol_py(tmp_path):
    """A planned kind added to protocol.py (EventKind, PLANNED, MEMBERSHIP) is a
    generation change whose leavers are `left`, and an event the log accepts."""
    root = runtime_with(tmp_path, "protocol.py",
                        '    FAIRSHARE = "fairshare"',
                        '    DRAIN = "drain"\n    FAIRSHARE = "fairshare"')
    proto = root / "eltctl_runtime" / "protocol.py"
    text = proto.read_text().replace("PLANNED = frozenset({EventKind.LEAVE,", "PLANNED = frozenset({EventKind.DRAIN, "
                                     "EventKind.LEAVE,")
    proto.write_text(text.replace("MEMBERSHIP = (EventKind.START,", "MEMBERSHIP = (EventKind.DRAIN, EventKind.START,"))
    run(root, """
        from eltctl_runtime.member.plan import Plan, propose
        from eltctl_runtime.protocol import MEMBERSHIP, EventKind, event_document
        now = propose(None, [], [(1, "a"), (2, "b"), (3, "c")], 3, None, EventKind.START, now=1.0)
        drained = propose(now, ["a", "c"], [], 3, None, EventKind.DRAIN, now=2.0)
        assert drained.kind is EventKind.DRAIN and drained.left == ("b",) and drained.lost == (), drained
        assert Plan.from_json(drained.to_json()) == drained
        crashed = propose(now, ["a", "c"], [], 3, None, EventKind.CRASH, now=2.0)
        assert crashed.lost == ("b",) and crashed.left == ()
        assert event_document("drain", host="h1", detail="drained")["kind"] == "drain"
        assert EventKind.DRAIN in MEMBERSHIP
        print("ok")
    """)


def test_a_new_restart_progress_pattern_is_one_entry_of_patterns(tmp_path):
    """A named pattern added to restart/progress.py's PATTERNS is what `[job] progress`
    names (the inventory compiles it there) and reads a script's lines."""
    root = runtime_with(tmp_path, "restart/progress.py",
                        'PATTERNS: dict[str, tuple[str, ...]] = {\n',
                        'PATTERNS: dict[str, tuple[str, ...]] = {\n'
                        '    "iter-loss": (rf"^iter (?P<step>\\d+)/\\d+ .*\\bloss (?P<loss>{_NUM})",),\n')
    run(root, """
        from eltctl_runtime.restart.progress import compile_progress, match_progress
        patterns = compile_progress("iter-loss")
        assert match_progress(patterns, "iter 120/5000 lr 3e-4 loss 2.25") == {"step": 120, "loss": 2.25}, \\
            match_progress(patterns, "iter 120/5000 lr 3e-4 loss 2.25")
        assert match_progress(patterns, "epoch 3 done") is None
        print("ok")
    """)

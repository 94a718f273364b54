"""Restart mode's progress contract (runtime/progress.py): the script's report()
and checkpoint_saved() calls, the supervisor's tail of them, the output patterns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eltctl_runtime.restart import progress
from eltctl_runtime.restart.progress import PATTERNS, PatternError, ProgressFile, ProgressTracker, compile_progress, match_progress

SCRIPT = """
import os, sys
from eltctl_runtime import report, checkpoint_saved
for step in range(1, 1001):
    report(step=step, loss=1.0 / step, samples=step * 64, lr=0.1)
checkpoint_saved(os.path.join(os.environ.get("ELTCTL_CHECKPOINT_DIR", "."), "ckpt.pt"))
report(step=1001, loss=0.001)
assert "torch" not in sys.modules
"""


def test_report_outside_eltctl_writes_nothing(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != progress.ENV_PROGRESS}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.iterdir()) == []


def test_reports_are_rate_limited_and_the_last_one_and_checkpoints_reach_the_supervisor(tmp_path):
    path = tmp_path / "progress"
    env = {**__import__("os").environ, progress.ENV_PROGRESS: str(path), "ELTCTL_CHECKPOINT_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = ProgressFile(path).poll()
    # the first report, the one pending when the checkpoint was announced, the checkpoint, the last at exit
    assert len(lines) <= 4
    assert lines[0]["step"] == 1 and lines[0]["metrics"] == {"lr": 0.1}
    ckpt = [ln for ln in lines if "checkpoint" in ln]
    assert ckpt == [{"t": ckpt[0]["t"], "checkpoint": str(tmp_path / "ckpt.pt")}]
    assert lines.index(ckpt[0]) >= 1 and lines[lines.index(ckpt[0]) - 1]["step"] == 1000
    assert lines[-1]["step"] == 1001 and lines[-1]["loss"] == pytest.approx(0.001)


def test_a_line_carries_the_loss_of_a_separate_call_whichever_call_writes_it(tmp_path, monkeypatch):
    """A Trainer reports the step and samples at a step's end, the loss when it logs just
    after: the line written at a step's end carries the loss logged since the last line."""
    path = tmp_path / "progress"
    monkeypatch.setenv(progress.ENV_PROGRESS, str(path))
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    rep = progress._Reporter()
    for step in range(1, 31):
        clock[0] += 0.15  # the step's compute
        rep.report(step, None, step * 8, {})  # on_step_end: writes when REPORT_EVERY_S has passed
        clock[0] += 0.001
        rep.report(step, 1.0 / step, None, {"lr": 0.1})  # on_log, just after
    lines = ProgressFile(path).poll()
    assert len(lines) >= 4 and all(ln["step"] is not None and ln["samples"] is not None for ln in lines), lines
    assert all(ln["loss"] == pytest.approx(1.0 / (ln["step"] - 1)) for ln in lines[1:]), lines  # the step before's
    assert lines[-1]["metrics"] == {"lr": 0.1}


def test_progress_file_reads_only_whole_new_lines_and_rotates(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "ROTATE_BYTES", 100)
    path = tmp_path / "p"
    reader = ProgressFile(path)
    assert reader.poll() == []
    with open(path, "ab") as f:
        f.write(b'{"step": 1}\n{"step"')
    assert reader.poll() == [{"step": 1}]
    with open(path, "ab") as f:
        f.write(b': 2}\n' + b'{"step": 3, "pad": "' + b"x" * 100 + b'"}\n')
    assert [ln["step"] for ln in reader.poll()] == [2, 3]
    assert not path.exists()  # renamed aside
    with open(str(path) + ".1", "ab") as f:  # a writer that opened it before the rename
        f.write(b'{"step": 4}\n')
    with open(path, "ab") as f:
        f.write(b'{"step": 5}\n')
    assert [ln["step"] for ln in reader.poll()] == [4, 5]
    assert not (tmp_path / "p.1").exists()


def test_tracker_derives_samples_per_second_from_the_samples_so_far():
    t = ProgressTracker()
    t.update({"step": 10, "loss": 0.5, "samples": 640}, now=100.0)
    t.update({"step": 20, "samples": 1280}, now=105.0)
    assert (t.step, t.loss, t.samples_per_s) == (20, 0.5, pytest.approx(128.0))
    t.reset()
    assert t.step == 20 and t.samples_per_s is None


@pytest.mark.parametrize("name,line,expect", [
    ("step-loss", "step 120 world 1 restart 0 loss 0.5000", {"step": 120, "loss": 0.5}),
    ("step-loss", "saved step 120", {"step": 120}),
    ("hf-trainer", " 50%|█████     | 500/1000 [00:10<00:20, 49.50it/s]", {"step": 500, "steps_per_s": 49.5}),
    ("hf-trainer", "{'loss': 0.1234, 'grad_norm': 1.5, 'learning_rate': 5e-05, 'epoch': 0.5}",
     {"loss": 0.1234, "epoch_f": 0.5}),
    ("hf-trainer", "{'eval_loss': 0.3, 'epoch': 1.0}", None),
    ("lightning", "Epoch 3:  45%|████▌     | 450/1000 [00:05<00:06, 85.20it/s, v_num=0, train_loss=0.123]",
     {"epoch": 3, "batch": 450, "batches": 1000, "steps_per_s": 85.2, "loss": 0.123, "step": 3450}),
    ("lightning", "Validation DataLoader 0: 100%|██████████| 10/10", None),
])
def test_named_patterns_read_the_frameworks_lines(name, line, expect):
    assert match_progress(compile_progress(name), line) == expect


def test_a_custom_pattern_needs_a_named_group_and_a_valid_regex():
    assert match_progress(compile_progress(r"it (?P<step>\d+) l=(?P<loss>\S+)"), "it 7 l=0.25") == {
        "step": 7, "loss": 0.25}
    with pytest.raises(PatternError, match="named group"):
        compile_progress(r"step \d+")
    with pytest.raises(PatternError, match="not a valid regex"):
        compile_progress(r"step (?P<step>\d+")
    assert set(PATTERNS) >= {"hf-trainer", "lightning"}

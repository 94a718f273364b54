"""eltctl_runtime.integrations: the HF Trainer and Lightning callbacks.

The pure parts (which checkpoint a script resumes from, the SIGTERM flag) run in
the dev environment. The scripts examples/hf_trainer.py and
examples/lightning_train.py run under the frameworks' host interpreter
(.venv-host-frameworks) as torchrun would start them: two ranks train, both get
SIGTERM, and each saves the step it had reached and exits 143; started again at
world size 1 the script resumes at exactly that step (nothing redone, nothing
skipped). The same scripts run under restart mode on sshd hosts in
tests/controller/test_restart_frameworks_sshd.py.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eltctl_runtime.integrations.common import STOPPED_EXIT, StopSignal, agree, inside_checkpoint_dir
from tests.testbed.hostpython import FRAMEWORKS_PYTHON, HOST_PYTHON, ROOT, frameworks_missing_reason, host_env

STEP = re.compile(r"^step (\d+) world (\d+) restart (\d+)", re.M)
RESUMED = re.compile(r"^resumed at step (\d+) world (\d+) restart (\d+)", re.M)


def test_integrations_package_imports_no_framework_and_needs_no_more_than_the_host_has():
    code = ("import sys, eltctl_runtime.integrations, eltctl_runtime.integrations.common; "
            "bad = [m for m in ('transformers', 'lightning', 'accelerate', 'numpy') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    subprocess.run([HOST_PYTHON, "-c", code], env=host_env(dict(os.environ)), check=True)


def test_hf_last_checkpoint_is_the_newest_complete_one(tmp_path):
    hf = pytest.importorskip("eltctl_runtime.integrations.hf")
    assert hf.last_checkpoint(tmp_path / "none") is None
    assert hf.last_checkpoint(tmp_path) is None
    for step, complete in ((5, True), (40, True), (120, False), (9, True)):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        if complete:
            (d / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert hf.last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-40")  # 120 was cut short


def test_lightning_last_checkpoint_has_the_highest_step(tmp_path):
    lt = pytest.importorskip("eltctl_runtime.integrations.lightning")
    assert lt.last_checkpoint(tmp_path) is None
    for name in ("epoch=0-step=50.ckpt", "step=73.ckpt", "epoch=1-step=9.ckpt", "last.ckpt", "step=99.txt"):
        (tmp_path / name).write_bytes(b"x")
    assert lt.last_checkpoint(tmp_path) == str(tmp_path / "step=73.ckpt")


def test_sigterm_only_sets_the_flag_until_restored():
    stop = StopSignal()
    before = signal.getsignal(signal.SIGTERM)
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested
        assert agree(True) and not agree(False)  # no process group: the flag itself
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_only_paths_inside_the_checkpoint_dir_are_mirrorable(tmp_path, monkeypatch):
    monkeypatch.setenv("ELTCTL_CHECKPOINT_DIR", str(tmp_path / "ck"))
    assert inside_checkpoint_dir(tmp_path / "ck" / "checkpoint-5")
    assert not inside_checkpoint_dir(tmp_path / "elsewhere")
    monkeypatch.delenv("ELTCTL_CHECKPOINT_DIR")
    assert not inside_checkpoint_dir(tmp_path / "ck")


# -- the example scripts, two ranks then one -----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(script: str, world: int, restart: int, ckpt: Path, logs: Path, steps_before_term: int) -> list[int]:
    """Start `world` ranks as torchrun would; SIGTERM all once rank 0 printed
    `steps_before_term` step lines; their exit codes."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = host_env({**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                        "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                        "TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_RUN_ID": "t",
                        "ELTCTL_CHECKPOINT_DIR": str(ckpt)})
        log = (logs / f"r{r}-{restart}.log").open("w")
        procs.append(subprocess.Popen(
            [FRAMEWORKS_PYTHON, str(ROOT / "examples" / script), "--max-steps", "100000", "--save-steps", "1000",
             "--step-sleep", "0.05"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    rank0 = logs / f"r0-{restart}.log"
    try:
        deadline = time.monotonic() + 120
        while len(STEP.findall(rank0.read_text())) < steps_before_term:
            assert time.monotonic() < deadline, rank0.read_text()[-3000:]
            assert all(p.poll() is None for p in procs), rank0.read_text()[-3000:]
            time.sleep(0.1)
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        return [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("script", ["hf_trainer.py", "lightning_train.py"])
def test_script_saves_the_step_it_reached_on_sigterm_and_resumes_there(script, tmp_path):
    reason = frameworks_missing_reason()
    if reason:
        pytest.skip(reason)
    ckpt = tmp_path / "ckpt"
    assert _run_ranks(script, 2, 0, ckpt, tmp_path, 4) == [STOPPED_EXIT] * 2
    first = STEP.findall((tmp_path / "r0-0.log").read_text())
    last = int(first[-1][0])
    assert _run_ranks(script, 1, 1, ckpt, tmp_path, 2) == [STOPPED_EXIT]
    text = (tmp_path / "r0-1.log").read_text()
    assert [tuple(map(int, m)) for m in RESUMED.findall(text)] == [(last, 1, 1)], text[-3000:]
    second = [int(s) for s, _w, _r in STEP.findall(text)]
    assert second[0] == last + 1 and second == list(range(last + 1, last + 1 + len(second))), second

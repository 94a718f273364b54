"""`eltctl demo`: its setup (inventory, simulated GPUs, the owner), its reading of
the status, its cleanup, its summary, and the whole demo run for real."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from eltctl.demo import (
    MARKER_ENV,
    DemoPlan,
    Owner,
    has_yielded,
    is_training,
    pid_alive,
    prepare,
    read_pid_file,
    render_summary,
    resizes,
    summarize,
    sweep,
    wait_pid_exit,
    worker_pid,
)
from eltctl.inventory import DeviceKind, load_inventory

T0 = 1790000000.0


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "demo").mkdir()
    s = prepare(tmp_path / "demo", DemoPlan(), job="demo-test")
    yield s
    sweep(s.root)


def test_inventory_has_three_local_hosts_with_simulated_gpus(setup):
    inv = load_inventory(setup.inventory)
    assert [(h.name, h.address) for h in inv.hosts] == [("ws1", "local"), ("ws2", "local"), ("ws3", "local")]
    assert inv.job.name == "demo-test" and inv.job.device is DeviceKind.CPU
    assert inv.job.max_workers == 4 and inv.job.min_workers == 1
    assert inv.policy.idle_for == 3.0 and inv.policy.cooldown == 3.0
    assert (inv.job.workdir / "train.py").is_file() and (inv.job.workdir / "toy.py").is_file()
    for host in inv.hosts:
        env = dict(host.env)
        assert env["ELTSIM_HOST"] == host.name
        assert env["PATH"].split(":")[0] == str(setup.bin_dir)
        assert env["HOME"] == str(setup.home)
        assert Path(env["ELTSIM_STATE"]) == setup.gpu_states[host.name]


def test_probe_sees_the_owner_take_the_gpu_and_give_it_back(setup):
    """eltctl's own probe over the local transport: what the controller sees."""
    from eltctl.probe import probe_inventory

    inv = load_inventory(setup.inventory)
    before = {r.name: [g.state.value for g in r.gpus] for r in probe_inventory(inv)}
    assert before == {"ws1": ["free", "free"], "ws2": ["free"], "ws3": ["free"]}
    owner = Owner(setup, "ws2", 0)
    pid = owner.arrive()
    try:
        reports = {r.name: r for r in probe_inventory(inv)}
        assert [g.state.value for g in reports["ws2"].gpus] == ["busy"]
        assert str(pid) in reports["ws2"].gpus[0].reason
        assert [g.state.value for g in reports["ws1"].gpus] == ["free", "free"]
    finally:
        owner.leave()
    assert not pid_alive(pid)
    after = {r.name: [g.state.value for g in r.gpus] for r in probe_inventory(inv)}
    assert after == before


def test_sweep_ends_the_demos_processes_and_no_other(setup, tmp_path):
    ours = subprocess.Popen(["sleep", "300"], env={"PATH": "/usr/bin:/bin", MARKER_ENV: str(setup.root)},
                            start_new_session=True)
    # Another demo's process (a different root, sharing a prefix) must survive.
    other_root = Path(str(setup.root) + "-other")
    other = subprocess.Popen(["sleep", "300"], env={"PATH": "/usr/bin:/bin", MARKER_ENV: str(other_root),
                                                    "ELTSIM_STATE": f"{other_root}/gpus/ws1.json"},
                             start_new_session=True)
    worker_like = subprocess.Popen(["sleep", "300"], env={"PATH": "/usr/bin:/bin",
                                                          "ELTSIM_STATE": str(setup.gpu_states["ws1"])},
                                   start_new_session=True)
    try:
        found = sweep(setup.root, grace_s=5)
        assert ours.pid in found and worker_like.pid in found
        assert other.pid not in found
        assert ours.wait(timeout=10) is not None and worker_like.wait(timeout=10) is not None
        assert other.poll() is None
    finally:
        for p in (ours, other, worker_like):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_worker_pid_comes_from_the_daemons_pid_file(setup):
    d = setup.host_dir("ws2") / "workers"
    d.mkdir(parents=True)
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        (d / "0.pid").write_text(f"{proc.pid}\n")
        assert worker_pid(setup, "ws2", 0) == proc.pid
        (d / "0.pid").write_text(f'{{"pid": {proc.pid}, "worker_id": "ws2/0/1"}}')
        assert worker_pid(setup, "ws2", 0) == proc.pid
        assert worker_pid(setup, "ws2", 1) is None
        proc.kill()
        assert wait_pid_exit(proc.pid, 10) is not None or proc.wait() is not None
        proc.wait()
        assert worker_pid(setup, "ws2", 0) is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("text, pid", [("123\n", 123), ("123 ws1/0/1\n", 123), ('{"pid": 7}', 7),
                                       ("", None), ("x", None), ('{"pid": "7"}', None)])
def test_read_pid_file(tmp_path, text, pid):
    (tmp_path / "p").write_text(text)
    assert read_pid_file(tmp_path / "p") == pid


def test_without_torch_the_demo_says_so_and_starts_nothing(monkeypatch, tmp_path):
    import importlib.util

    from eltctl.demo import DemoError, run_demo

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(DemoError) as info:
        run_demo(DemoPlan(), Console(file=io.StringIO()), root=tmp_path)
    assert "need PyTorch" in info.value.message and "bash scripts/demo.sh" in info.value.hint
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing started


# ------------------------------------------------------------------------ reading the status (pure)

def doc(state="training", world=4, step=100, events=()):
    return {"job": "d", "state": state, "world_size": world, "step": step, "events": list(events)}


@pytest.mark.parametrize("d, world, min_step, expected", [
    (doc(), 4, 0, True),
    (doc(step=100), 4, 101, False),
    (doc(world=3), 4, 0, False),
    (doc(state="waiting"), 4, 0, False),
    ({"state": "training", "world_size": 4, "step": None}, 4, 0, True),
])
def test_is_training(d, world, min_step, expected):
    assert is_training(d, world, min_step=min_step) is expected


YIELD = {"time": T0 + 5, "kind": "yield", "host": "ws2", "pause_s": 0.03, "detail": "root (pid 9) took GPU 0"}


@pytest.mark.parametrize("events, host, since, expected", [
    ([YIELD], "ws2", T0, True),
    ([YIELD], "ws1", T0, False),
    ([YIELD], "ws2", T0 + 10, False),  # an older yield does not count
    ([{**YIELD, "kind": "leave"}], "ws2", T0, False),
    ([], "ws2", T0, False),
])
def test_has_yielded(events, host, since, expected):
    assert has_yielded(doc(events=events), host, since) is expected


def test_summary_lists_each_resize_with_its_pause():
    events = [
        {"time": T0 + 1, "kind": "start", "host": "", "workers": ["ws1/0/1", "ws1/1/1"], "pause_s": 2.4},
        {"time": T0 + 2, "kind": "bench", "host": "ws3", "pause_s": None, "detail": "x"},
        YIELD,
        {"time": T0 + 12.5, "kind": "join", "host": "ws2", "workers": ["ws2/0/2"], "pause_s": 0.41,
         "detail": ""},
    ]
    final = {**doc(step=321, events=events), "loss": 0.01234}
    assert [e["kind"] for e in resizes(final, T0)] == ["start", "yield", "join"]
    summary = summarize("demo-x", final, started=T0, first_loss=1.5, yield_latency_s=0.61,
                        rejoin_after_s=7.25, duration_s=70.4, down_message="no process of job demo-x left")
    console = Console(width=100, record=True, file=io.StringIO(), color_system=None)
    console.print(render_summary(summary))
    text = "\n".join(line.rstrip() for line in console.export_text().splitlines())
    assert text == textwrap.dedent("""\
        demo summary
        job          demo-x
        steps        321
        final loss   0.01234 (first seen 1.5)
        pauses       3 resize(s), longest 2.40 s, median 410 ms
        owner yield  0.61 s from the owner's process on the GPU to our worker's exit there (target <= 5 s)
        rejoin       7.2 s after the owner left (idle_for + cooldown + join)
        took         70 s
        down         no process of job demo-x left
        resizes

              at   event   host    pause   detail
         ──────────────────────────────────────────────────────────
           1.0 s   start   ws1    2.40 s   ws1/0/1, ws1/1/1
           5.0 s   yield   ws2     30 ms   root (pid 9) took GPU 0
          12.5 s   join    ws2    410 ms   ws2/0/2
        """)


# ------------------------------------------------------------------------ the whole demo, for real

def _has_up() -> bool:
    import importlib.util

    return importlib.util.find_spec("eltctl.commands.up") is not None


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not _has_up(), reason="`eltctl up` (the controller) is not in this tree yet")
def test_demo_runs_the_whole_story_and_leaves_nothing():
    import shutil
    import tempfile

    # Short: the controller's control.sock lives below it (sun_path holds 107 bytes).
    root = Path(tempfile.mkdtemp(prefix="eltdemo-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE")}
    env.update({"NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "120"})
    started = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "eltctl", "demo", "--plain", "--dir", str(root),
                            "--owner-stays", "3"], env=env, capture_output=True, text=True, timeout=380,
                           stdin=subprocess.DEVNULL)
    finally:
        left = sweep(root)
        shutil.rmtree(root, ignore_errors=True)
    took = time.monotonic() - started
    print(r.stdout[-6000:], r.stderr[-3000:], f"demo took {took:.0f} s", sep="\n")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "training on 4 workers" in out
    assert "the owner of ws1 starts a process on GPU 1" in out
    assert "the job goes on at 3 workers" in out
    assert "GPU 1 of ws1 is used again: 4 workers" in out
    assert "demo summary" in out and "final loss" in out
    summary = out[out.index("demo summary"):]
    assert " yield " in summary and " join " in summary
    assert left == [], f"processes of the demo were still running after it ended: {left}"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not _has_up(), reason="`eltctl up` (the controller) is not in this tree yet")
def test_ctrl_c_stops_everything_the_demo_started():
    import shutil
    import signal
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="eltdemo-", dir="/tmp"))
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb"}
    # SIGINT back to its default in the child: a test run started in the background
    # (`cmd &` without job control) ignores SIGINT, and the child would inherit that.
    proc = subprocess.Popen([sys.executable, "-m", "eltctl", "demo", "--plain", "--dir", str(root)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # Interrupt once the hosts' daemons run: the most there is to clean up before training.
        daemons = lambda: list(root.glob("home/.eltctl/jobs/*/*/daemon.pid"))  # noqa: E731
        deadline = time.monotonic() + 240
        while not daemons() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert daemons(), "no daemon started within 240 s"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
        print(out[-3000:])
        assert proc.returncode == 130, out[-3000:]
        assert "demo interrupted; every process it started has been stopped" in out
        assert sweep(root) == [], "the demo left processes behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sweep(root)
        shutil.rmtree(root, ignore_errors=True)

"""`eltctl status`: the view drawn from fixed documents (exact text), where the
document comes from (a live controller's socket or the last status.json), and the
command as a user runs it (--json, no job, --watch and Ctrl-C, import cost)."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from eltctl.controller.socket import request
from eltctl.statusview import (
    CONTROLLER_DOWN,
    NoJobError,
    Snapshot,
    Source,
    ViewOptions,
    format_age,
    format_pause,
    job_state_dir,
    read_snapshot,
    render_status,
    utc,
)

NOW = 1790000000.0  # 2026-09-21 14:13:20 UTC
TIMEOUT = 120

TRAINING = {
    "job": "mnist", "state": "training", "phase": "training", "message": "",
    "updated": NOW,
    "generation": 7, "world_size": 3, "min_workers": 2, "max_workers": 8,
    "step": 1234, "epoch": 3, "samples_per_s": 812.5, "loss": 0.0312,
    "checkpoint": {"step": 1200, "time": NOW - 10.0, "age_s": 10.0},
    "controller": {"pid": 4242, "alive": True},
    "hosts": [
        {"name": "ws1", "state": "running", "reason": "", "workers": 2, "heartbeat_age_s": 0.4,
         "benched_until": None,
         "gpus": [{"index": 0, "state": "ours", "reason": "worker ws1/0/1"},
                  {"index": 1, "state": "ours", "reason": "worker ws1/1/1"}]},
        {"name": "ws2", "state": "busy", "reason": "its owner is back", "workers": 0,
         "heartbeat_age_s": 0.7, "benched_until": None,
         "gpus": [{"index": 0, "state": "busy", "reason": "alice (pid 999): 6000 MiB, 90%"}]},
        {"name": "ws3", "state": "running", "reason": "", "workers": 1, "heartbeat_age_s": 1.2,
         "benched_until": None, "gpus": [{"index": 0, "state": "ours", "reason": "worker ws3/0/1"}]},
        {"name": "cpu1", "state": "benched", "reason": "daemon failed 3 times", "workers": 0,
         "heartbeat_age_s": None, "benched_until": NOW + 100.0, "gpus": []},
    ],
    "events": [
        {"time": NOW - 60.0, "kind": "start", "host": "", "workers": ["ws1/0/1", "ws1/1/1", "ws2/0/1", "ws3/0/1"],
         "pause_s": 2.5, "detail": ""},
        {"time": NOW - 20.0, "kind": "yield", "host": "ws2", "workers": ["ws2/0/1"],
         "pause_s": None, "detail": "alice (pid 999) took GPU 0"},
        # The runtime's own membership events name workers, not hosts.
        {"kind": "leave", "generation": 6, "world_size": 3, "members": ["ws1/0/1", "ws1/1/1", "ws3/0/1"],
         "joined": [], "left": ["ws2/0/1"], "lost": [], "from_step": 51, "pause_s": 0.021, "step": 52,
         "time": NOW - 19.5},
        {"time": NOW - 5.0, "kind": "crash", "host": "cpu1", "workers": ["cpu1/0/2"],
         "pause_s": 1.75, "detail": "exit status 1"},
    ],
}

WAITING = {
    "job": "mnist", "state": "waiting", "message": "2 of 3 workers free",
    "updated": NOW, "generation": 2, "world_size": 0, "min_workers": 3, "max_workers": None,
    "step": 40, "epoch": 0, "samples_per_s": None, "loss": None, "checkpoint": None,
    "controller": {"pid": 77, "alive": True}, "hosts": [], "events": [],
}


def view_text(doc, source: Source, now: float, *, width: int = 160, **options) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None,
                      highlight=False, force_terminal=False)
    console.print(render_status(Snapshot(doc, source, now), ViewOptions(now=now, tz=utc(), **options)))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


# ------------------------------------------------------------------------ the view, exact

def test_training_job_from_a_live_controller():
    assert view_text(TRAINING, Source.CONTROLLER, NOW + 0.5) == textwrap.dedent("""\
        job         mnist training
        workers     3 (min 2, max 8)   generation 7
        progress    step 1234   epoch 3   812.5 samples/s   loss 0.0312
        checkpoint  step 1200, 10 s ago
        controller  running (pid 4242), status 0.5 s old

          host   state     workers   heartbeat   GPUs                                        note
         ───────────────────────────────────────────────────────────────────────────────────────────────────────────────────────────
          ws1    running         2       0.9 s   GPU 0 ours worker ws1/0/1
                                                 GPU 1 ours worker ws1/1/1
          ws2    busy            0       1.2 s   GPU 0 busy alice (pid 999): 6000 MiB, 90%   its owner is back
          ws3    running         1       1.7 s   GPU 0 ours worker ws3/0/1
          cpu1   benched         0           -   no GPUs (CPU slots)                         daemon failed 3 times
                                                                                             benched until 14:15:00 (in 1 min 39 s)

        recent events (4 of 4)

          time       event   host             pause   detail
         ────────────────────────────────────────────────────────────────────────────────
          14:12:20   start   ws1, ws2, ws3   2.50 s   ws1/0/1, ws1/1/1, ws2/0/1, ws3/0/1
          14:13:00   yield   ws2                      alice (pid 999) took GPU 0
          14:13:00   leave   ws2              21 ms   left ws2/0/1; now 3 worker(s)
          14:13:15   crash   cpu1            1.75 s   exit status 1
        """).rstrip("\n") + "\n"


def test_dead_controller_shows_the_last_document_with_its_age():
    text = view_text(TRAINING, Source.FILE, NOW + 130.0)
    lines = text.splitlines()
    assert lines[3] == "checkpoint  step 1200, 2 min 20 s ago"
    assert lines[4] == f"controller  {CONTROLLER_DOWN}"
    assert lines[5] == "            showing the last status it wrote, 2 min 10 s old"
    # Heartbeats were that old when written, and the document has aged since.
    assert "ws1    running         2   2 min 10 s" in text


def test_waiting_job_without_hosts_or_events():
    assert view_text(WAITING, Source.CONTROLLER, NOW + 1) == textwrap.dedent("""\
        job         mnist waiting (2 of 3 workers free)
        workers     0 (min 3, max any)   generation 2
        progress    step 40   epoch 0
        checkpoint  none yet
        controller  running (pid 77), status 1.0 s old

          host       state   workers   heartbeat   GPUs   note
         ──────────────────────────────────────────────────────────────────────
          no hosts

        recent events (0 of 0)

          time       event   host   pause   detail
         ──────────────────────────────────────────
          none yet
        """).rstrip("\n") + "\n"


def test_a_cooling_host_says_until_when_and_its_failures():
    doc = copy.deepcopy(WAITING)
    doc["hosts"] = [{"name": "ws9", "state": "cooldown", "reason": "its owner left", "workers": 0,
                     "heartbeat_age_s": 0.5, "cooldown_until": NOW + 30, "failures": 2, "gpus": []}]
    text = view_text(doc, Source.CONTROLLER, NOW)
    row = text[text.index("  ws9"):]
    assert "cooldown" in row and "its owner left" in row
    assert "cooling down until 14:13:50" in " ".join(row.split())
    assert "2 failure(s) in a row" in " ".join(row.split())


def test_only_the_last_events_are_shown():
    text = view_text(TRAINING, Source.CONTROLLER, NOW, events=1)
    assert "recent events (1 of 4)" in text
    assert "crash" in text and "yield" not in text


def test_a_document_with_missing_fields_still_renders():
    text = view_text({"job": "x"}, Source.FILE, NOW)
    assert text.splitlines()[0] == "job         x ?"
    assert "no hosts" in text and "none yet" in text


def test_markup_in_names_and_reasons_is_text():
    doc = copy.deepcopy(TRAINING)
    doc["hosts"][1]["reason"] = "[bold]not markup[/]"
    doc["events"][1]["detail"] = "[red]x"
    text = view_text(doc, Source.CONTROLLER, NOW)
    assert "[bold]not" in text and "[red]x" in text


def test_terminal_escapes_from_the_store_are_shown_not_obeyed(tmp_path):
    """An event detail or a reason holding ESC/CSI sequences (anyone who reached the store
    or a host can write one) reaches the terminal as visible text."""
    doc = copy.deepcopy(TRAINING)
    doc["events"][1]["detail"] = "\x1b]0;owned\x07\x1b[2J\x9b31mred"
    doc["hosts"][1]["reason"] = "back\rspace\x08"
    d = state_dir(tmp_path)
    (d / "status.json").write_text(json.dumps(doc))
    snap = read_snapshot("mnist", d)
    text = view_text(snap.document, Source.FILE, NOW)
    assert not any(c in text for c in "\x1b\x07\x9b\r\x08")
    assert "\\x1b]0;owned" in text and "\\x9b31mred" in text
    assert snap.document["hosts"][1]["reason"] == "back\\x0dspace\\x08"


@pytest.mark.parametrize("seconds, text", [
    (None, "?"), (0.04, "0.0 s"), (0.4, "0.4 s"), (9.94, "9.9 s"), (12.4, "12 s"), (59.4, "59 s"),
    (60, "1 min 00 s"), (185, "3 min 05 s"), (3600, "1 h 00 min"), (7380, "2 h 03 min"), (-3, "0.0 s"),
])
def test_format_age(seconds, text):
    assert format_age(seconds) == text


@pytest.mark.parametrize("seconds, text", [
    (None, ""), (0.0004, "0 ms"), (0.021, "21 ms"), (0.999, "999 ms"), (1.0, "1.00 s"),
    (48.04, "48.04 s"), (75, "1 min 15 s"),
])
def test_format_pause(seconds, text):
    assert format_pause(seconds) == text


def test_json_view_says_whether_the_controller_answered():
    stale = Snapshot(TRAINING, Source.FILE, NOW)
    assert stale.as_json()["controller"] == {"pid": 4242, "alive": False}
    assert stale.as_json()["hosts"] == TRAINING["hosts"]
    assert Snapshot(TRAINING, Source.CONTROLLER, NOW).as_json()["controller"]["alive"] is True


# ------------------------------------------------------------------------ where the document comes from

class FakeControllerSocket:
    """A unix socket that answers the documented protocol with a fixed document:
    it stands for the controller so the client side is tested on its own."""

    def __init__(self, path: Path, answer: bytes) -> None:
        self.path, self.answer = path, answer
        self.requests: list[dict] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self):
        old = os.getcwd()
        os.chdir(self.path.parent)  # a short name: pytest's tmp paths can exceed sun_path
        try:
            self.sock.bind(self.path.name)
        finally:
            os.chdir(old)
        self.sock.listen(4)
        self.thread.start()
        return self

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                self.requests.append(json.loads(data))
                conn.sendall(self.answer)

    def __exit__(self, *exc):
        self.sock.close()
        self.thread.join(timeout=5)


def state_dir(tmp_path: Path, job: str = "mnist") -> Path:
    d = job_state_dir(job, {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": "/nonexistent"})
    d.mkdir(parents=True)
    return d


def test_state_dir_follows_xdg():
    assert job_state_dir("j", {"XDG_STATE_HOME": "/s", "HOME": "/h"}) == Path("/s/eltctl/j")
    assert job_state_dir("j", {"HOME": "/h"}) == Path("/h/.local/state/eltctl/j")
    assert job_state_dir("j", {"XDG_STATE_HOME": "rel", "HOME": "/h"}) == Path("/h/.local/state/eltctl/j")


def test_live_controller_is_asked_first(tmp_path):
    d = state_dir(tmp_path)
    (d / "status.json").write_text(json.dumps({**TRAINING, "step": 1}))
    with FakeControllerSocket(d / "control.sock", json.dumps(TRAINING).encode() + b"\n") as fake:
        snap = read_snapshot("mnist", d)
    assert fake.requests == [{"op": "status"}]
    assert snap.source is Source.CONTROLLER and snap.document["step"] == 1234


def test_socket_of_a_dead_controller_falls_back_to_the_file(tmp_path):
    d = state_dir(tmp_path)
    (d / "status.json").write_text(json.dumps(TRAINING))
    # A socket file nobody listens on: what a killed controller leaves behind.
    with FakeControllerSocket(d / "control.sock", b"") as fake:
        fake.sock.close()
    snap = read_snapshot("mnist", d)
    assert snap.source is Source.FILE and snap.document["step"] == 1234
    assert "control.sock" in snap.why_file


def test_controller_that_answers_garbage_falls_back_to_the_file(tmp_path):
    d = state_dir(tmp_path)
    (d / "status.json").write_text(json.dumps(TRAINING))
    with FakeControllerSocket(d / "control.sock", b"not json\n"):
        snap = read_snapshot("mnist", d)
    assert snap.source is Source.FILE


def test_long_socket_paths_are_reached(tmp_path):
    deep = tmp_path.joinpath(*["d" * 20] * 6)
    deep.mkdir(parents=True)
    assert len(str(deep / "control.sock")) > 108
    with FakeControllerSocket(deep / "control.sock", b'{"ok": true, "pid": 1}\n'):
        assert request(deep / "control.sock", {"op": "ping"}) == {"ok": True, "pid": 1}


def test_no_job_is_an_error(tmp_path):
    with pytest.raises(NoJobError) as info:
        read_snapshot("mnist", tmp_path / "nothing")
    assert info.value.exit_code == 1
    assert "eltctl up" in info.value.hint


# ------------------------------------------------------------------------ the command

def write_inventory(tmp_path: Path, job: str = "mnist") -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(f'[job]\nname = "{job}"\ncommand = "python train.py"\n\n'
                    '[[hosts]]\nname = "here"\naddress = "local"\n')
    return path


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ELTCTL_INVENTORY", "FORCE_COLOR", "CLICOLOR_FORCE", "COLUMNS")}
    env.update({"NO_COLOR": "1", "TERM": "dumb", "XDG_STATE_HOME": str(tmp_path / "state"),
                "COLUMNS": "100"})
    return env


def eltctl(tmp_path: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eltctl", *args], cwd=tmp_path, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL, **kw)


def test_status_without_a_job_exits_1_with_a_hint(tmp_path):
    write_inventory(tmp_path)
    r = eltctl(tmp_path, "status")
    assert r.returncode == 1
    assert r.stderr.startswith("error: no status of job 'mnist' on this machine")
    assert "hint: `eltctl up` starts the job" in r.stderr
    assert eltctl(tmp_path, "status", "--json").returncode == 1


def test_status_json_prints_the_document(tmp_path):
    write_inventory(tmp_path)
    d = state_dir(tmp_path)
    (d / "status.json").write_text(json.dumps(TRAINING))
    r = eltctl(tmp_path, "status", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for key in ("job", "state", "generation", "world_size", "step", "hosts", "events"):
        assert doc[key] == TRAINING[key]
    assert doc["controller"]["alive"] is False  # nothing answers on control.sock
    assert {"name", "state", "workers"} <= set(doc["hosts"][0])
    assert {"time", "kind", "host", "pause_s"} <= set(doc["events"][0])


def test_status_of_a_dead_controller_says_how_to_restart_it(tmp_path):
    write_inventory(tmp_path)
    d = state_dir(tmp_path)
    written = time.time() - 30
    (d / "status.json").write_text(json.dumps({**TRAINING, "updated": written}))
    r = eltctl(tmp_path, "status")
    took = time.time() - written  # the age the command can have seen: 30 s plus its own start (slow on a loaded machine)
    assert r.returncode == 0, r.stderr
    assert CONTROLLER_DOWN in r.stdout
    m = re.search(r"showing the last status it wrote, (\d+) s old", r.stdout)
    assert m and 30 <= int(m.group(1)) <= took + 1, r.stdout


# `python -m eltctl` with each read of the status document marked in $ELTSIM_VIEWS (a dot
# apiece, written as the read begins): the test waits for the watch's reads, not a clock.
# (Its output is no tty: rich prints only the last view, at the end.)
COUNTED_READS = """
import os, runpy
import eltctl.statusview as statusview
read, views = statusview.read_snapshot, os.environ.pop("ELTSIM_VIEWS")
def counted(*args, **kwargs):
    with open(views, "a") as f:
        f.write(".")
    return read(*args, **kwargs)
statusview.read_snapshot = counted
runpy.run_module("eltctl", run_name="__main__")
"""


def test_status_watch_refreshes_and_ctrl_c_exits_0(tmp_path):
    write_inventory(tmp_path)
    d = state_dir(tmp_path)
    (d / "status.json").write_text(json.dumps({**TRAINING, "updated": time.time()}))
    views = tmp_path / "views"
    proc = subprocess.Popen([sys.executable, "-c", COUNTED_READS, "status", "--watch"], cwd=tmp_path,
                            env={**cli_env(tmp_path), "ELTSIM_VIEWS": str(views)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            # default SIGINT even when the test run itself ignores it (started with `&`)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def reads_reach(n: int) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not (views.exists() and len(views.read_text()) >= n):
            assert proc.poll() is None and time.monotonic() < deadline, f"the watch read the document < {n} times"
            time.sleep(0.05)

    try:
        reads_reach(1)  # the watch is up and showed the first document
        (d / "status.json").write_text(json.dumps({**TRAINING, "step": 99999, "updated": time.time()}))
        # Read n+1 began after the new document was written; n+2 after read n+1 was drawn.
        reads_reach(len(views.read_text()) + 2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "step 99999" in out  # the new document was drawn without restarting the command


def test_status_imports_neither_torch_nor_asyncssh(tmp_path):
    write_inventory(tmp_path)
    d = state_dir(tmp_path)
    (d / "status.json").write_text(json.dumps(TRAINING))
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "eltctl", "status"], cwd=tmp_path,
                       env=cli_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "rich" in imported  # the check itself works
    assert not imported & {"torch", "asyncssh", "numpy"}


# ------------------------------------------------------------------------ eltctl logs (the other reading command)

from eltctl.inventory import Host  # noqa: E402
from eltctl.logs import Chunk, LogReader, parse_read_output, show_logs  # noqa: E402
from eltctl.hosts.local import LocalTransport  # noqa: E402


def test_log_reader_shows_whole_lines_with_their_source():
    reader = LogReader()
    lines = reader.feed([Chunk("workers/10.log", 4, b"ten\n"), Chunk("workers/2.log", 9, b"a\nb\npart"),
                         Chunk("daemon.log", 6, b"start\n")])
    assert lines == ["[daemon] start", "[worker 2] a", "[worker 2] b", "[worker 10] ten"]
    assert reader.offsets == {"workers/10.log": 4, "workers/2.log": 9, "daemon.log": 6}
    assert reader.feed([Chunk("workers/2.log", 13, b"ial\n")]) == ["[worker 2] partial"]
    # A file that shrank was rewritten: its unfinished line is dropped, not glued on.
    reader.feed([Chunk("daemon.log", 10, b"half")])
    assert reader.feed([Chunk("daemon.log", 3, b"new\n")]) == ["[daemon] new"]
    reader.feed([Chunk("daemon.log", 8, b"tail")])
    assert reader.flush() == ["[daemon] tail"]


def test_read_output_without_the_job_directory_is_none():
    assert parse_read_output("@@eltctl-nodir\n") is None
    assert parse_read_output("motd noise\n@@eltctl-log daemon.log 3 YWIK\n") == [Chunk("daemon.log", 3, b"ab\n")]
    assert parse_read_output("@@eltctl-log workers/0.log 0 \n") == [Chunk("workers/0.log", 0, b"")]


def _job_logs(home: Path, job: str = "j1", host: str = "here") -> Path:
    d = home / ".eltctl" / "jobs" / job / host
    (d / "workers").mkdir(parents=True)
    (d / "daemon.log").write_text("d1\nd2\nd3\n")
    (d / "workers" / "0.log").write_bytes("w0 a\nw0 \xe9\n".encode() + b"\xff raw\n")
    return d


def test_logs_of_a_local_host_last_lines_then_follow(tmp_path):
    import asyncio

    home = tmp_path / "home"
    d = _job_logs(home)
    transport = LocalTransport(Host(name="here", address="local", env=(("HOME", str(home)),)))
    seen: list[str] = []

    async def shown(*lines: str) -> None:  # the follow's reads are what the steps wait for, not a clock
        async def wait():
            while not set(lines) <= set(seen):
                await asyncio.sleep(0.05)
        await asyncio.wait_for(wait(), 60)

    async def scenario():
        await show_logs(transport, "j1", "here", lines=2, follow=False, emit=seen.append)
        assert seen == ["[daemon] d2", "[daemon] d3", "[worker 0] w0 \xe9", "[worker 0] \ufffd raw"]
        seen.clear()
        stop = asyncio.Event()
        task = asyncio.ensure_future(show_logs(transport, "j1", "here", lines=1, follow=True,
                                               emit=seen.append, interval=0.2, stop=stop))
        await shown("[daemon] d3", "[worker 0] \ufffd raw")  # its first read (the last lines) is done
        with open(d / "daemon.log", "a") as f:
            f.write("d4\nd5 no newline yet")
        (d / "workers" / "1.log").write_text("w1 first\nw1 second\n")
        # The read that showed d4 also got "d5 no newline yet" (one write): held back, unfinished.
        await shown("[daemon] d4", "[worker 1] w1 second")
        with open(d / "daemon.log", "a") as f:
            f.write(" - now\n")
        await shown("[daemon] d5 no newline yet - now")
        await asyncio.sleep(0.5)  # a few more reads (interval 0.2): nothing else is shown
        stop.set()
        await asyncio.wait_for(task, 60)

    asyncio.run(scenario())
    assert seen == ["[daemon] d3", "[worker 0] \ufffd raw", "[daemon] d4", "[worker 1] w1 first",
                    "[worker 1] w1 second", "[daemon] d5 no newline yet - now"]


def test_logs_command_unknown_host_exits_2_naming_the_hosts(tmp_path):
    write_inventory(tmp_path)
    r = eltctl(tmp_path, "logs", "nope")
    assert r.returncode == 2
    assert r.stderr == f"error: no host 'nope' in {tmp_path / 'hosts.toml'}\n  hint: hosts: here\n"


def test_logs_command_prints_the_hosts_logs(tmp_path):
    write_inventory(tmp_path, job="j1")
    home = tmp_path / "home"
    _job_logs(home)
    env = {**cli_env(tmp_path), "HOME": str(home)}
    r = subprocess.run([sys.executable, "-m", "eltctl", "logs", "here", "-n", "1"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[daemon] d3\n[worker 0] \ufffd raw\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, "-m", "eltctl", "logs", "here"], cwd=tmp_path,
                       env={**env, "HOME": str(empty)}, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 1
    assert r.stderr.startswith("error: host here has no logs of job 'j1'")


# ------------------------------------------------------------------------ the mirror line

def _with_mirror(**mirror):
    return {**TRAINING, "mirror": {"target": "/mnt/nfs/ckpt", "step": None, "time": None, "age_s": None,
                                   "lag_steps": None, "last_error": None, **mirror}}


def test_mirror_line_shows_target_step_age_and_lag():
    doc = _with_mirror(step=1175, time=NOW - 40.0, age_s=40.0, lag_steps=25)
    lines = view_text(doc, Source.CONTROLLER, NOW + 0.5).splitlines()
    assert lines[3] == "checkpoint  step 1200, 10 s ago"
    assert lines[4] == "mirror      /mnt/nfs/ckpt: step 1175, 40 s old   25 steps behind"
    assert lines[5].startswith("controller  running (pid 4242)")


def test_mirror_up_to_date_and_its_age_grows_in_a_stale_file():
    doc = _with_mirror(step=1200, time=None, age_s=10.0, lag_steps=0)
    lines = view_text(doc, Source.FILE, NOW + 60.0).splitlines()
    assert lines[4] == "mirror      /mnt/nfs/ckpt: step 1200, 1 min 10 s old   up to date"


def test_mirror_with_nothing_mirrored_and_an_error_says_both():
    doc = _with_mirror(target="ssh://backup:2222/srv/ckpt", lag_steps=1200,
                       last_error="step 1200 from ws1: mkdir: No space left on device")
    lines = view_text(doc, Source.CONTROLLER, NOW).splitlines()
    assert lines[4] == "mirror      ssh://backup:2222/srv/ckpt: nothing mirrored yet   1200 steps behind"
    assert lines[5] == "            last error: step 1200 from ws1: mkdir: No space left on device"


def test_a_mirror_that_cannot_work_is_a_warning_with_its_fix():
    problem = {"kind": "permission", "message": "step 100 from h1: PermissionError: [Errno 13] Permission denied",
               "fix": "log in to every host as the same uid"}
    doc = _with_mirror(lag_steps=100, last_error="step 100 from h1: PermissionError", problem=problem)
    lines = view_text(doc, Source.CONTROLLER, NOW).splitlines()
    assert lines[4] == "mirror      /mnt/nfs/ckpt: nothing mirrored yet   100 steps behind"
    assert lines[5].startswith("warning     the mirror cannot work (permission): checkpoints are on the hosts")
    text = "\n".join(lines)
    assert "Permission denied" in text and "fix: log in to every host as the same uid" in text
    assert "last error" not in text  # said once, in the warning


def test_down_reports_a_mirror_that_cannot_work_and_its_fix():
    from eltctl.commands.down import describe_mirror

    problem = {"kind": "permission", "message": "Permission denied", "fix": "same uid"}
    line = describe_mirror({"target": "/m", "ok": False, "step": None, "problem": problem}, {"step": 300})
    assert "final checkpoint step 300 NOT mirrored to /m; nothing is mirrored" in line
    assert "Permission denied" in line and "same uid" in line
    line = describe_mirror({"target": "/m", "ok": False, "step": None, "problem": problem}, None)
    assert line.startswith("no checkpoint on the mirror /m") and "same uid" in line


def test_no_mirror_no_mirror_line():
    assert "mirror" not in view_text({**TRAINING, "mirror": None}, Source.CONTROLLER, NOW)


# ------------------------------------------------------------------------ the view fits the terminal

def _gpu(i: int, state: str, reason: str) -> dict:
    return {"index": i, "state": state, "reason": reason}


LONG_NAME = "gpu-node-with-a-very-long-name.cluster.example.org"
CRASH_REASON = ("worker on slot 3 crashed: python: can't open file "
                "'/home/alice/.eltctl/jobs/mnist/lab/code/trian.py': [Errno 2] No such file or directory")

# Hosts with 2 to 8 GPUs, the probe's and the daemon's long reasons, long host names.
CROWDED = {
    **TRAINING,
    "hosts": [
        {"name": "ws1", "state": "running", "reason": "", "workers": 2, "heartbeat_age_s": 0.4,
         "gpus": [_gpu(0, "ours", "worker ws1/0/3"),
                  _gpu(1, "ours", "runs this job's pid 4711 python (trainer)")]},
        {"name": "lab-workstation-of-alice", "state": "busy", "reason": "its owner is back", "workers": 1,
         "heartbeat_age_s": 0.7,
         "gpus": [_gpu(0, "busy", "used by pid 999 python (alice); shares it with this job's pid 4712"),
                  _gpu(1, "busy", "used by pid 12345 jupyter-lab (alice), pid 12346 python3 (bob)"),
                  _gpu(2, "ours", "worker lab-workstation-of-alice/2/1"),
                  _gpu(3, "free", "no processes, 3 MiB used, 0% utilisation")]},
        {"name": LONG_NAME, "state": "cooldown", "reason": CRASH_REASON, "workers": 4, "heartbeat_age_s": 1.1,
         "cooldown_until": NOW + 290, "failures": 2,
         "gpus": [_gpu(i, s, r) for i, (s, r) in enumerate([
             ("ours", f"worker {LONG_NAME}/0/7"),
             ("busy", "23000 of 24576 MiB used (threshold 1000 MiB) with no process listed (another container?)"),
             ("busy", "97% utilisation (threshold 10%) with no process listed (another container?)"),
             ("free", "no processes, 0 MiB used, 0% utilisation"),
             ("ours", f"worker {LONG_NAME}/4/7"),
             ("ours", f"worker {LONG_NAME}/5/7"),
             ("unknown", "nvidia-smi did not answer within 10 s"),
             ("ours", f"worker {LONG_NAME}/7/7")])]},
        {"name": "cpu1", "state": "benched", "reason": "daemon failed 3 times", "workers": 0,
         "heartbeat_age_s": None, "benched_until": NOW + 100.0, "gpus": []},
    ],
}


def _hosts_section(text: str) -> list[str]:
    """The rows of the hosts table: the lines after its header's rule, up to a blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "host" in line and "state" in line) + 2
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    return lines[start:end]


@pytest.mark.parametrize("doc", [TRAINING, CROWDED], ids=["training", "crowded"])
def test_at_80_columns_no_gpu_entry_wraps(doc):
    text = view_text(doc, Source.CONTROLLER, NOW + 0.5, width=80)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    header = next(line for line in text.splitlines() if "GPUs" in line and "note" in line)
    gpu_col, note_col = header.index("GPUs"), header.index("note")
    rows = _hosts_section(text)
    # A host's block: its first line names it; the next ones continue its cells.
    starts = [i for i, row in enumerate(rows) if row[:2].strip()]
    assert starts[0] == 0 and len(starts) == len(doc["hosts"]), "\n".join(rows)
    for host, start, end in zip(doc["hosts"], starts, starts[1:] + [len(rows)]):
        assert rows[start].lstrip().startswith(host["name"][:10]), (host["name"], rows[start])
        cells = [row[gpu_col:note_col].strip() for row in rows[start:end]]
        gpus = host["gpus"]
        if not gpus:
            assert cells[0] == "CPU slots" and not any(cells[1:])
            continue
        # Each GPU on exactly one line, in order; no line of the block continues one.
        for gpu, cell in zip(gpus, cells):
            assert cell.startswith(f"GPU {gpu['index']} {gpu['state']}"), (gpu, cell)
        assert not any(cells[len(gpus):]), cells
    assert "full reasons: eltctl status HOST" in text


def test_the_compact_layout_names_who_holds_each_gpu():
    rows = "\n".join(_hosts_section(view_text(CROWDED, Source.CONTROLLER, NOW, width=80)))
    assert "GPU 0 ours w3" in rows and "GPU 1 ours pid 4711" in rows
    assert "GPU 0 busy alice" in rows and "GPU 1 busy alice, b…" in rows  # cut, not wrapped
    assert "GPU 1 busy 23000 MiB" in rows and "GPU 2 busy 97%" in rows and "GPU 3 free" in rows
    assert "its owner is back" in rows
    # The note beside a host's GPUs: its reason folded in those lines, then cut.
    notes = " ".join(" ".join(row[row.index("  ", 40):] if "  " in row[40:] else "" for row in
                              rows.splitlines()).split())
    assert "worker on slot 3 crashed: python: can't open file" in notes


def test_at_160_columns_the_wide_layout_shows_every_full_reason():
    text = view_text(CROWDED, Source.CONTROLLER, NOW + 0.5, width=160)
    assert all(len(line) <= 160 for line in text.splitlines())
    lines = text.splitlines()
    header = next(line for line in lines if "heartbeat" in line and "GPUs" in line)
    gpu_col, note_col = header.index("GPUs"), header.index("note")
    rows = _hosts_section(text)
    # Compared without white space: a long word (a path) is folded inside itself.
    gpu_text = "".join("".join(row[gpu_col:note_col] for row in rows).split())
    note_text = "".join("".join(row[note_col:] for row in rows).split())
    for host in CROWDED["hosts"]:
        for gpu in host["gpus"]:
            assert "".join(f"GPU {gpu['index']} {gpu['state']} {gpu['reason']}".split()) in gpu_text, gpu
    assert "".join(CRASH_REASON.split()) in note_text
    assert "coolingdownuntil14:18:10(in4min49s)" in note_text


@pytest.mark.parametrize("width, wide", [(80, False), (119, False), (120, True), (200, True)])
def test_the_layout_is_chosen_by_the_width(width, wide):
    text = view_text(TRAINING, Source.CONTROLLER, NOW, width=width)
    assert ("heartbeat" in text) is wide and ("full reasons: eltctl status HOST" in text) is not wide


def test_the_layout_can_be_forced():
    assert "heartbeat" in view_text(TRAINING, Source.CONTROLLER, NOW, width=80, layout="wide")
    assert "heartbeat" not in view_text(TRAINING, Source.CONTROLLER, NOW, width=200, layout="compact")


def host_text(doc, name: str, *, width: int = 80, source: Source = Source.CONTROLLER, now: float = NOW) -> str:
    from eltctl.statusview import render_host

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None,
                      highlight=False, force_terminal=False)
    console.print(render_host(Snapshot(doc, source, now), name, ViewOptions(now=now, tz=utc())))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


def test_status_host_shows_every_gpu_with_its_full_reason_and_the_hosts_events():
    doc = copy.deepcopy(CROWDED)
    doc["events"] = TRAINING["events"] + [
        {"time": NOW - 2.0, "kind": "crash", "host": LONG_NAME, "workers": [f"{LONG_NAME}/3/6"],
         "pause_s": None, "detail": CRASH_REASON}]
    text = host_text(doc, LONG_NAME, width=100)
    flat = " ".join(text.split())
    assert f"host {LONG_NAME} cooldown" in flat
    for gpu in CROWDED["hosts"][2]["gpus"]:
        assert f"{gpu['index']} {gpu['state']} {gpu['reason']}" in flat, gpu
    assert "cooling down until 14:18:10 (in 4 min 50 s)" in flat and "2 failure(s) in a row" in flat
    assert "recent events of this host (1 of 1)" in text and "crash" in text
    assert "yield" not in text  # another host's event


def test_status_host_shows_the_daemon_its_workers_and_other_fields():
    doc = copy.deepcopy(TRAINING)
    doc["hosts"][0].update({
        "desired": [0, 1], "last_problem": "worker ws1/1/2 crashed: ModuleNotFoundError: No module named 'tqdm'",
        "daemon": {"pid": 5150, "phase": "running", "health": "ok", "workers": [
            {"slot": 0, "worker_id": "ws1/0/1", "pid": 6001, "state": "running", "since": NOW - 50, "detail": ""},
            {"slot": 1, "worker_id": "ws1/1/2", "pid": 6002, "state": "crashed", "since": NOW - 5,
             "detail": "exit status 1"}]}})
    text = host_text(doc, "ws1", width=120)
    flat = " ".join(text.split())
    assert "daemon (pid 5150, phase running, health ok)" in flat
    assert "1 ws1/1/2 6002 crashed 14:13:15 exit status 1" in flat
    assert "desired slot(s): 0, 1" in flat
    assert "last problem worker ws1/1/2 crashed: ModuleNotFoundError: No module named 'tqdm'" in flat
    assert "recent events of this host (1 of 1)" in text  # the start event names ws1's workers


def test_status_host_of_a_host_missing_from_the_document_says_so():
    text = host_text(WAITING, "ws1", source=Source.FILE, width=100)
    assert "ws1 not in the job's status" in " ".join(text.split())
    assert CONTROLLER_DOWN in text


def test_failed_workers_come_from_worker_states_and_crash_events():
    from eltctl.statusview import failed_workers

    doc = copy.deepcopy(TRAINING)
    doc["hosts"][0]["daemon"] = {"workers": [
        {"slot": 0, "worker_id": "ws1/0/1", "state": "running"},
        {"slot": 1, "worker_id": "ws1/1/2", "state": "lost", "detail": ""}]}
    doc["events"].append({"time": NOW, "kind": "crash", "host": "ws1", "workers": ["ws1/3/1"], "pause_s": None,
                          "detail": "python: can't open file 'trian.py'"})
    assert failed_workers(doc, "ws1") == {1: "ws1/1/2 lost", 3: "ws1/3/1 crashed: python: can't open file 'trian.py'"}
    assert failed_workers(doc, "cpu1") == {0: "cpu1/0/2 crashed: exit status 1"}
    assert failed_workers(doc, "ws3") == {}


@pytest.mark.parametrize("state, reason, brief", [
    ("ours", "worker ws1/0/3", "GPU 0 ours w3"),
    ("ours", "runs this job's pid 4711 python (trainer)", "GPU 0 ours pid 4711"),
    ("ours", "", "GPU 0 ours"),
    ("busy", "used by pid 999 python (alice)", "GPU 0 busy alice"),
    ("busy", "used by pid 1 a (alice), pid 2 b (bob), pid 3 c (alice)", "GPU 0 busy alice, bob"),
    ("busy", "alice (pid 999): 6000 MiB, 90%", "GPU 0 busy alice"),
    ("busy", "23000 of 24576 MiB used (threshold 1000 MiB) with no process listed", "GPU 0 busy 23000 MiB"),
    ("busy", "97% utilisation (threshold 10%) with no process listed", "GPU 0 busy 97%"),
    ("free", "no processes, 3 MiB used, 0% utilisation", "GPU 0 free"),
    ("unknown", "nvidia-smi failed:\nexit 9", "GPU 0 unknown nvidia-smi failed: exit 9"),
])
def test_gpu_brief(state, reason, brief):
    from eltctl.statusview import gpu_brief

    assert gpu_brief({"index": 0, "state": state, "reason": reason}) == brief


@pytest.mark.parametrize("state, reason, brief", [
    ("ours", "worker local-a/0/3", "slot 0 ours w3"), ("free", "CPU slot", "slot 0 free"),
    ("busy", "owner: login alice", "slot 0 busy owner: login alice")])
def test_a_cpu_slot_is_called_a_slot_never_a_bare_number(state, reason, brief):
    from eltctl.statusview import gpu_brief

    assert gpu_brief({"index": 0, "state": state, "reason": reason}, "slot") == brief


def test_a_failed_worker_that_was_replaced_is_not_failed_any_more():
    from eltctl.statusview import failed_workers

    crash = {"time": NOW - 30, "kind": "crash", "host": "ws1", "workers": ["ws1/0/2"], "pause_s": None,
             "detail": "exit status 1"}
    doc = {**TRAINING, "events": [crash]}
    assert failed_workers(doc, "ws1") == {0: "ws1/0/2 crashed: exit status 1"}
    # A later worker of slot 0 joined the job: the slot recovered.
    joined = {"time": NOW - 10, "kind": "join", "generation": 8, "world_size": 4,
              "members": ["ws1/0/3", "ws1/1/1"], "joined": ["ws1/0/3"], "left": [], "lost": []}
    assert failed_workers({**doc, "events": [crash, joined]}, "ws1") == {}
    # Or the daemon runs another worker there now.
    host = {**TRAINING["hosts"][0], "daemon": {"workers": [{"slot": 0, "worker_id": "ws1/0/3", "state": "running"}]}}
    assert failed_workers({**doc, "hosts": [host]}, "ws1") == {}


def test_a_failed_worker_followed_by_one_that_ended_well_is_not_failed():
    """Seen in a newcomer's run: slot 0 failed at start, the fixed job then trained and
    stopped; `logs --failed` must not name the old failure over the new worker's log."""
    from eltctl.statusview import failed_workers

    crash = {"time": NOW - 30, "kind": "crash", "host": "ws1", "workers": ["ws1/0/2"], "pause_s": None,
             "detail": "failed at start"}
    host = {**TRAINING["hosts"][0], "daemon": {"workers": [{"slot": 0, "worker_id": "ws1/0/3", "state": "left"}]}}
    assert failed_workers({**TRAINING, "hosts": [host], "events": [crash]}, "ws1") == {}
    earlier = {**host, "daemon": {"workers": [{"slot": 0, "worker_id": "ws1/0/1", "state": "left"}]}}
    assert failed_workers({**TRAINING, "hosts": [earlier], "events": [crash]}, "ws1") == \
        {0: "ws1/0/2 crashed: failed at start"}


def test_restart_mode_shows_mode_restarts_and_snapshot():
    from eltctl.statusview.events import describe_event

    assert describe_event({"kind": "leave", "mode": "restart", "left": ["a/0/1"], "world_size": 2,
                           "restarts": 3}) == ("a", "left a/0/1; now 2 worker(s); script restarted (restart 3)")
    assert describe_event({"kind": "stop", "mode": "restart", "failed": "the script exited 5 times in 10 min; "
                           "last line: ValueError: x"}) == (
        "", "failed: the script exited 5 times in 10 min; last line: ValueError: x")
    doc = dict(TRAINING, mode="restart", restarts=2, step=11234, snapshot=4, epoch=0,
               checkpoint={"step": 4, "script_step": 11200, "time": NOW - 10.0, "age_s": 10.0})
    text = view_text(doc, Source.CONTROLLER, NOW + 0.5)
    assert "restart mode, 2 restarts" in text
    assert "step 11234   snapshot 4   epoch 0" in text
    assert "snapshot 4 (script step 11200), 10 s ago" in text
    text = view_text(dict(doc, mirror={"target": "/m", "step": 3, "age_s": 5.0, "lag_steps": 1}),
                     Source.CONTROLLER, NOW + 0.5)
    assert "/m: snapshot 3, 5.5 s old   1 snapshots behind" in text
    text = view_text(dict(doc, step=None), Source.CONTROLLER, NOW + 0.5)
    assert "step unknown (set [job] progress or call eltctl_runtime.report)   snapshot 4" in text


# ------------------------------------------------------------------------ forged store values

FORGED = {"controller": {"events": 2, "status": 1}, "hosts": {"ws1": {"daemon/desired": 3}},
          "rank0": {"leave": 1}, "total": 7, "events_skipped": 0}


def test_forged_store_values_show_as_a_warning_line():
    text = view_text(dict(TRAINING, forged=FORGED), Source.CONTROLLER, NOW + 0.5)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("warning"))
    assert lines[at] == ("warning     7 forged store values ignored (controller: events 2, status 1; "
                         "ws1: daemon/desired 3; rank 0: leave 1)")
    assert lines[at + 1].strip() == ("someone who reaches the store's port wrote values not signed with the job's "
                                     "secret; they were ignored, not acted on (docs/commands.md, Security)")
    # none forged: no line, the view as before
    none = dict(FORGED, controller={}, hosts={}, rank0={}, total=0)
    assert view_text(dict(TRAINING, forged=none), Source.CONTROLLER, NOW + 0.5) == view_text(
        TRAINING, Source.CONTROLLER, NOW + 0.5)


def test_status_json_has_the_forged_counts(tmp_path):
    write_inventory(tmp_path)
    (state_dir(tmp_path) / "status.json").write_text(json.dumps(dict(TRAINING, forged=FORGED)))
    r = eltctl(tmp_path, "status", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["forged"] == FORGED


def test_after_a_crash_the_view_shows_where_it_stopped_and_the_last_checkpoint():
    doc = {**WAITING, "runtime_current": False, "step": 10, "members": [],
           "checkpoint": {"step": 5, "time": NOW - 30.0, "age_s": 30.0, "host": "local-a"}}
    lines = view_text(doc, Source.CONTROLLER, NOW + 1).splitlines()
    assert lines[1] == "workers     0 (min 3, max any)   generation 2"
    assert lines[2] == "progress    step 10   epoch 0   (where it stopped; no worker runs now)"
    assert lines[3] == "checkpoint  step 5 on local-a, 31 s ago"


CPU_HOSTS = {**TRAINING, "world_size": 2, "generation": 1, "hosts": [
    {"name": "local-a", "state": "running", "reason": "1 worker(s)", "workers": 1, "device": "cpu",
     "heartbeat_age_s": 0.4, "gpus": [{"index": 0, "state": "ours", "reason": "CPU slot"}]},
    {"name": "local-b", "state": "idle", "reason": "", "workers": 0, "device": "cpu",
     "heartbeat_age_s": 0.4, "gpus": [{"index": 0, "state": "free", "reason": "CPU slot"}]}], "events": []}


@pytest.mark.parametrize("width", [80, 160])
def test_cpu_slots_are_called_slots_not_numbers_under_gpus(width):
    rows = _hosts_section(view_text(CPU_HOSTS, Source.CONTROLLER, NOW, width=width))
    text = view_text(CPU_HOSTS, Source.CONTROLLER, NOW, width=width)
    header = next(line for line in text.splitlines() if "host" in line and "state" in line)
    assert "slots" in header and "GPUs" not in header, header
    assert "slot 0 ours" in rows[0] and "slot 0 free" in rows[1], rows
    assert "CPU slot" not in "\n".join(rows)  # not "slot 0 free CPU slot"


def test_status_host_of_a_cpu_host_lists_its_slots():
    from eltctl.statusview import render_host

    console = Console(width=100, record=True, file=io.StringIO(), color_system=None)
    console.print(render_host(Snapshot(CPU_HOSTS, Source.CONTROLLER, NOW), "local-a", ViewOptions(now=NOW, tz=utc())))
    text = console.export_text()
    assert "CPU slots" in text and "GPUs" not in text, text


def test_the_fair_share_line_says_share_held_wanted_usage_and_priority():
    fair = {"share": 3, "pool": 6, "cap": 3, "release": {}, "to": "bob/bert",
            "reason": "job bert waits: holding 3, fair share 3 of 6", "jobs": [], "user": "alice", "priority": 0,
            "held": 3, "wanted": 2, "usage_gpu_h": 1.2, "min_workers": 1}
    text = view_text({**TRAINING, "fairshare": fair}, Source.CONTROLLER, NOW + 0.5)
    assert ("fair share  3 of 6 GPUs   holding 3, wants 2 more   user alice, recent usage 1.20 GPU-h   priority 0\n"
            "            job bert waits: holding 3, fair share 3 of 6\n") in text
    alone = view_text({**TRAINING, "fairshare": {**fair, "share": None, "reason": ""}}, Source.CONTROLLER, NOW)
    assert "fair share  no other job on its hosts   holding 3, wants 2 more" in alone
    assert "fair share" not in view_text(TRAINING, Source.CONTROLLER, NOW)  # before any demand

"""`eltctl logs HOST --failed` and `--worker SLOT` on a local host (the local transport):
only the logs of the workers that failed, as the job's status says, or of the slots
asked for; and `show_logs` following only those."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from eltctl.hosts.local import LocalTransport
from eltctl.inventory import Host
from eltctl.logs import show_logs
from tests.test_statusview import TIMEOUT, cli_env, state_dir, write_inventory

TRACEBACK = ["Traceback (most recent call last):",
             '  File "/home/u/.eltctl/jobs/j1/here/code/train.py", line 3, in <module>',
             "    import tqdm",
             "ModuleNotFoundError: No module named 'tqdm'"]


def job_logs(home: Path) -> Path:
    """A job directory as the daemon leaves it: worker 0 crashed at start, worker 1
    trains, worker 2 left in the planned way."""
    d = home / ".eltctl" / "jobs" / "j1" / "here"
    (d / "workers").mkdir(parents=True)
    (d / "daemon.log").write_text("daemon started\nworker here/0/3 (pid 11, slot 0) crashed: exit status 1\n")
    (d / "workers" / "0.log").write_text("starting\n" + "\n".join(TRACEBACK) + "\n")
    (d / "workers" / "1.log").write_text("step 1\nstep 2\n")
    (d / "workers" / "2.log").write_text("left at step 9\n")
    return d


def status_doc(**host) -> dict:
    return {"job": "j1", "state": "training", "updated": time.time(),
            "hosts": [{"name": "here", "state": "running", "workers": 1, "gpus": [], **host}],
            "events": [
                {"time": time.time() - 9, "kind": "crash", "host": "here", "workers": ["here/0/3"],
                 "pause_s": None, "detail": "exit status 1: ModuleNotFoundError: No module named 'tqdm'"},
                {"time": time.time() - 5, "kind": "crash", "host": "other", "workers": ["other/1/1"],
                 "pause_s": None, "detail": "exit status 1"}]}


def run(tmp_path: Path, *args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eltctl", "logs", "here", *args], cwd=tmp_path,
                          env={**cli_env(tmp_path), "HOME": str(home)}, capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)


def setup(tmp_path: Path, doc: dict | None) -> Path:
    write_inventory(tmp_path, job="j1")
    home = tmp_path / "home"
    job_logs(home)
    if doc is not None:
        (state_dir(tmp_path, "j1") / "status.json").write_text(json.dumps(doc))
    return home


def test_failed_shows_only_the_crashed_workers_last_lines(tmp_path):
    home = setup(tmp_path, status_doc())
    r = run(tmp_path, "--failed", "-n", "2", home=home)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[worker 0]     import tqdm\n[worker 0] ModuleNotFoundError: No module named 'tqdm'\n"
    assert r.stderr == ("worker 0 failed: here/0/3 crashed: exit status 1: "
                        "ModuleNotFoundError: No module named 'tqdm'\n")


def test_failed_reads_the_daemons_worker_states(tmp_path):
    daemon = {"pid": 10, "workers": [
        {"slot": 1, "worker_id": "here/1/1", "state": "running"},
        {"slot": 2, "worker_id": "here/2/1", "state": "left"},
        {"slot": 3, "worker_id": "here/3/2", "state": "lost", "detail": "adopted; ended unasked"}]}
    home = setup(tmp_path, {**status_doc(daemon=daemon), "events": []})
    (home / ".eltctl/jobs/j1/here/workers/3.log").write_text("a\nb\nc\n")
    r = run(tmp_path, "--failed", "-n", "1", home=home)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[worker 3] c\n"
    assert r.stderr == "worker 3 failed: here/3/2 lost: adopted; ended unasked\n"


def test_failed_with_no_failure_says_so_and_prints_no_log(tmp_path):
    home = setup(tmp_path, {**status_doc(), "events": []})
    r = run(tmp_path, "--failed", home=home)
    assert (r.returncode, r.stdout) == (0, "")
    assert r.stderr.startswith("no worker of job 'j1' on here has failed")


def test_failed_without_a_status_points_to_worker(tmp_path):
    home = setup(tmp_path, None)
    r = run(tmp_path, "--failed", home=home)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.startswith("error: no status of job 'j1' on this machine to tell which workers failed")
    assert "`eltctl logs here --worker SLOT`" in r.stderr


def test_worker_shows_only_those_slots(tmp_path):
    home = setup(tmp_path, None)
    r = run(tmp_path, "--worker", "1", "-w", "2", "-n", "5", home=home)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[worker 1] step 1\n[worker 1] step 2\n[worker 2] left at step 9\n"
    r = run(tmp_path, "--worker", "1", "--worker", "7", "-n", "1", home=home)
    assert (r.returncode, r.stdout) == (0, "[worker 1] step 2\n")
    assert r.stderr == "no log of worker 7 on here (workers/7.log in the job's directory)\n"
    r = run(tmp_path, "--worker", "7", home=home)
    assert (r.returncode, r.stdout) == (1, "")


def test_following_one_worker_shows_only_its_new_lines(tmp_path):
    home = tmp_path / "home"
    d = job_logs(home)
    transport = LocalTransport(Host(name="here", address="local", env=(("HOME", str(home)),)))
    seen: list[str] = []

    async def scenario() -> list[str]:
        stop = asyncio.Event()
        task = asyncio.ensure_future(show_logs(transport, "j1", "here", lines=1, follow=True, emit=seen.append,
                                               interval=0.2, stop=stop, slots=[0]))
        await asyncio.sleep(1.5)
        with open(d / "daemon.log", "a") as f:
            f.write("restarting worker 0\n")
        with open(d / "workers" / "1.log", "a") as f:
            f.write("step 3\n")
        with open(d / "workers" / "0.log", "a") as f:
            f.write("second try\n")
        await asyncio.sleep(1.5)
        stop.set()
        return await asyncio.wait_for(task, 60)

    read = asyncio.run(scenario())
    assert seen == ["[worker 0] ModuleNotFoundError: No module named 'tqdm'", "[worker 0] second try"]
    assert read == ["workers/0.log"]


def run_all(tmp_path: Path, *args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eltctl", "logs", *args], cwd=tmp_path,
                          env={**cli_env(tmp_path), "HOME": str(home)}, capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)


def test_failed_shows_the_failed_workers_own_lines_not_the_healthy_ones_before_it(tmp_path):
    # Slot 0 ran a healthy worker (generation 1) that left, then a new worker that crashed:
    # the daemon recorded where the new one's output began in workers/0.log.
    earlier = "healthy step 1\nhealthy step 2\nleft in the planned way\n"
    daemon = {"pid": 10, "workers": [{"slot": 0, "worker_id": "here/0/4", "state": "crashed",
                                      "detail": "exit status 1", "log_offset": len(earlier)}]}
    home = setup(tmp_path, {**status_doc(daemon=daemon), "events": []})
    (home / ".eltctl/jobs/j1/here/workers/0.log").write_text(earlier + "starting\n" + "\n".join(TRACEBACK) + "\n")
    r = run(tmp_path, "--failed", "-n", "50", home=home)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "".join(f"[worker 0] {ln}\n" for ln in ["starting", *TRACEBACK])
    assert r.stderr == "worker 0 failed: here/0/4 crashed: exit status 1\n"
    r = run(tmp_path, "--failed", "-n", "1", home=home)
    assert r.stdout == f"[worker 0] {TRACEBACK[-1]}\n"


def test_logs_without_a_host_shows_every_host_prefixed_by_its_name(tmp_path):
    (tmp_path / "hosts.toml").write_text('[job]\nname = "j1"\ncommand = "python train.py"\n\n'
                                         '[[hosts]]\nname = "here"\naddress = "local"\n'
                                         '[[hosts]]\nname = "elsewhere"\naddress = "local"\n'
                                         '[[hosts]]\nname = "never"\naddress = "local"\n')
    home = tmp_path / "home"
    job_logs(home)
    other = home / ".eltctl" / "jobs" / "j1" / "elsewhere"
    (other / "workers").mkdir(parents=True)
    (other / "daemon.log").write_text("daemon up\n")
    (other / "workers" / "0.log").write_text("step 7\n")
    r = run_all(tmp_path, "-n", "1", home=home)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("here      [daemon] worker here/0/3 (pid 11, slot 0) crashed: exit status 1\n"
                        "here      [worker 0] ModuleNotFoundError: No module named 'tqdm'\n"
                        "here      [worker 1] step 2\n"
                        "here      [worker 2] left at step 9\n"
                        "elsewhere [daemon] daemon up\n"
                        "elsewhere [worker 0] step 7\n")
    assert r.stderr == "never: no logs of job 'j1' (it has not run there)\n"


def test_logs_controller_shows_the_controllers_log_on_this_machine(tmp_path):
    write_inventory(tmp_path, job="j1")
    (state_dir(tmp_path, "j1") / "controller.log").write_text("one\ntwo\nthree\n")
    r = run_all(tmp_path, "--controller", "-n", "2", home=tmp_path / "home")
    assert (r.returncode, r.stdout, r.stderr) == (0, "[controller] two\n[controller] three\n", "")
    r = run_all(tmp_path, "here", "--controller", home=tmp_path / "home")
    assert r.returncode == 2 and "--controller shows the controller's log alone" in r.stderr

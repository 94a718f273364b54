"""The commands' side of the controller: start it, talk to it, take the job down.

`eltctl up`, `scale`, `cordon`/`uncordon` and `down` call these. Nothing here imports torch (a test
checks): the commands start the controller as a process of its own and talk to it
over control.sock; `down` checks the hosts itself over SSH.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from eltctl.controller import socket as csock
from eltctl.controller.statedir import StateDir
from eltctl_runtime.files import read_json
from eltctl_runtime.pids import pid_alive
from eltctl.errors import EltctlError, UsageError
from eltctl.inventory import Inventory

Progress = Callable[[str], None]
SPAWN_TIMEOUT_S = 90.0  # python + torch import on a busy machine
UP_TIMEOUT_S = 600.0
DOWN_TIMEOUT_S = 600.0


def state_of(inventory: Inventory) -> StateDir:
    return StateDir.for_job(inventory.job.name)


def ping(state: StateDir, timeout: float = 5.0) -> dict | None:
    """The live controller's answer to ping, or None when none answers."""
    if not state.socket.exists():
        return None
    try:
        answer = csock.request(state.socket, {"op": "ping"}, timeout=timeout)
    except (csock.SocketError, OSError, ValueError):
        return None
    return answer if answer.get("ok") else None


def same_inventory(inventory: Inventory, answer: dict | None) -> dict | None:
    """The live controller's ping `answer`, after checking that it runs this inventory.

    Job names are the key on this machine (the state directory) and on the hosts: a
    second inventory with the same job name would otherwise steer, scale or take down
    the first one's job."""
    if answer is None or not answer.get("inventory"):
        return answer
    from pathlib import Path

    theirs = Path(answer["inventory"])
    if theirs.resolve() != Path(inventory.path).resolve():
        raise EltctlError(
            f"job {inventory.job.name!r} is already run on this machine from another inventory, {theirs} "
            f"(controller {answer.get('pid')}); two inventories cannot share a job name",
            hint=f"give this inventory's job another [job] name, or use `eltctl -i {theirs}`")
    return answer


def ask(state: StateDir, message: dict, timeout: float = 60.0) -> dict:
    try:
        return csock.request(state.socket, message, timeout=timeout)
    except csock.SocketError as exc:
        raise EltctlError(f"the controller did not answer: {exc}",
                          hint="`eltctl up` starts (or adopts) the controller") from None


def spawn_controller(inventory: Inventory, state: StateDir, left_out: dict[str, str] | None = None) -> int:
    """Start `python -m eltctl.controller` detached: new session, stdin /dev/null.
    `left_out`: the hosts `up`'s checks left out, with their reasons (eltctl/preflight.py)."""
    state.create()
    extra = [] if left_out is None else ["--left-out", json.dumps(left_out)]
    with open(state.controller_log, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eltctl.controller", "--inventory", str(inventory.path), *extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            close_fds=True)
    return proc.pid


def _log_tail(state: StateDir, n: int = 6) -> str:
    try:
        lines = state.controller_log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def ensure_controller(inventory: Inventory, progress: Progress,
                      left_out: dict[str, str] | None = None) -> tuple[dict, bool]:
    """(ping answer, started now): the live controller, or a new one once it answers."""
    state = state_of(inventory)
    answer = same_inventory(inventory, ping(state))
    if answer is not None:
        return answer, False
    progress("starting the controller")
    pid = spawn_controller(inventory, state, left_out)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while time.monotonic() < deadline:
        answer = same_inventory(inventory, ping(state))
        if answer is not None:
            return answer, answer.get("pid") == pid
        # Our controller may have lost the race for the lock to another `up`'s:
        # then that one answers soon. If ours died for another reason, say why.
        if not pid_alive(pid) and ping(state) is None:
            doc = read_json(state.controller_json) or {}
            if not pid_alive(doc.get("pid")):
                time.sleep(0.5)
                if ping(state) is None and not pid_alive((read_json(state.controller_json) or {}).get("pid")):
                    raise EltctlError("the controller exited at once:\n" + _log_tail(state),
                                      hint=f"see {state.controller_log}")
        time.sleep(0.2)
    raise EltctlError(f"the controller did not answer within {SPAWN_TIMEOUT_S:g} s",
                      hint=f"see {state.controller_log}")


class NotTrainingYet(EltctlError):
    """`up` gave up waiting for the first step; the controller goes on (not a failure of the job)."""


class UpInterrupted(KeyboardInterrupt):
    """Ctrl-C in `up`: what keeps running. `controller_pid` None: nothing was started."""

    def __init__(self, controller_pid: int | None, started: bool) -> None:
        super().__init__()
        self.controller_pid = controller_pid
        self.started = started

    def lines(self, job: str) -> list[str]:
        """What a person needs to know after the Ctrl-C: what runs on, and the next commands."""
        if self.controller_pid is None:
            return ["interrupted: nothing was started"]
        how = "started it and " if self.started else ""
        return [f"interrupted: the controller (pid {self.controller_pid}) keeps running: `up` {how}only stopped "
                f"waiting; job {job} starts (or goes on) by itself",
                "  `eltctl status` follows it; `eltctl down` stops it"]


# `up` waits (with a countdown) for a start due this soon; one due later is a plan: it returns.
UP_COUNTDOWN_S = 60.0


@dataclass(frozen=True)
class UpResult:
    controller_pid: int
    started: bool  # a new controller was started (else a live one was asked to reconcile)
    state: str  # the job's state when `up` returned
    message: str
    status: dict = field(default_factory=dict)


def up(inventory: Inventory, *, detach: bool = False, timeout: float = UP_TIMEOUT_S,
       progress: Progress = lambda _m: None, ignore_mirror_check: bool = False,
       retry_failed: bool = False, link_test: bool = False) -> UpResult:
    """Start what is missing and return when the job trains (or waits for GPUs, or
    starts by itself later: `starts_at`). Ctrl-C raises `UpInterrupted`, which says
    whether a controller runs on. `retry_failed` (a person's `up`, not cron's): the
    hosts held by a failure are tried at once (policy.retried), as every failure's
    hint says. `link_test` (a person's `up`): preflight measures the links between the
    hosts it checks and says when they will set the job's speed (eltctl/linkspeed.py)."""
    from eltctl import preflight

    state = state_of(inventory)
    finished = finished_run(inventory, state)
    if finished is not None:
        return finished
    try:
        # raises when nothing can run (or the mirror cannot work): starts nothing
        left_out = preflight.for_up(inventory, progress, ignore_mirror_check=ignore_mirror_check,
                                    link_test=link_test)
    except KeyboardInterrupt:
        raise UpInterrupted(_live_controller(state), False) from None
    pid: int | None = None
    started = False
    try:
        if retry_failed and same_inventory(inventory, ping(state)) is None:
            _retry_stopped(inventory, state)  # the controller about to start reads it
        answer, started = ensure_controller(inventory, progress, left_out)
        pid = int(answer["pid"])
        return _reconcile_and_wait(inventory, state, answer, started, left_out, detach, timeout, progress,
                                   retry=retry_failed)
    except KeyboardInterrupt:
        if pid is None:  # interrupted while the controller was being started: did it come up?
            pid = _live_controller(state)
            started = pid is not None
        raise UpInterrupted(pid, started) from None


def finished_run(inventory: Inventory, state: StateDir) -> UpResult | None:
    """`up` of a job whose training returned, unchanged since (its code and [job]/[ssh]
    settings, the fingerprint of hosts.json's `finished`), while no controller runs: it
    starts nothing (a new run would restore the last checkpoint and finish at once, and
    a cron entry would repeat that, and its notification, every time). None otherwise:
    a changed job trains on from its last checkpoint; `eltctl down` forgets the end."""
    fin = (read_json(state.hosts_json) or {}).get("finished")
    if not isinstance(fin, dict) or ping(state, timeout=2.0) is not None:
        return None
    from eltctl.controller import act
    from eltctl.controller import policy as pol

    now = pol.fingerprint(inventory, act.code_digest(inventory))
    if not fin.get("code") or fin.get("code") != now["code"] or fin.get("job") != now["job"]:
        return None
    from datetime import datetime

    at = fin.get("at")
    when = f" ({datetime.fromtimestamp(at).strftime('%Y-%m-%d %H:%M')})" if isinstance(at, (int, float)) else ""
    step = fin.get("step")
    message = (f"the job finished{f' at step {step}' if step is not None else ''}{when} and is unchanged since; "
               "nothing was started. To train on, raise its steps (or change its code) and run `eltctl up` "
               "again; to run it again unchanged: `eltctl down`, then `eltctl up`")
    return UpResult(0, False, "finished", message, read_json(state.status_json) or {})


def _live_controller(state: StateDir) -> int | None:
    """The pid of the job's live controller: the one answering, else the lock's holder (one
    still starting up holds it before it answers)."""
    from eltctl.controller.statedir import lock_holder

    live = ping(state, timeout=2.0)
    return int(live["pid"]) if live else lock_holder(state.lock)


def _retry_stopped(inventory: Inventory, state: StateDir) -> None:
    """`up`'s retry of the hosts held by a failure while no controller runs: in hosts.json,
    under the controller's lock (as `_cordon_stopped`); a controller starting meanwhile
    (the lock is held) gets the retry from the reconcile `up` sends it."""
    from eltctl.controller import policy as pol
    from eltctl.controller.statedir import ControllerLock
    from eltctl_runtime.files import write_json_atomic

    doc = read_json(state.hosts_json)
    if not isinstance(doc, dict) or not doc.get("hosts"):
        return
    lock = ControllerLock(state.lock)
    if not lock.acquire():
        return
    try:
        doc = read_json(state.hosts_json) or {}
        records = {}
        for name, d in dict(doc.get("hosts") or {}).items():
            try:
                records[name] = pol.HostRecord.from_json(d)
            except (TypeError, ValueError):
                continue  # the controller warns about it
        after = pol.retried(records, time.time())
        if after != records:
            hosts = dict(doc.get("hosts") or {})
            hosts.update({name: r.to_json() for name, r in after.items() if r != records[name]})
            write_json_atomic(state.hosts_json, {**doc, "hosts": hosts})
    finally:
        lock.release()


def _reconcile_and_wait(inventory: Inventory, state: StateDir, answer: dict, started: bool, left_out: dict,
                        detach: bool, timeout: float, progress: Progress, *, retry: bool = False) -> UpResult:
    from eltctl.controller.status import training_finished
    from eltctl.durations import format_left

    pid = int(answer["pid"])
    if not started:
        progress(f"controller {pid} is running; reconciling")
        result = ask(state, {"op": "reconcile", "left_out": left_out, "retry": retry}, timeout=120)
        if not result.get("ok", False):
            raise EltctlError(f"the controller refused: {result.get('error')}")
    if detach:
        return UpResult(pid, started, answer.get("phase", ""), "detached", {})
    deadline = time.monotonic() + timeout
    last = None
    doc: dict = {}
    problems: dict[str, str] = {}
    shown_left: int | None = None
    while time.monotonic() < deadline:
        try:
            doc = csock.request(state.socket, {"op": "status"}, timeout=30)
        except csock.SocketError:
            if not pid_alive(pid):
                last = read_json(state.status_json) or {}
                if last.get("state") == "finished":  # it tidied up and ended (Controller.finish)
                    return UpResult(pid, started, "finished", str(last.get("message") or "finished"), last)
                raise EltctlError("the controller died:\n" + _log_tail(state),
                                  hint=f"see {state.controller_log}") from None
            time.sleep(0.5)
            continue
        phase, message = doc.get("phase", ""), doc.get("message", "")
        for host in doc.get("hosts") or []:
            problem = str(host.get("last_problem") or "")
            held = host.get("state") in ("cooldown", "benched") or host.get("start_failure")
            if problem and held and problems.get(host.get("name")) != problem:
                problems[host.get("name")] = problem
                progress(f"{host.get('name')}: {_problem_line(host, problem)}")
        left = _starts_in(doc)
        if left is not None and (left > UP_COUNTDOWN_S or left > deadline - time.monotonic()):
            # Starting later by itself is the plan (free slots wait for their idle_for): not a failure.
            return UpResult(pid, started, "waiting", message, doc)
        shown = (phase, message if left is None else "countdown")
        tick = None if left is None else int(left // 10)
        if shown != last or (tick is not None and tick != shown_left):
            last, shown_left = shown, tick
            progress(f"{phase}{': ' + message if message else ''}")
        if doc.get("start_failed"):
            raise start_failed_error(doc["start_failed"])
        if doc.get("failed"):
            raise restart_failed_error(doc)
        if doc.get("state") == "finished":
            return UpResult(pid, started, "finished", message, doc)
        if doc.get("state") == "training" and trains(doc):
            return UpResult(pid, started, "training", training_message(doc), doc)
        if doc.get("state") == "waiting":
            return UpResult(pid, started, "waiting", message or "waiting for free GPUs or CPU slots", doc)
        if doc.get("state") == "paused":  # outside working hours or over a quota: resumes by itself
            return UpResult(pid, started, "paused", message, doc)
        if doc.get("state") == "stopping" and training_finished(doc.get("done")):
            time.sleep(0.5)  # the training returned: the controller stops the daemons, then ends
            continue
        if doc.get("state") in ("stopping", "stopped"):
            raise EltctlError(f"the job is {doc.get('state')} (an `eltctl down` is under way)")
        time.sleep(0.5)
    left = _starts_in(doc)
    if left is not None:  # the timeout ran out while the job only waits for idle_for: the plan, not a failure
        return UpResult(pid, started, "waiting", str(doc.get("message") or f"starts in {format_left(left)}"), doc)
    used = [str(h.get("name")) for h in doc.get("hosts") or [] if h.get("desired") or h.get("workers")]
    logs = " and ".join(f"`eltctl logs {name}`" for name in used[:2]) or "`eltctl logs HOST`"
    raise NotTrainingYet(f"the job is not training after {timeout:g} s (phase {last[0] if last else '?'}); "
                         "the controller goes on",
                         hint=f"`eltctl status` shows why; {logs} the workers' output; `eltctl down` stops it")


def _problem_line(host: dict, problem: str) -> str:
    """A held host's problem as `up` shows it: with when it is usable again and the next command."""
    from eltctl.controller.policy import next_step

    reason = str(host.get("reason") or "")
    if host.get("state") in ("cooldown", "benched") and reason.startswith(problem):
        return reason
    return f"{problem} ({next_step(str(host.get('name')), problem)})"


def _starts_in(doc: dict) -> float | None:
    """Seconds until a starting job starts by itself (status `starts_at`), else None."""
    at, now = doc.get("starts_at"), doc.get("updated")
    if doc.get("state") != "starting" or not isinstance(at, (int, float)) or not isinstance(now, (int, float)):
        return None
    return max(0.0, float(at) - float(now))


def trains(doc: Mapping) -> bool:
    """The job trains: a first step (elastic mode); in restart mode every member's
    script started and still runs after the settle time, or rank 0's reported a
    step (the supervisors' `script.running`: the status `step` is the script's and
    may stand still, or be unknown, while it trains)."""
    if doc.get("mode") == "restart":
        return bool((doc.get("script") or {}).get("running"))
    return (doc.get("step") or 0) >= 1


def training_message(doc: Mapping) -> str:
    step = doc.get("step")
    if doc.get("mode") != "restart":
        return f"training: world size {doc.get('world_size')}, step {step}"
    if step is None:
        return (f"training: world size {doc.get('world_size')} (restart mode; the script's step is not known: "
                "set [job] progress or call eltctl_runtime.report)")
    return f"training: world size {doc.get('world_size')}, step {step} (the script's)"


def restart_failed_error(doc: Mapping) -> EltctlError:
    """`up`'s error when a restart-mode job stopped on its restart limit: the script's
    last line, as for workers that failed at start."""
    from eltctl.controller.status import fix_hint

    failed = str(doc.get("failed"))
    line = failed.split("; last line: ", 1)[1] if "; last line: " in failed else ""
    ran = bool((doc.get("script") or {}).get("ever_running"))
    what = "the job's script failed" + ("" if ran else " at start")
    return EltctlError(f"{what}; the job stopped: {failed}",
                       hint=(fix_hint(line) if line else "`eltctl logs HOST` shows the script's output")
                       + "; then `eltctl down` and `eltctl up` start it again")


def start_failed_error(failed: dict[str, str]) -> EltctlError:
    """`up`'s error when the job's workers failed at start on every host given slots."""
    from eltctl.controller.status import fix_hint

    lines = "\n".join(f"  {host}: {cause}" for host, cause in failed.items())
    first = next(iter(failed.values()), "")
    return EltctlError(f"the job's workers failed at start on every host given slots (none reached a first "
                       f"step):\n{lines}",
                       hint=f"{fix_hint(first)}; then run `eltctl up` again: a fix takes effect at once "
                            "(meanwhile the controller retries after each cooldown; `eltctl logs HOST` shows "
                            "the worker's output)")


def scale(inventory: Inventory, add: list[str], remove: list[str], force: bool) -> dict:
    """`eltctl scale`: ask the live controller. Names not in the inventory file and a
    host both added and removed are usage errors (exit 2) before anything is asked; a
    host in the file that the controller does not know yet makes it re-read the file
    (Controller.scale)."""
    inventory.hosts_named([*add, *remove])
    both = [n for n in dict.fromkeys(add) if n in remove]
    if both:
        raise UsageError(f"{', '.join(both)}: both --add and --remove",
                         hint="name a host once: --add to use it now, --remove to keep it out")
    state = state_of(inventory)
    if same_inventory(inventory, ping(state)) is None:
        raise EltctlError(f"no controller runs job {inventory.job.name}",
                          hint="`eltctl up` starts it; then scale")
    return ask(state, {"op": "scale", "add": add, "remove": remove, "force": force}, timeout=180)


def cordon(inventory: Inventory, hosts: list[str], on: bool) -> dict:
    """`eltctl cordon` (on) / `uncordon`: ask the live controller; with none running,
    write the cordon into hosts.json, where the next controller finds it (cordons
    persist: one need not start the job to keep it off a host)."""
    inventory.hosts_named(hosts)  # unknown names: exit 2, with a did-you-mean
    state = state_of(inventory)
    verb = "cordon" if on else "uncordon"
    if same_inventory(inventory, ping(state)) is None:
        return _cordon_stopped(inventory, state, hosts, on)
    return ask(state, {"op": verb, "hosts": hosts}, timeout=180)


def _cordon_stopped(inventory: Inventory, state: StateDir, hosts: list[str], on: bool) -> dict:
    """The cordon of a job without a controller: its memory (hosts.json) changed under
    the controller's lock, so a controller starting meanwhile reads it whole."""
    from eltctl.controller.policy import HostRecord
    from eltctl.controller.statedir import ControllerLock
    from eltctl_runtime.files import write_json_atomic

    verb = "cordon" if on else "uncordon"
    state.create()
    lock = ControllerLock(state.lock)
    if not lock.acquire():
        raise EltctlError(f"a controller of job {inventory.job.name} is starting",
                          hint=f"run `eltctl {verb}` again in a moment")
    try:
        doc = read_json(state.hosts_json) or {}
        memory = dict(doc.get("hosts") or {})
        results = []
        for name in hosts:  # all in the inventory (`cordon` checked them)
            rec = HostRecord.from_json(memory.get(name) or {})
            if rec.cordoned == on:
                results.append({"host": name, "ok": True, "message": "already cordoned" if on else "not cordoned"})
                continue
            memory[name] = {**rec.to_json(), "cordoned": on}
            results.append({"host": name, "ok": True, "message": (
                "cordoned (no controller runs: the next `eltctl up` keeps it out until `eltctl uncordon`)" if on
                else "uncordoned (no controller runs: the next `eltctl up` uses it again)")})
        if any(r["ok"] for r in results):
            write_json_atomic(state.hosts_json, {**doc, "hosts": memory})
    finally:
        lock.release()
    return {"ok": all(r["ok"] for r in results), "results": results}


# --------------------------------------------------------------------------- down

@dataclass(frozen=True)
class DownResult:
    ok: bool
    message: str
    checkpoint: dict | None
    left: dict[str, list[tuple[int, str]]]  # host -> (pid, command) still running
    unchecked: dict[str, str]  # host -> why it could not be checked
    killed: dict[str, list[int]]
    # {"ok", "target", "step", "last_error", ...}: the final checkpoint's copy on
    # `[storage] mirror` (MirrorWorker.status() plus ok); None without a mirror
    mirror: dict | None = None


def down(inventory: Inventory, *, force: bool = False, progress: Progress = lambda _m: None) -> DownResult:
    """Take the job down through its controller (or a one-shot one), then check every host."""
    state = state_of(inventory)
    answer = same_inventory(inventory, ping(state))
    result: dict = {}
    if answer is not None:
        progress(f"asking controller {answer['pid']} for a final checkpoint and a stop")
        result = ask(state, {"op": "down", "force": force}, timeout=DOWN_TIMEOUT_S)
        deadline = time.monotonic() + 30
        while pid_alive(int(answer["pid"])) and time.monotonic() < deadline:
            time.sleep(0.1)
    else:
        progress("no controller is running: taking the job down directly")
        state.create()
        cmd = [sys.executable, "-m", "eltctl.controller", "--inventory", str(inventory.path), "--down"]
        if force:
            cmd.append("--force")
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=DOWN_TIMEOUT_S)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if lines:
            result = json.loads(lines[-1])
        elif done.returncode == 3 and ping(state) is not None:
            return down(inventory, force=force, progress=progress)  # a controller appeared meanwhile
        else:
            result = {"ok": False, "message": (done.stderr.strip() or "the one-shot controller failed")[-500:]}
    progress("checking every host for processes of the job")
    left, unchecked, killed = asyncio.run(_verify(inventory, force))
    ok = not any(left.values()) and not unchecked
    return DownResult(ok=ok, message=str(result.get("message", "")), checkpoint=result.get("checkpoint"),
                      left={h: v for h, v in left.items() if v}, unchecked=unchecked,
                      killed={h: v for h, v in killed.items() if v},
                      mirror=result.get("mirror") if isinstance(result.get("mirror"), dict) else None)


async def _verify(inventory: Inventory, force: bool):
    from eltctl.controller.statedir import control_id
    from eltctl.hosts import ops as hostops
    from eltctl.hosts.fleet import Fleet

    me = control_id()

    async def one(host, t):
        procs = await hostops.job_processes(t, inventory.job.name, me)
        killed: list[int] = []
        if procs and force:
            killed = [p.pid for p in procs]
            await hostops.kill_pids(t, killed, "KILL")
            await asyncio.sleep(0.5)
            procs = await hostops.job_processes(t, inventory.job.name, me)
        return [(p.pid, p.command) for p in procs], killed

    async with Fleet(inventory) as fleet:
        outcomes = await fleet.each(None, one, timeout=inventory.ssh.connect_timeout + 60)
    left, unchecked, killed = {}, {}, {}
    for name, o in outcomes.items():
        if o.error is not None:
            if inventory.host(name).schedule.enabled:  # a disabled host may well be off
                unchecked[name] = o.error.message
        else:
            left[name], killed[name] = o.value
    return left, unchecked, killed


def controller_pid(inventory: Inventory) -> int | None:
    answer = ping(state_of(inventory))
    return int(answer["pid"]) if answer else None

"""The demo's scenario: `eltctl up`, the owner comes and goes, `eltctl down`, with a live view."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from eltctl.demo.owner import Owner
from eltctl.demo.pids import PidWatch, worker_pid
from eltctl.demo.runner import EltctlRunner, sweep
from eltctl.demo.setup import DemoError, DemoPlan, DemoSetup, prepare
from eltctl.demo.summary import DemoSummary, has_yielded, is_training, summarize
from eltctl.hosts import layout


def torch_missing_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return ("eltctl demo runs the real controller and workers, which need PyTorch on this "
                "machine, and torch is not installed for " + sys.executable)
    return None


@dataclass
class Narrator:
    """The demo's running commentary: lines with the time since the start."""

    started: float
    emit_plain: Callable[[str], None] | None = None  # prints each line at once (no live view)
    lines: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        line = f"[{time.time() - self.started:5.1f} s] {text}"
        self.lines.append(line)
        if self.emit_plain is not None:
            self.emit_plain(line)


class Scenario:
    """One run of the demo: the steps in order, each waiting on the live status."""

    def __init__(self, setup: DemoSetup, plan: DemoPlan, console, *, live: bool,
                 python: str = sys.executable) -> None:
        self.setup = setup
        self.plan = plan
        self.console = console
        self.live_view = live
        self.runner = EltctlRunner(setup, python=python)
        self.started = time.time()
        self.narrator = Narrator(self.started, None if live else self._plain)
        self.last_doc: dict[str, Any] = {}
        self.first_loss: float | None = None
        self._live = None
        self._up: subprocess.Popen | None = None

    def _plain(self, line: str) -> None:
        from rich.markup import escape

        self.console.print(escape(line), highlight=False)

    # -- observing ------------------------------------------------------------

    def snapshot(self):
        from eltctl.statusview import NoJobError, job_state_dir, read_snapshot

        state_dir = job_state_dir(self.setup.job, self.setup.environ())
        try:
            snap = read_snapshot(self.setup.job, state_dir, timeout=2.0)
        except NoJobError:
            return None
        self.last_doc = dict(snap.document)
        if self.first_loss is None and isinstance(self.last_doc.get("loss"), (int, float)):
            self.first_loss = float(self.last_doc["loss"])
        return snap

    def _render(self, snap):
        from rich.markup import escape

        from eltctl.statusview import ViewOptions, render_status

        title = "[bold]eltctl demo[/]: 3 hosts on this machine, simulated GPUs, the example training"
        story = tuple(escape(line) for line in self.narrator.lines[-6:])
        if snap is None:
            return "\n".join([title, *story, "[dim]waiting for the controller's first status...[/]"])
        return render_status(snap, ViewOptions(now=time.time(), title=title, extra=story + ("",)))

    def wait_for(self, what: str, done: Callable[[Mapping[str, Any]], bool], *,
                 timeout: float | None = None, also: Callable[[], None] | None = None) -> Mapping[str, Any]:
        """Refresh the view about every 0.5 s until `done(status document)`."""
        deadline = time.monotonic() + (timeout or self.plan.wait_s)
        while True:
            snap = self.snapshot()
            if self._live is not None:
                self._live.update(self._render(snap), refresh=True)
            if snap is not None and done(snap.document):
                return snap.document
            if also is not None:
                also()
            if time.monotonic() > deadline:
                state = self.last_doc.get("state", "no status")
                raise DemoError(f"the demo waited {timeout or self.plan.wait_s:.0f} s for {what}; "
                                f"the job is {state} at world size {self.last_doc.get('world_size')}",
                                hint=f"logs: {self.setup.state_home / 'eltctl' / self.setup.job} and "
                                     f"{layout.job_root_in(self.setup.home, self.setup.job)}")
            time.sleep(0.5)

    def _check_up(self) -> None:
        if self._up is not None and self._up.poll() not in (None, 0):
            log = (self.setup.root / "up.log").read_text(errors="replace")[-2000:]
            raise DemoError(f"`eltctl up` failed (exit {self._up.returncode}):\n{log}")

    # -- the story --------------------------------------------------------------

    def run(self) -> DemoSummary:
        from rich.live import Live

        if self.live_view:
            with Live(self._render(None), console=self.console, auto_refresh=False,
                      transient=False, redirect_stdout=False) as live:
                self._live = live
                try:
                    return self._story()
                finally:
                    self._live = None
        return self._story()

    def _story(self) -> DemoSummary:
        plan, setup = self.plan, self.setup
        full = plan.gpu_count
        say = self.narrator.say
        say(f"eltctl up: {len(plan.hosts)} hosts, {full} simulated GPUs, CPU workers")
        self._up = self.runner.start("up", log_name="up.log")
        doc = self.wait_for(f"the job to train on {full} workers",
                            lambda d: is_training(d, full), also=self._check_up)
        say(f"training on {full} workers (generation {doc.get('generation')})")
        target = (doc.get("step") or 0) + plan.steps_before_owner
        self.wait_for(f"step {target}", lambda d: is_training(d, full, min_step=target))

        victim = worker_pid(setup, plan.owner_host, plan.owner_gpu)
        watch = PidWatch(victim, plan.wait_s).start() if victim is not None else None
        owner = Owner(setup, plan.owner_host, plan.owner_gpu)
        pid = owner.arrive()
        arrived = owner.registered_at or time.time()
        say(f"the owner of {plan.owner_host} starts a process on GPU {plan.owner_gpu} (pid {pid})")
        doc = self.wait_for("the job to yield the owner's GPU and go on",
                            lambda d: has_yielded(d, plan.owner_host, arrived)
                            and is_training(d, full - 1) and (watch is None or watch.done()))
        yield_latency = None
        if watch is not None and watch.exited_at is not None:
            yield_latency = watch.exited_at - arrived
            say(f"our worker on {plan.owner_host} GPU {plan.owner_gpu} (pid {victim}) left "
                f"{yield_latency:.2f} s after the owner's process appeared")
        step_at_yield = doc.get("step") or 0
        self.wait_for("training to go on without that GPU",
                      lambda d: is_training(d, full - 1, min_step=step_at_yield + 3))
        say(f"the job goes on at {full - 1} workers; the owner keeps the GPU {plan.owner_stays_s:g} s")
        until = time.monotonic() + plan.owner_stays_s
        self.wait_for("the owner", lambda d: time.monotonic() >= until)

        owner.leave()
        left = time.time()
        say(f"the owner's process ends; after idle_for {plan.idle_for} and cooldown "
            f"{plan.cooldown} the GPU is used again")
        doc = self.wait_for(f"GPU {plan.owner_gpu} of {plan.owner_host} to be used again",
                            lambda d: is_training(d, full))
        rejoin_after = time.time() - left
        say(f"GPU {plan.owner_gpu} of {plan.owner_host} is used again: {full} workers, "
            f"{rejoin_after:.1f} s after the owner left")
        target = (doc.get("step") or 0) + plan.steps_after_rejoin
        self.wait_for(f"step {target}", lambda d: is_training(d, full, min_step=target))
        final = dict(self.last_doc)

        say("eltctl down: final checkpoint, every process stops")
        if self._live is not None:
            self._live.update(self._render(self.snapshot()), refresh=True)
        down = self.runner.run("down", timeout=plan.wait_s)
        message = (down.stdout.strip().splitlines() or [""])[-1]
        if down.returncode != 0:
            raise DemoError(f"`eltctl down` failed (exit {down.returncode}): "
                            f"{(down.stderr or down.stdout).strip()[-1500:]}")
        return summarize(setup.job, final, started=self.started, first_loss=self.first_loss,
                         yield_latency_s=yield_latency, rejoin_after_s=rejoin_after,
                         duration_s=time.time() - self.started, down_message=message)

    def close(self, *, force_down: bool) -> None:
        """Reap `eltctl up`; after a failure or Ctrl-C, `down --force` if a controller may run."""
        if self._up is not None:
            if self._up.poll() is None:
                self._up.kill()
            self._up.wait()
        if force_down and (self.setup.state_home / "eltctl" / self.setup.job).exists():
            try:
                self.runner.run("down", "--force", timeout=60)
            except subprocess.TimeoutExpired:
                pass


def run_demo(plan: DemoPlan, console, *, keep: bool = False, live: bool | None = None,
             root: Path | None = None) -> DemoSummary:
    """The whole demo; everything it started is ended and its directory removed, whatever happens."""
    reason = torch_missing_reason()
    if reason:
        raise DemoError(reason, hint="bash scripts/demo.sh sets up .venv with torch and runs the demo")
    made = root is None
    root = Path(tempfile.mkdtemp(prefix="eltctl-demo-")) if root is None else Path(root)
    live = console.is_terminal if live is None else live
    scenario: Scenario | None = None
    outcome = "failed"
    try:
        setup = prepare(root, plan)
        scenario = Scenario(setup, plan, console, live=live)
        summary = scenario.run()
        outcome = "ok"
        return summary
    except KeyboardInterrupt:
        outcome = "interrupted"
        raise
    finally:
        # A second Ctrl-C must not leave processes behind: cleaning up is not interruptible.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if _in_main_thread() else None
        try:
            if scenario is not None:
                scenario.close(force_down=outcome != "ok")
            sweep(root)
            # A failed demo keeps its files: the controller's and hosts' logs say why.
            if keep or (outcome == "failed" and made):
                console.print(f"demo files kept in {root}", highlight=False)
            elif made:
                shutil.rmtree(root, ignore_errors=True)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()

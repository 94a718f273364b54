"""A host's daemon starts with the slots the controller decided on (GPUs or CPU slots),
never with what a later probe happens to say: a daemon keeps its slots for life, and a
GPU host whose daemon started as a CPU host refused every GPU but "CPU slot 0" (a CI
run: h3 was started so after a probe of it failed under load; world size 5, not 6).

The controller's real reconcile pass and `DaemonStarter` run here over an in-memory
store; only the host operations the starter calls over SSH are stand-ins, and the
one that ships the runtime is held open while the test changes the probe's report,
so the race is the same every run."""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from eltctl.controller import policy as pol
from eltctl.controller.loop import Controller
from eltctl.controller.statedir import StateDir
from eltctl.hosts import ops as hostops
from eltctl.hosts.layout import HostPaths
from eltctl.inventory import parse_inventory
from eltctl.probe import Gpu, GpuReport, GpuUse, HostReport, HostState
from eltctl_runtime.daemon.config import DaemonConfig

NOW = 50_000.0


def inventory(tmp_path, device="cpu", host_keys=""):
    return parse_inventory(textwrap.dedent(f"""
        [job]
        name = "j"
        command = "python t.py"
        device = "{device}"
        shared_filesystem = true
        [policy]
        idle_for = 0
        [[hosts]]
        name = "h3"
        address = "h3.lab"
        """) + host_keys, tmp_path / "hosts.toml")


def ok(*indices):
    gpus = tuple(GpuReport(Gpu(i, f"GPU-{i}", "sim", 0, 15000, 0), GpuUse.FREE, "") for i in indices)
    return HostReport(name="h3", address="h3.lab", state=HostState.OK, reason=f"{len(gpus)} free", gpus=gpus)


def failed(reason="the probe did not complete: timed out after 30 s"):
    return HostReport(name="h3", address="h3.lab", state=HostState.UNHEALTHY, reason=reason)


CPU_ONLY = HostReport(name="h3", address="h3.lab", state=HostState.CPU_ONLY, slots=2,
                      reason="no nvidia-smi on PATH: CPU-only host, 2 slot(s)")


class Store:
    """The job's store, in memory (what the controller's pass reads and writes)."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.events: list[dict] = []

    async def get_raw(self, key):
        return self.values.get(key)

    async def get_json(self, key):
        raw = self.values.get(key)
        return None if raw is None else json.loads(raw)

    async def set_json(self, key, value):
        self.values[key] = json.dumps(value).encode()

    async def set_raw(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    async def event(self, ev):
        self.events.append(ev)


class Fleet:
    async def transport(self, host):
        return host  # the stand-in host operations below need no connection

    async def forget(self, name):
        pass


class Host:
    """Stand-ins for the SSH operations of a daemon start; `shipping` holds the start
    where it ships the runtime (after the decision, before daemon.json is written)."""

    def __init__(self, monkeypatch, home):
        self.shipping = asyncio.Event()
        self.configs: list[dict] = []

        async def host_paths(t, job):
            return HostPaths(home=str(home), job=job, host=t.name)

        async def daemon_pid(t, paths):
            return None

        async def ensure_runtime(t, paths, files=None):
            await self.shipping.wait()
            return "/rt", False

        async def start_daemon(t, paths, runtime_dir, config, owner=None, secret=None, bind_from_ssh=False):
            self.configs.append(config)
            return 4242

        monkeypatch.setattr(hostops, "host_paths", host_paths)
        monkeypatch.setattr(hostops, "daemon_pid", daemon_pid)
        monkeypatch.setattr(hostops, "ensure_runtime", ensure_runtime)
        monkeypatch.setattr(hostops, "start_daemon", start_daemon)
        monkeypatch.setattr(hostops, "runtime_files", dict)


def controller(tmp_path, inv) -> tuple[Controller, Store]:
    state = StateDir(tmp_path / "state")
    state.path.mkdir()
    store = Store()
    ctl = Controller(inv, state, store, Fleet(), "127.0.0.1:1", clock=lambda: NOW)  # type: ignore[arg-type]
    ctl._check_fix = False  # the fingerprint and code digest are not the point here
    ctl._last_probe = NOW  # no probe of its own: the test hands it the reports
    ctl._probed_once.set()
    ctl.restorer.restored = True  # nothing to restore
    return ctl, store


async def start_pass(ctl: Controller) -> asyncio.Task | None:
    """One reconcile pass; the daemon start it began (None: none)."""
    await ctl.reconcile()
    return ctl.starter.tasks.get("h3")


def daemon_would_accept(config: dict) -> frozenset[int] | None:
    """The slots the daemon started with this daemon.json takes (runtime/daemon/config.py)."""
    return DaemonConfig.from_json(json.dumps(config)).valid_slots


@pytest.mark.parametrize("device, daemon_device", [("cpu", "cpu"), ("auto", "cuda")])
def test_a_probe_that_fails_after_the_decision_does_not_make_a_gpu_host_a_cpu_host(
        tmp_path, monkeypatch, device, daemon_device):
    """The CI failure, made deterministic: the decision to start h3's daemon is made on a
    probe that lists its 2 GPUs; the next probe (a slow nvidia-smi under load) fails
    while the runtime is being shipped. The daemon still gets both GPUs."""
    ctl, store = controller(tmp_path, inventory(tmp_path, device))
    host = Host(monkeypatch, tmp_path / "home")

    async def scenario():
        ctl.observed.take_reports([ok(0, 1)])
        starting = await start_pass(ctl)
        assert starting is not None and ctl.records["h3"].desired == (0, 1)
        ctl.observed.take_reports([failed()])  # the background probe lands meanwhile
        host.shipping.set()
        await starting

    asyncio.run(scenario())
    [config] = host.configs
    assert config["gpus"] == [0, 1] and config["device"] == daemon_device
    assert daemon_would_accept(config) == {0, 1}


def test_a_gpu_host_no_probe_has_told_of_waits_and_starts_with_its_gpus_once_one_does(tmp_path, monkeypatch, caplog):
    """A host that keeps its slots (a controller restarted: hosts.json asks GPUs 0 and 1
    of it) but whose daemon is gone, probed only while nvidia-smi hangs: nothing says
    whether it has GPUs, so no daemon starts (one log line says why); the first probe
    that lists them starts it with them."""
    ctl, store = controller(tmp_path, inventory(tmp_path))
    ctl.records["h3"] = pol.HostRecord(desired=(0, 1), seq=1)
    host = Host(monkeypatch, tmp_path / "home")
    host.shipping.set()

    async def scenario():
        ctl.observed.take_reports([failed("nvidia-smi did not answer in 10 s (driver wedged?)")])
        assert await start_pass(ctl) is None
        assert await start_pass(ctl) is None
        ctl.observed.take_reports([ok(0, 1)])
        starting = await start_pass(ctl)
        assert starting is not None
        await starting

    with caplog.at_level("WARNING", logger="eltctl.controller"):
        asyncio.run(scenario())
    waits = [r.getMessage() for r in caplog.records if "not started yet" in r.getMessage()]
    assert len(waits) == 1 and "nvidia-smi did not answer" in waits[0], waits
    [config] = host.configs
    assert config["gpus"] == [0, 1] and daemon_would_accept(config) == {0, 1}


def test_a_cpu_only_host_whose_probe_timed_out_starts_with_its_cpu_slots(tmp_path, monkeypatch):
    ctl, store = controller(tmp_path, inventory(tmp_path, "auto", "slots = 2\n"))
    host = Host(monkeypatch, tmp_path / "home")

    async def scenario():
        ctl.observed.take_reports([CPU_ONLY])
        starting = await start_pass(ctl)
        assert starting is not None and ctl.records["h3"].desired == (0, 1)
        ctl.observed.take_reports([failed()])
        host.shipping.set()
        await starting

    asyncio.run(scenario())
    [config] = host.configs
    assert config["gpus"] is None and config["device"] == "cpu" and daemon_would_accept(config) == {0, 1}


def test_the_inventorys_gpus_need_no_probe_that_tells(tmp_path, monkeypatch):
    ctl, store = controller(tmp_path, inventory(tmp_path, "auto", "gpus = [1]\n"))
    ctl.records["h3"] = pol.HostRecord(desired=(1,), seq=1)
    host = Host(monkeypatch, tmp_path / "home")
    host.shipping.set()

    async def scenario():
        ctl.observed.take_reports([failed()])
        starting = await start_pass(ctl)
        assert starting is not None
        await starting

    asyncio.run(scenario())
    [config] = host.configs
    assert config["gpus"] == [1] and config["device"] == "cuda"


# ---------------------------------------------------------------- a daemon of the wrong kind


def daemon_state(store: Store, n: int, *, kind="cpu", valid=(0,), workers=(), phase="running"):
    """h3's daemon writes its state (the n-th time: each write is news)."""
    from eltctl_runtime.protocol import state_key

    doc = {"time": 1000.0 + n, "phase": phase, "seq_applied": n, "health": "ok", "gpus": [],
           "slot_kind": kind, "valid_slots": list(valid),
           "workers": [{"slot": s, "worker_id": f"h3/{s}/{n}", "pid": 100 + s, "state": "running"}
                       for s in workers]}
    store.values[state_key("h3")] = json.dumps(doc).encode()


def test_a_daemon_running_cpu_slots_on_a_gpu_host_is_replaced_once_its_worker_left(tmp_path, monkeypatch, caplog):
    """Defence in depth: h3's daemon runs one CPU slot (started so by an older controller,
    or before the fix) with a worker on it, while h3's probe lists 2 GPUs. The controller
    withdraws h3's slots (the worker leaves in the planned way), asks the idle daemon to
    exit, and once it has, starts one with both GPUs; it says why once."""
    from eltctl_runtime.protocol import desired_key

    ctl, store = controller(tmp_path, inventory(tmp_path))
    host = Host(monkeypatch, tmp_path / "home")
    host.shipping.set()
    ctl.records["h3"] = pol.HostRecord(desired=(0, 1), seq=1)

    async def restore(names, others):  # h3 was the job's last host: a real restore runs here
        pass

    ctl._restore = restore

    def desired():
        return json.loads(store.values[desired_key("h3")])

    async def scenario():
        ctl.observed.take_reports([ok(0, 1)])
        daemon_state(store, 1, workers=(0,))
        await ctl.reconcile()
        assert "CPU slots [0] but the host has GPUs [0, 1]" in ctl.replacing["h3"]
        assert desired()["slots"] == [] and not desired()["stop"]  # its worker leaves first
        daemon_state(store, 2, workers=(0,))
        await ctl.reconcile()
        assert not desired()["stop"] and "h3" not in ctl.starter.tasks
        daemon_state(store, 3)  # the worker has left
        await ctl.reconcile()
        assert desired()["stop"] and "h3" in ctl.starter.retired
        daemon_state(store, 4, phase="stopped")  # its last word
        await ctl.reconcile()  # no worker anywhere now: the newest checkpoint is restored first
        await asyncio.sleep(0)
        await ctl.reconcile()
        assert "h3" not in ctl.replacing and "h3" in ctl.starter.tasks
        # no slots are written while the old daemon may still run: they are asked of the new one
        assert desired()["slots"] == [] and desired()["stop"]
        await ctl.starter.tasks["h3"]
        await ctl.reconcile()
        assert desired()["slots"] == [0, 1] and not desired()["stop"]

    with caplog.at_level("WARNING", logger="eltctl.controller"):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if "is replaced" in r.getMessage()]
    assert len(said) == 1 and "once its workers have left" in said[0], said
    [config] = host.configs
    assert config["gpus"] == [0, 1] and daemon_would_accept(config) == {0, 1}


@pytest.mark.parametrize("state, report", [
    (dict(kind="gpu", valid=(0, 1)), ok(0, 1)),  # right
    (dict(kind="cpu", valid=(0,)), failed()),  # the latest probe cannot tell: not judged
    (dict(kind="gpu", valid=(0, 1, 2)), ok(0, 1)),  # a GPU gone from the probe: it has what is asked
])
def test_a_daemon_with_the_right_slots_or_none_to_judge_by_is_left_alone(tmp_path, monkeypatch, state, report):
    ctl, store = controller(tmp_path, inventory(tmp_path))
    Host(monkeypatch, tmp_path / "home")
    ctl.records["h3"] = pol.HostRecord(desired=(0, 1), seq=1)

    async def scenario():
        ctl.observed.take_reports([ok(0, 1), report])
        daemon_state(store, 1, workers=(0, 1), **state)
        await ctl.reconcile()

    asyncio.run(scenario())
    assert not ctl.replacing and ctl.records["h3"].desired == (0, 1) and not ctl.starter.retired


def test_a_fix_while_a_daemon_start_ships_drops_that_start_and_the_next_start_ships_the_fix(
        tmp_path, monkeypatch, caplog):
    """A CI failure: `up` after a code fix came while h2's daemon start (of the `up`
    before) was still shipping; that start went on and launched a daemon with the old
    code, whose workers failed with the old cause and sent h2 to cooldown. A start in
    flight when the job's code or configuration changes launches no daemon; the next
    pass starts one (with what is there now)."""
    inv = inventory(tmp_path)
    ctl, store = controller(tmp_path, inv)
    ctl.fingerprint = pol.fingerprint(inv, "the code before the fix")
    host = Host(monkeypatch, tmp_path / "home")

    async def scenario():
        ctl.observed.take_reports([ok(0, 1)])
        starting = await start_pass(ctl)
        assert starting is not None
        assert await ctl.apply_fixes(NOW) == ["h3"]  # the code changed while it ships
        host.shipping.set()
        await starting
        assert host.configs == []  # nothing launched with what it shipped
        again = await start_pass(ctl)
        assert again is not None
        await again

    with caplog.at_level("INFO", logger="eltctl.controller"):
        asyncio.run(scenario())
    assert len(host.configs) == 1
    assert any("start in flight is dropped" in r.getMessage() for r in caplog.records)


# ------------------------------------------- a daemon from before a fix, heard from after it


def crash_event(store: Store, n: int, config: str, cause="ModuleNotFoundError: No module named 'x'"):
    """h3's daemon logs its workers' crash at start (the n-th event of the log)."""
    from eltctl_runtime.protocol import Keys, event_document

    ev = event_document("crash", host="h3", workers=["h3/0/7"], detail=f"failed at start: {cause}",
                        cause=cause, at_start=True, exit_code=1, config=config)
    store.values[Keys.event(n)] = json.dumps(ev).encode()


def stated(store: Store, n: int, config: str, phase="running", crashed=()):
    from eltctl_runtime.protocol import state_key

    store.values[state_key("h3")] = json.dumps({
        "time": 1000.0 + n, "phase": phase, "seq_applied": n, "health": "ok", "gpus": [], "slot_kind": "cpu",
        "valid_slots": [0, 1], "config": config,
        "workers": [{"slot": s, "worker_id": f"h3/{s}/7", "pid": 100 + s, "state": "crashed"} for s in crashed]}).encode()


def test_a_daemon_launched_before_a_fix_and_heard_from_after_it_is_replaced_and_its_crash_counts_nothing(
        tmp_path, monkeypatch, caplog):
    """A CI failure: h1's daemon was launched with the code of the `up` before (a script
    that fails at import) and had not reported when the fixed code's `up` came, so the fix
    did not retire it; it then started workers with the old code, they failed, and h1 went
    to its 600 s cooldown with the old cause. Now: the fix asks that daemon to exit before
    it has said a word, no slot is asked of it, the crash of its workers (its events carry
    the digest it was started with) counts no failure, and the daemon started next ships
    the fix with the new digest."""
    inv = inventory(tmp_path)
    ctl, store = controller(tmp_path, inv)
    clock = [NOW]
    ctl.clock = ctl.starter.clock = lambda: clock[0]
    ctl.fingerprint = pol.fingerprint(inv, "the code before the fix")
    before = ctl.host_config("h3")
    host = Host(monkeypatch, tmp_path / "home")
    host.shipping.set()
    from eltctl_runtime.protocol import desired_key

    def desired():
        return json.loads(store.values[desired_key("h3")])

    async def scenario():
        ctl.observed.take_reports([CPU_ONLY])
        await (await start_pass(ctl))
        assert [c["config"] for c in host.configs] == [before] and before
        assert "h3" in ctl.starter.started_at  # launched; not heard from yet
        clock[0] += 1
        assert await ctl.apply_fixes(clock[0]) == ["h3"]
        after = ctl.host_config("h3")
        assert after and after != before
        assert desired()["stop"] and "h3" in ctl.starter.retired  # asked to exit before a word of it
        # it reports late, with the old digest, and its workers' crash at start comes in
        stated(store, 2, before, crashed=(0,))
        crash_event(store, 1, before)
        clock[0] += 1
        await ctl.reconcile()
        rec = ctl.records["h3"]
        assert rec.failures == 0 and rec.cooldown_until == 0 and not rec.start_failure, rec
        assert desired()["stop"]  # nothing asked of the old daemon
        stated(store, 3, before, phase="stopped")  # its last word
        clock[0] += 1
        await ctl.reconcile()
        await ctl.starter.tasks["h3"]
        clock[0] += 1
        await ctl.reconcile()
        assert [c["config"] for c in host.configs] == [before, after]
        assert desired()["slots"] == [0] and not desired()["stop"]
        # a crash of the new daemon's workers counts as ever
        stated(store, 4, after, crashed=(0,))
        crash_event(store, 2, after)
        clock[0] += 1
        await ctl.reconcile()
        assert ctl.records["h3"].failures == 1 and ctl.records["h3"].start_failure
        # the old crash, replaced on record by the new one, is no longer remembered as said
        assert not ctl.observed._stale_logged

    with caplog.at_level("INFO", logger="eltctl.controller"):
        asyncio.run(scenario())
    # said once, though every pass while it was on record saw it
    assert sum("counts no failure" in r.getMessage() for r in caplog.records) == 1


def test_an_idle_daemon_started_with_an_older_configuration_is_replaced(tmp_path, monkeypatch, caplog):
    """However a daemon with the configuration from before a change escaped the fix (it was
    silent then), once it is seen idle with the old digest it is asked to exit, and the
    next start ships the new; a daemon with the current digest, or none (an older
    eltctl's), is left alone."""
    inv = inventory(tmp_path)
    ctl, store = controller(tmp_path, inv)
    clock = [NOW]
    ctl.clock = ctl.starter.clock = lambda: clock[0]
    ctl.fingerprint = pol.fingerprint(inv, "the code now")
    host = Host(monkeypatch, tmp_path / "home")
    host.shipping.set()
    ctl.records["h3"] = pol.HostRecord(desired=(0,), seq=1)
    from eltctl_runtime.protocol import desired_key

    async def scenario():
        ctl.observed.take_reports([CPU_ONLY])
        for config in (ctl.host_config("h3"), ""):
            stated(store, 1, config)
            await ctl.reconcile()
            assert "h3" not in ctl.starter.retired and desired_key("h3") not in store.values
            clock[0] += 1
        stated(store, 2, "0123456789abcdef")
        await ctl.reconcile()
        assert "h3" in ctl.starter.retired and json.loads(store.values[desired_key("h3")])["stop"]

    with caplog.at_level("INFO", logger="eltctl.controller"):
        asyncio.run(scenario())
    assert sum("from before the last change: it is replaced" in r.getMessage() for r in caplog.records) == 1

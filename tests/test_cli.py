"""The real `eltctl` as a user runs it: exit codes and the exact messages on stderr.

Every test starts the console script (or `python -m eltctl`) in a fresh directory,
with an environment cleared of ELTCTL_INVENTORY and colour settings, so that what
is compared is exactly what a user reads in a terminal log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eltctl.commands.init import STARTER
from eltctl.inventory import load_inventory

SCRIPT = Path(sys.executable).with_name("eltctl")
TIMEOUT = 120  # generous: the machine is shared

JOB = '[job]\nname = "t"\ncommand = ["python", "train.py"]\n'
HOST = '[[hosts]]\nname = "h1"\naddress = "10.0.0.1"\n'

NO_FILE_HINT = ("  hint: write a commented starter with `eltctl init` and edit it, or choose another "
                "file with `eltctl -i PATH ...` or ELTCTL_INVENTORY=PATH\n")


def run(*args: str, cwd: Path, env: dict[str, str] | None = None, module: bool = False
        ) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("ELTCTL_INVENTORY", "FORCE_COLOR", "CLICOLOR_FORCE", "COLUMNS")}
    base.update({"NO_COLOR": "1", "TERM": "dumb"})
    base.update(env or {})
    argv = [sys.executable, "-m", "eltctl"] if module or not SCRIPT.exists() else [str(SCRIPT)]
    return subprocess.run([*argv, *args], cwd=cwd, env=base, capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------- inventory mistakes, end to end

MISTAKES = [
    ("toml syntax error: file and line", JOB + "[[hosts]]\nname \"h\"\n",
     "error: hosts.toml:5: invalid TOML: Expected '=' after a key in a key/value pair (column 6)\n"),
    ("unknown key: nearest valid name", JOB + '[policy]\nidel_for = "10m"\n' + HOST,
     "error: hosts.toml:5: policy.idel_for: unknown key; did you mean idle_for?\n"),
    ("missing key: key path and host", JOB + HOST + '\n[[hosts]]\nname = "gpu4"\nport = 22\n',
     'error: hosts.toml:8: hosts[1].address (host "gpu4"): missing; add address = "hostname or IP" '
     '(or "local" for this machine)\n'),
    ("wrong type: key path and fix", JOB + HOST + 'port = "22"\n',
     'error: hosts.toml:7: hosts[0].port (host "h1"): must be an integer from 1 to 65535, got a '
     'string ("22"); remove the quotes: port = 22\n'),
    ("duplicate host names", JOB + HOST + HOST,
     'error: hosts.toml:8: hosts[1].name (host "h1"): duplicate host name "h1" (also hosts[0], '
     "line 5); give each host a unique name\n"),
    ("brackets in a message are text, not markup", HOST,
     'error: hosts.toml: job: missing the [job] section; add [job] with name = "..." and '
     'command = "..."\n'),
    ("several problems at once", JOB + "min_workers = 0\n" + HOST + "slots = 0\n",
     "error: hosts.toml: 2 problems\n"
     "  hosts.toml:4: job.min_workers: must be >= 1, got 0\n"
     '  hosts.toml:8: hosts[0].slots (host "h1"): must be >= 1 (CPU workers on this host), got 0\n'),
]


@pytest.mark.parametrize("what, text, stderr", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_inventory_mistake_exits_2_with_the_exact_message(tmp_path, what, text, stderr):
    (tmp_path / "hosts.toml").write_text(text)
    r = run("probe", cwd=tmp_path)
    assert (r.returncode, r.stderr, r.stdout) == (2, stderr, "")


def test_doctor_reports_the_same_inventory_error(tmp_path):
    (tmp_path / "hosts.toml").write_text(JOB + '[policy]\nidle_for = "soon"\n' + HOST)
    r = run("doctor", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr == ('error: hosts.toml:5: policy.idle_for: "soon" is not a duration: write it like '
                        '"90s", "10m", "1h30m", "500ms" or a number of seconds\n')


def test_missing_inventory_names_the_file_and_suggests_init(tmp_path):
    r = run("probe", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "error: hosts.toml: no such inventory file\n" + NO_FILE_HINT


@pytest.mark.parametrize(
    "args, env, first_line, init",
    [
        (["-i", "lab.toml", "probe"], {}, "error: lab.toml: no such inventory file (named by -i)",
         "eltctl init lab.toml"),
        (["probe"], {"ELTCTL_INVENTORY": "conf/lab.toml"},
         "error: conf/lab.toml: no such inventory file (named by $ELTCTL_INVENTORY)",
         "eltctl init conf/lab.toml"),
    ],
)
def test_missing_inventory_says_who_named_it(tmp_path, args, env, first_line, init):
    r = run(*args, cwd=tmp_path, env=env)
    assert r.returncode == 2
    first, hint = r.stderr.splitlines()
    assert first == first_line
    assert f"`{init}`" in hint


def test_inventory_option_and_variable_are_read(tmp_path):
    (tmp_path / "a.toml").write_text(JOB + "bogus = 1\n" + HOST)
    (tmp_path / "b.toml").write_text(JOB + "bogus2 = 1\n" + HOST)
    by_env = run("probe", cwd=tmp_path, env={"ELTCTL_INVENTORY": "a.toml"})
    assert by_env.returncode == 2 and by_env.stderr.startswith("error: a.toml:4: job.bogus: ")
    by_option = run("-i", "b.toml", "probe", cwd=tmp_path, env={"ELTCTL_INVENTORY": "a.toml"})
    assert by_option.returncode == 2 and by_option.stderr.startswith("error: b.toml:4: job.bogus2: ")


# ---------------------------------------------------------------- init


def test_init_writes_a_short_starter_for_this_machine_and_says_what_next(tmp_path):
    # Issue 25, finding 10: `init` wrote the whole reference with three made-up hosts
    # active, so the first `doctor` failed. Now: this machine alone, only the command to set.
    proj = tmp_path / "my proj"
    proj.mkdir()
    r = run("init", cwd=proj)
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == textwrap.dedent("""\
        Wrote hosts.toml, a starter inventory for this machine.
        Next:
          1. Set [job] command to your training script (examples/train.py in eltctl's repository is one).
          2. eltctl doctor  checks the job and every host: SSH, host keys, Python and torch, nvidia-smi.
          3. eltctl up      starts training; eltctl status follows it.
        """)
    inv = load_inventory(proj / "hosts.toml")
    assert inv.job.name == "my-proj" and inv.job.command == ("python", "train.py") and inv.job.workdir == proj
    (host,) = inv.hosts
    assert host.is_local and host.name == "here" and host.python == sys.executable  # ours has torch
    assert "`eltctl init --full FILE`" in (proj / "hosts.toml").read_text()


def test_init_full_writes_the_reference(tmp_path):
    r = run("init", "--full", cwd=tmp_path)
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.startswith("Wrote hosts.toml, the commented reference inventory.\n")
    written = tmp_path / "hosts.toml"
    assert written.read_text() == STARTER
    inv = load_inventory(written)  # the reference parses as written
    assert inv.job.name == "my-job" and len(inv.hosts) == 4


def test_init_refuses_to_overwrite_without_force(tmp_path):
    mine = tmp_path / "hosts.toml"
    mine.write_text("# my edited inventory\n")
    r = run("init", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("error: hosts.toml already exists; not overwriting it\n"
                        "  hint: `eltctl init hosts.toml --force` replaces it, or name another file\n")
    assert mine.read_text() == "# my edited inventory\n"
    r = run("init", "--force", "--full", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert mine.read_text() == STARTER
    assert [p.name for p in tmp_path.iterdir()] == ["hosts.toml"]  # no temporary left behind


def test_init_writes_where_told_and_the_next_steps_name_it(tmp_path):
    r = run("init", "conf/lab.toml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert load_inventory(tmp_path / "conf" / "lab.toml").job.name == "conf"
    assert "eltctl -i conf/lab.toml doctor" in r.stdout
    r = run("-i", "other.toml", "init", "--full", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "other.toml").read_text() == STARTER
    assert "eltctl -i other.toml up" in r.stdout
    r = run("init", cwd=tmp_path, env={"ELTCTL_INVENTORY": "env.toml"})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "env.toml").exists()
    assert "2. eltctl doctor" in r.stdout  # found through the variable: no -i needed


def test_init_into_a_directory_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    r = run("init", "d", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith("error: d is a directory\n")


# ---------------------------------------------------------------- the edge: help, usage, exit codes


def test_help_is_cheap_and_never_imports_torch_or_asyncssh(tmp_path):
    start = time.perf_counter()
    r = run("--help", cwd=tmp_path)
    wall = time.perf_counter() - start
    assert r.returncode == 0, r.stderr
    assert "init" in r.stdout and "ELTCTL_INVENTORY" in r.stdout and "default: hosts.toml" in r.stdout
    probe = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "eltctl", "--help"],
        cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert probe.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in probe.stderr.splitlines() if line.startswith("import time:")}
    assert "typer" in imported  # the check itself works
    assert not imported & {"torch", "asyncssh", "numpy"}
    print(f"eltctl --help: {wall:.3f} s wall (target < 0.5 s)")


@pytest.mark.parametrize("args", [[], ["--no-such-option"], ["no-such-command"], ["init", "a", "b"]])
def test_usage_errors_exit_2(tmp_path, args):
    r = run(*args, cwd=tmp_path)
    assert r.returncode == 2
    assert "Usage: eltctl" in (r.stdout + r.stderr)
    assert "Traceback" not in r.stderr


def test_python_dash_m_is_the_same_program(tmp_path):
    r = run("probe", cwd=tmp_path, module=True)
    assert r.returncode == 2
    assert r.stderr == "error: hosts.toml: no such inventory file\n" + NO_FILE_HINT


# A program built on the real entry point with one extra command that fails in each
# way a command can; what is checked is how `main()` turns each into an exit code.
EDGE = textwrap.dedent("""\
    import sys, typer
    from eltctl import cli
    from eltctl.errors import ConfigError, EltctlError, HostError, UsageError

    @cli.app.command("fail")
    def fail(kind: str) -> None:
        if kind == "runtime":
            raise EltctlError("the job could not start", hint="see the log [x]")
        if kind == "usage":
            raise UsageError("--min-workers must be >= 1")
        if kind == "config":
            raise ConfigError("bad value", path="hosts.toml", key="job.name", line=3)
        if kind == "host":
            raise HostError("gpu1", "connection refused", kind="unreachable")
        if kind == "interrupt":
            raise KeyboardInterrupt
        if kind == "exit":
            raise typer.Exit(3)
        if kind == "bug":
            raise ZeroDivisionError("a bug")

    sys.exit(cli.main(sys.argv[1:]))
""")

EDGE_CASES = [
    ("ok", 0, ""),
    ("runtime", 1, "error: the job could not start\n  hint: see the log [x]\n"),
    ("usage", 2, "error: --min-workers must be >= 1\n"),
    ("config", 2, "error: hosts.toml:3: job.name: bad value\n"),
    ("host", 3, "error: gpu1: connection refused\n"),
    ("interrupt", 130, None),
    ("exit", 3, ""),
]


@pytest.mark.parametrize("kind, code, stderr", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_errors_become_exit_codes_at_the_edge(tmp_path, kind, code, stderr):
    r = subprocess.run([sys.executable, "-c", EDGE, "fail", kind], cwd=tmp_path, capture_output=True,
                       text=True, timeout=TIMEOUT, env={**os.environ, "NO_COLOR": "1"})
    assert r.returncode == code, r.stderr
    if stderr is not None:
        assert r.stderr == stderr
    assert "Traceback" not in r.stderr


def test_a_bug_keeps_its_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-c", EDGE, "fail", "bug"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "ZeroDivisionError: a bug" in r.stderr


def test_the_repository_example_is_the_packaged_starter():
    example = Path(__file__).resolve().parents[1] / "hosts.example.toml"
    template = Path(__file__).resolve().parents[1] / "eltctl" / "templates" / "hosts.example.toml"
    assert example.is_symlink() and example.resolve() == template.resolve()
    assert template.read_text(encoding="utf-8") == STARTER


def test_each_command_is_a_plain_function_registered_in_help_order():
    import typer

    from eltctl.commands import register
    from eltctl.commands.down import down
    from eltctl.commands.up import up

    app = typer.Typer()
    register(app)
    names = [c.name for c in app.registered_commands]
    assert names == ["init", "doctor", "probe", "up", "scale", "cordon", "uncordon", "down", "status", "logs", "usage",
                     "lab", "metrics", "demo", "cron"]
    # `notify test`; `checkpoints` and `checkpoints export`
    assert [g.name for g in app.registered_groups] == ["notify", "checkpoints"]
    callbacks = {c.name: c.callback for c in app.registered_commands}
    assert callbacks["up"] is up and callbacks["down"] is down


# ---------------------------------------------------------------- host names: one answer everywhere

TWO_LOCAL = JOB + '[[hosts]]\nname = "local-a"\naddress = "local"\n[[hosts]]\nname = "local-b"\naddress = "local"\n'

# Every command that takes a host name, given one that is not in the inventory.
HOST_ARGS = [["status", "{}"], ["status", "--json", "{}"], ["logs", "{}"], ["scale", "--add", "{}"],
             ["scale", "--remove", "{}"], ["cordon", "{}"], ["uncordon", "{}"], ["probe", "{}"],
             ["checkpoints", "export", "out.pt", "--from", "{}"]]


def in_process(tmp_path, monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process (cheap: no interpreter start) on tmp_path/hosts.toml."""
    from eltctl.cli import main

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("COLUMNS", "200")
    code = main(["-i", str(tmp_path / "hosts.toml"), *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args", HOST_ARGS, ids=[" ".join(a) for a in HOST_ARGS])
def test_an_unknown_host_is_the_same_usage_error_with_a_did_you_mean_everywhere(tmp_path, monkeypatch, capsys,
                                                                                  args):
    (tmp_path / "hosts.toml").write_text(TWO_LOCAL)
    code, out, err = in_process(tmp_path, monkeypatch, capsys, *[a.format("local-c") for a in args])
    assert (code, out) == (2, "")
    assert err == (f"error: no host 'local-c' in {tmp_path / 'hosts.toml'}\n"
                   "  hint: did you mean local-a or local-b? (hosts: local-a, local-b)\n")
    code, out, err = in_process(tmp_path, monkeypatch, capsys, *[a.format("nosuchhost") for a in args])
    assert (code, out) == (2, "")
    assert err == (f"error: no host 'nosuchhost' in {tmp_path / 'hosts.toml'}\n"
                   "  hint: hosts: local-a, local-b\n")


def test_scale_names_every_unknown_host_at_once_and_the_closest_one(tmp_path, monkeypatch, capsys):
    (tmp_path / "hosts.toml").write_text(TWO_LOCAL)
    code, out, err = in_process(tmp_path, monkeypatch, capsys, "scale", "--add", "locl-a", "--remove", "zz")
    assert (code, err) == (2, f"error: no hosts 'locl-a', 'zz' in {tmp_path / 'hosts.toml'}\n"
                              "  hint: did you mean local-a? (hosts: local-a, local-b)\n")


def test_scale_refuses_a_host_both_added_and_removed(tmp_path, monkeypatch, capsys):
    (tmp_path / "hosts.toml").write_text(TWO_LOCAL)
    code, out, err = in_process(tmp_path, monkeypatch, capsys, "scale", "--add", "local-a", "--remove", "local-a")
    assert (code, err) == (2, "error: local-a: both --add and --remove\n"
                              "  hint: name a host once: --add to use it now, --remove to keep it out\n")


# ---------------------------------------------------------------- --help shows flags as flags

def _help(*command: str) -> str:
    from typer.testing import CliRunner

    from eltctl.cli import app

    r = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    return r.output


def test_help_shows_flags_without_a_value_and_host_arguments_by_name():
    commands = [[c.name] for c in _commands() if c.name != "checkpoints"] + [["checkpoints"],
                                                                          ["checkpoints", "export"]]
    for command in commands:
        text = _help(*command)
        assert "<bool>" not in text and "list[str]" not in text, (command, text)
    assert "--force " in _help("down") and "--force <" not in _help("down")
    assert "--add" in _help("scale") and "HOST" in _help("scale")
    assert "[HOST]" in _help("status") and "[HOST]" in _help("logs")  # logs: every host without one


def _commands():
    from eltctl.cli import app

    return [c for c in app.registered_commands]



def test_the_cli_imports_with_a_typer_that_has_no_rich_type_labels(monkeypatch):
    # typer 0.27 (the GPU machine's) has no `display_type_rich`: `import eltctl.cli`
    # raised AttributeError there, so no command ran at all.
    import typer.core

    from eltctl.cli import _flags_take_no_value

    for cls in (typer.core.TyperOption, typer.core.TyperArgument):
        if hasattr(cls, "display_type_rich"):
            monkeypatch.delattr(cls, "display_type_rich")
    _flags_take_no_value()  # nothing to patch: returns without an error


# ---------------------------------------------------------------- which inventory: -i anywhere, --job, the running job

def _command_lines() -> list[list[str]]:
    """Every command that reads the inventory, with the arguments it needs."""
    needs = {("scale",): ["--add", "h1"], ("cordon",): ["h1"], ("uncordon",): ["h1"],
             ("checkpoints", "export"): ["out.pt"]}
    paths = [p for p in _every_command_path() if p and p[0] not in ("init", "demo") and p != ["notify"]]
    return [[*p, *needs.get(tuple(p), [])] for p in paths]


def test_every_command_takes_the_inventory_after_its_name_too(tmp_path, monkeypatch, capsys):
    from eltctl.cli import main

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    lines = _command_lines()
    assert ["status"] in lines and ["checkpoints", "export", "out.pt"] in lines and ["notify", "test"] in lines
    for line in lines:
        code = main([*line, "-i", "lab.toml"])
        err = capsys.readouterr().err
        assert (code, err.splitlines()[0]) == (2, "error: lab.toml: no such inventory file (named by -i)"), line


# The running job's controller: its lock names a live pid (this test's), controller.json its inventory.
def record_job(state: Path, job: str, inventory: Path, *, running: bool = True) -> Path:
    d = state / "eltctl" / job
    d.mkdir(parents=True)
    (d / "controller.json").write_text(json.dumps({"pid": os.getpid(), "inventory": str(inventory)}))
    (d / "controller.lock").write_text(str(os.getpid() if running else 999999999))
    (d / "status.json").write_text(json.dumps({"job": job, "state": "training", "step": 7, "hosts": []}))
    return d


def status_json(tmp_path, monkeypatch, capsys, cwd: Path, *args: str) -> tuple[int, dict | None, str]:
    from eltctl.cli import main

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("ELTCTL_INVENTORY", raising=False)
    monkeypatch.chdir(cwd)
    code = main([*args, "status", "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out else None, err


def test_a_directory_without_an_inventory_uses_the_running_jobs(tmp_path, monkeypatch, capsys):
    (tmp_path / "job").mkdir()
    inventory = tmp_path / "job" / "hosts.toml"
    inventory.write_text(JOB + HOST)
    record_job(tmp_path / "state", "t", inventory)
    elsewhere = tmp_path / "job" / "sub"
    elsewhere.mkdir()
    code, doc, err = status_json(tmp_path, monkeypatch, capsys, elsewhere)
    assert (code, doc["job"], doc["step"]) == (0, "t", 7)
    assert err == f"no hosts.toml here; using job t's inventory {inventory} (its controller runs)\n"


def test_a_directory_without_an_inventory_names_the_stopped_jobs_recorded_here(tmp_path, monkeypatch, capsys):
    record_job(tmp_path / "state", "t", tmp_path / "t.toml", running=False)
    code, doc, err = status_json(tmp_path, monkeypatch, capsys, tmp_path)
    assert (code, doc) == (2, None)
    assert err == ("error: hosts.toml: no such inventory file\n" + NO_FILE_HINT.rstrip("\n")
                   + f"; or choose a job recorded here with --job NAME: t ({tmp_path / 't.toml'})\n")


def test_several_running_jobs_need_a_choice_and_job_makes_it(tmp_path, monkeypatch, capsys):
    for name in ("t", "u"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "hosts.toml").write_text(JOB.replace('"t"', f'"{name}"') + HOST)
        record_job(tmp_path / "state", name, tmp_path / name / "hosts.toml")
    code, doc, err = status_json(tmp_path, monkeypatch, capsys, tmp_path)
    assert (code, doc) == (2, None)
    assert err == (f"error: no hosts.toml here, and 2 jobs run on this machine: t ({tmp_path / 't' / 'hosts.toml'}), "
                   f"u ({tmp_path / 'u' / 'hosts.toml'})\n"
                   "  hint: choose one with --job NAME, or name its inventory with -i FILE\n")
    code, doc, err = status_json(tmp_path, monkeypatch, capsys, tmp_path, "--job", "u")
    assert (code, doc["job"], err) == (0, "u", "")
    code, doc, err = status_json(tmp_path, monkeypatch, capsys, tmp_path / "t", "--job", "v")
    assert (code, err) == (2, "error: no job 'v' is recorded on this machine\n"
                              "  hint: jobs recorded here: t (running), u (running)\n")


def test_status_of_a_recorded_job_survives_a_typo_in_its_inventory(tmp_path, monkeypatch, capsys):
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(JOB + "[[hosts]]\nname \"h\"\n")
    record_job(tmp_path / "state", "t", inventory)
    code, doc, err = status_json(tmp_path, monkeypatch, capsys, tmp_path)
    assert (code, doc["job"], doc["step"]) == (0, "t", 7)
    assert err == ("warning: hosts.toml:5: invalid TOML: Expected '=' after a key in a key/value pair (column 6)\n"
                   "  showing job t from its state directory; `up`, `scale` and `down` need the inventory fixed\n")
    # an inventory no job was run from: its error, as before
    (tmp_path / "other.toml").write_text(JOB + "[[hosts]]\nname \"h\"\n")
    code, doc, err = status_json(tmp_path, monkeypatch, capsys, tmp_path, "-i", "other.toml")
    assert (code, doc) == (2, None) and err.startswith("error: other.toml:5: invalid TOML")


def test_a_record_written_by_another_account_is_not_believed(tmp_path):
    from eltctl.controller.statedir import recorded_jobs

    d = record_job(tmp_path / "state", "t", tmp_path / "hosts.toml")
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    assert [(r.name, r.running) for r in recorded_jobs(env)] == [("t", True)]
    if os.getuid() == 0:
        os.chown(d / "controller.json", 65534, 65534)  # nobody's
        assert recorded_jobs(env) == []


CHOICES = [
    # (given, origin, --job, ./hosts.toml exists, recorded (name, running)) -> (path, origin) or error start
    ("hosts.toml", None, None, True, [("t", True)], ("hosts.toml", None)),
    ("a.toml", "-i", None, False, [("t", True)], ("a.toml", "-i")),
    ("a.toml", "$ELTCTL_INVENTORY", None, False, [("t", True)], ("a.toml", "$ELTCTL_INVENTORY")),
    ("a.toml", "$ELTCTL_INVENTORY", "t", False, [("t", True)], ("/j/t.toml", "--job t")),
    ("hosts.toml", None, "t", True, [("t", False)], ("/j/t.toml", "--job t")),
    ("hosts.toml", None, None, False, [("t", True), ("u", False)], ("/j/t.toml", "the running job t's record")),
    ("hosts.toml", None, None, False, [("t", False)], ("hosts.toml", None)),  # and a hint naming t
    ("hosts.toml", None, None, False, [], ("hosts.toml", None)),
    ("hosts.toml", None, None, False, [("t", True), ("u", True)], "no hosts.toml here, and 2 jobs run"),
    ("a.toml", "-i", "t", False, [("t", True)], "-i and --job both choose the inventory"),
    ("hosts.toml", None, "x", True, [("t", True)], "no job 'x' is recorded on this machine"),
]


@pytest.mark.parametrize("given, origin, job, exists, recorded, want", CHOICES)
def test_which_inventory_a_command_uses(given, origin, job, exists, recorded, want):
    from eltctl.commands.common import choose_inventory
    from eltctl.controller.statedir import RecordedJob
    from eltctl.errors import UsageError

    jobs = [RecordedJob(n, Path(f"/j/{n}.toml"), running) for n, running in recorded]
    if isinstance(want, str):
        with pytest.raises(UsageError) as exc:
            choose_inventory(Path(given), origin, job, default_exists=exists, recorded=jobs)
        assert exc.value.message.startswith(want)
        return
    choice = choose_inventory(Path(given), origin, job, default_exists=exists, recorded=jobs)
    assert (choice.path, choice.origin) == (Path(want[0]), want[1])


# ---------------------------------------------------------------- --help keeps the inventory's [section] names

def _every_command_path() -> list[list[str]]:
    import typer.main

    from eltctl.cli import app

    def walk(command, path):
        yield path
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*path, name])

    return list(walk(typer.main.get_command(app), []))


def test_help_shows_bracketed_names_as_written_for_every_command():
    import re

    import typer.main

    from eltctl.cli import app

    root = typer.main.get_command(app)
    checked = 0
    for path in _every_command_path():
        command = root
        for name in path:
            command = command.commands[name]
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        texts += [sub.help or "" for sub in getattr(command, "commands", {}).values()]  # the commands' list
        names = {m for t in texts for m in re.findall(r"\[(\w+)\]", t.replace("\\[", "["))}
        shown = _help(*path)
        for name in names:
            assert f"[{name}]" in shown, (path, name, shown)
            checked += 1
    assert checked >= 5
    assert "[notify] in the inventory" in _help("notify") and "command of [notify]" in _help("notify", "test")
    assert "[storage] mirror" in _help("up") and "[controller] metrics_file" in _help("metrics")

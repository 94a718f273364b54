"""`eltctl cron` (eltctl/cron.py): the entry, its idempotent install and removal, and
`up --unattended`'s lock, log and exit status.

This machine may have no `crontab` (Debian package `cron`): the tests point eltctl at
a stand-in through $ELTCTL_CRONTAB (tests/testbed/crontab.py: the same `-l` and `-`
calls, the table kept in a file), never at the machine's own crontab. The entry run in
cron's environment against real sshd hosts: test_cron_sshd.py.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

from eltctl import cron
from eltctl.inventory import load_inventory
from tests.testbed.crontab import env_with_crontab, install_crontab
from tests.testbed.jobenv import ELTCTL, job_pids

OTHERS = "# m h dom mon dow command\n0 3 * * * /usr/bin/backup --all\n@reboot /home/u/start-vnc\n"


def write_inventory(root: Path, *, job: str = "cronjob", address: str = "127.0.0.1", port: int = 1) -> Path:
    path = root / "lab dir" / "hosts.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "train.py").write_text("print('never run here')\n")
    path.write_text(f'[job]\nname = "{job}"\ncommand = "python train.py"\nworkdir = "."\n'
                    f'[ssh]\nconnect_timeout = "2s"\n'
                    f'[[hosts]]\nname = "h1"\naddress = "{address}"\nport = {port}\n')
    return path


@pytest.fixture
def lab(tmp_path):
    program, table = install_crontab(tmp_path / "bin")
    inventory = write_inventory(tmp_path)
    env = env_with_crontab({**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}, program)
    env.pop("ELTCTL_CONTROL_ID", None)

    def eltctl(*args: str, inv: Path = inventory) -> subprocess.CompletedProcess:
        return subprocess.run([*ELTCTL, "-i", str(inv), *args], env=env, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)

    return inventory, table, env, eltctl


def test_the_entry_has_absolute_paths_the_state_location_and_a_marker(tmp_path):
    inv = load_inventory(write_inventory(tmp_path))
    line = cron.entry(inv, environ={"XDG_STATE_HOME": "/srv/state 100%", "SSH_AUTH_SOCK": "/tmp/agent"},
                      python="/opt/venv/bin/python")
    path = inv.path.resolve()
    assert line == (f"*/5 * * * * cd '{path.parent}' && XDG_STATE_HOME='/srv/state 100\\%' /opt/venv/bin/python "
                    f"-m eltctl -i '{path}' up --unattended  # eltctl cron: {path}")
    # What cron hands to sh: the % unescaped; the agent is not carried.
    assert cron.command_of(line) == (f"cd '{path.parent}' && XDG_STATE_HOME='/srv/state 100%' "
                                     f"/opt/venv/bin/python -m eltctl -i '{path}' up --unattended  "
                                     f"# eltctl cron: {path}")


@pytest.mark.parametrize("schedule", ["*/5 * * *", "every 5 minutes please ok now", "hourly"])
def test_a_bad_schedule_is_refused(tmp_path, schedule):
    inv = load_inventory(write_inventory(tmp_path))
    with pytest.raises(cron.EltctlError, match="not a cron schedule"):
        cron.entry(inv, schedule)


MARK = "# eltctl cron: /lab/hosts.toml"
LINE = f"*/5 * * * * cd /lab && eltctl up --unattended  {MARK}"


@pytest.mark.parametrize("table, expected", [
    ("", f"{LINE}\n"),
    (OTHERS, f"{OTHERS}{LINE}\n"),
    (f"{OTHERS}\n\n", f"{OTHERS}{LINE}\n"),
    (f"*/9 * * * * old  {MARK}\n{OTHERS}", f"{OTHERS}{LINE}\n"),  # an older entry of this inventory is replaced
    (f"{OTHERS}*/5 * * * * x  # eltctl cron: /other/hosts.toml\n",
     f"{OTHERS}*/5 * * * * x  # eltctl cron: /other/hosts.toml\n{LINE}\n"),
])
def test_with_entry(table, expected):
    assert cron.with_entry(table, LINE, MARK) == expected
    assert cron.with_entry(expected, LINE, MARK) == expected


@pytest.mark.parametrize("table, expected", [
    ("", ""),
    (f"{LINE}\n", ""),
    (f"{OTHERS}{LINE}\n", OTHERS),
    (f"{LINE}\n{OTHERS}", OTHERS),
    (OTHERS, OTHERS),
])
def test_without_entry(table, expected):
    assert cron.without_entry(table, MARK) == expected


def test_cron_prints_installs_once_and_removes_only_its_line(lab):
    inventory, table, env, eltctl = lab
    shown = eltctl("cron")
    assert shown.returncode == 0, shown.stderr
    line = shown.stdout.strip()
    assert line.startswith("*/5 * * * * cd ") and line.endswith(f"# eltctl cron: {inventory.resolve()}")
    assert not table.exists(), "printing must not touch the crontab"

    table.write_text(OTHERS)
    first = eltctl("cron", "--install")
    assert first.returncode == 0 and "installed in your crontab" in first.stdout, first.stdout + first.stderr
    second = eltctl("cron", "--install")
    assert second.returncode == 0 and "already in your crontab" in second.stdout, second.stdout
    assert table.read_text() == f"{OTHERS}{line}\n"

    again = eltctl("cron", "--install", "--schedule", "@hourly")  # a new schedule replaces the line
    assert table.read_text().count("# eltctl cron: ") == 1 and "\n@hourly cd " in table.read_text()

    gone = eltctl("cron", "--remove")
    assert gone.returncode == 0 and "removed from your crontab" in gone.stdout, again.stdout + gone.stdout
    assert table.read_text() == OTHERS
    none = eltctl("cron", "--remove")
    assert none.returncode == 0 and "nothing to remove" in none.stdout
    assert table.read_text() == OTHERS


def test_install_into_an_empty_crontab(lab):
    inventory, table, env, eltctl = lab
    assert eltctl("cron", "--install").returncode == 0
    assert cron.entries(table.read_text(), cron.marker(inventory)) == table.read_text().splitlines()


def test_without_a_crontab_program_the_error_says_how_to_get_one(lab, tmp_path):
    inventory, table, env, _ = lab
    env = {k: v for k, v in env.items() if k != "ELTCTL_CRONTAB"}
    env["PATH"] = str(tmp_path / "empty")
    out = subprocess.run([*ELTCTL, "-i", str(inventory), "cron", "--install"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert "no `crontab` program" in out.stderr and "apt-get install cron" in out.stderr, out.stderr


def test_install_and_remove_together_is_a_usage_error(lab):
    out = lab[3]("cron", "--install", "--remove")
    assert out.returncode == 2 and "exclude each other" in out.stderr


def test_an_unattended_run_while_another_holds_the_lock_does_nothing(lab, tmp_path):
    inventory, table, env, eltctl = lab
    state = tmp_path / "state" / "eltctl" / "cronjob"
    state.mkdir(parents=True)
    fd = os.open(state / cron.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        out = eltctl("up", "--unattended")
    finally:
        os.close(fd)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert sorted(p.name for p in state.iterdir()) == [cron.LOCK_NAME]  # no log, no controller
    assert job_pids("cronjob") == []


def test_an_unattended_run_that_fails_logs_it_says_it_on_stderr_and_exits_non_zero(lab, tmp_path):
    """The only host refuses connections: no host can run the job (a real failure)."""
    inventory, table, env, eltctl = lab
    out = eltctl("up", "--unattended")
    assert out.returncode == 3, out.stdout + out.stderr
    assert out.stdout == "" and "no host can run the job" in out.stderr, out.stderr
    assert "h1" in out.stderr and "connection refused" in out.stderr, out.stderr
    log = (tmp_path / "state" / "eltctl" / "cronjob" / cron.LOG_NAME).read_text()
    assert "error: " in log and "connection refused" in log
    assert not (tmp_path / "state" / "eltctl" / "cronjob" / "controller.json").exists()


def test_the_log_is_capped(tmp_path):
    log = tmp_path / "cron.log"
    cron.append_log(log, ["x" * 100] * 20, cap=1000)
    assert log.stat().st_size > 1000 and not (tmp_path / "cron.log.1").exists()
    cron.append_log(log, ["a started", "second line"], cap=1000)
    assert (tmp_path / "cron.log.1").read_text().count("x" * 100) == 20
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith("] a started") and lines[1].endswith("] second line")


def test_install_warns_when_ssh_may_need_the_agent(tmp_path):
    inv = load_inventory(write_inventory(tmp_path))
    note = cron.agent_note(inv, {"SSH_AUTH_SOCK": "/tmp/agent.1", "XDG_STATE_HOME": "/s"})
    assert note and "no ssh-agent" in note and "identity_file" in note
    assert "PATH=/usr/bin:/bin XDG_STATE_HOME=/s " in note and note.endswith(f"-i '{inv.path}' doctor`")
    assert cron.agent_note(inv, {}) is None  # no agent here either: what works now works from cron

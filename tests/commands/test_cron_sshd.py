"""The installed cron line, run as cron runs it, against real sshd hosts.

`eltctl cron --install` writes the entry into a stand-in crontab ($ELTCTL_CRONTAB,
tests/testbed/crontab.py; this machine may have no cron). The test then runs the
entry's command the way cron does: `/bin/sh -c` under `env -i` with cron's
environment (HOME, LOGNAME, SHELL=/bin/sh, PATH=/usr/bin:/bin; no SSH_AUTH_SOCK, no
terminal, stdin /dev/null). While another run holds the lock it does nothing; then it
starts the stopped job (controller and workers up on the test bed), and the next run
is silent (no output, exit 0, nothing logged). `down` ends it and says that the
entry would bring it back.
"""

from __future__ import annotations

import fcntl
import os
import subprocess

import pytest

from eltctl import cron
from tests.testbed.crontab import env_with_crontab, install_crontab
from tests.testbed.jobenv import job_env_on, job_pids, worker_pids

pytestmark = pytest.mark.sshd


@pytest.fixture
def one_host_job(testbed):
    yield from job_env_on(testbed, testbed.add_hosts(1, gpus=2))


def nice_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[16])  # field 19 of proc(5): nice


def as_cron(command: str, home: str) -> subprocess.CompletedProcess:
    env = ["HOME=" + home, "LOGNAME=root", "SHELL=/bin/sh", "PATH=/usr/bin:/bin"]
    return subprocess.run(["/usr/bin/env", "-i", *env, "/bin/sh", "-c", command], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, cwd="/")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_installed_line_starts_a_stopped_job_and_is_silent_next_time(one_host_job, tmp_path):
    je = one_host_job
    program, table = install_crontab(tmp_path / "cronbin")
    je.env = env_with_crontab(je.env, program)
    assert "installed in your crontab" in je.eltctl("cron", "--install").stdout
    (line,) = table.read_text().splitlines()
    command = cron.command_of(line)
    home = os.environ.get("HOME") or "/root"
    log = je.state_dir / cron.LOG_NAME

    # Another run holds the lock: this one does nothing at all.
    je.state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(je.state_dir / cron.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held = as_cron(command, home)
    finally:
        os.close(fd)
    assert (held.returncode, held.stdout, held.stderr) == (0, "", "")
    assert je.controller_pid() is None and job_pids(je.job) == [] and not log.exists()

    # The stopped job is started: controller and both workers up, what it did in cron.log.
    first = as_cron(command, home)
    assert (first.returncode, first.stdout, first.stderr) == (0, "", ""), first.stderr + je.controller_log()
    je.training_at(2)
    workers = worker_pids(je.job)
    assert len(workers) == 2
    # [policy]'s default courtesy reached the workers through daemon.json: nice 10.
    assert all(nice_of(pid) == 10 for pid in workers.values()), workers
    logged = log.read_text()
    assert "started" in logged and "training" in logged, logged

    # Nothing changed: no output, exit 0, nothing logged, the same controller.
    ctl = je.controller_pid()
    second = as_cron(command, home)
    assert (second.returncode, second.stdout, second.stderr) == (0, "", "")
    assert log.read_text() == logged and je.controller_pid() == ctl

    # `down` says that the entry would start the job again; --remove takes it out.
    down = je.eltctl("down")
    assert "your crontab still runs this job (*/5 * * * *)" in down.stdout, down.stdout
    assert job_pids(je.job) == []
    je.eltctl("cron", "--remove")
    assert table.read_text() == ""

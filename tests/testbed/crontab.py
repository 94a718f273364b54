"""A stand-in `crontab` program for the tests (this machine may have no cron).

`install_crontab(dir)` writes an executable `crontab` into `dir` that keeps the
table in `dir/crontab.txt` and answers the two calls eltctl makes, as cron's own
does: `crontab -l` prints the table (exit 1 and "no crontab for USER" when there is
none) and `crontab -` replaces it with stdin. Point eltctl at it with
ELTCTL_CRONTAB=<path> (eltctl/cron.py). Nothing here touches the machine's crontab.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

SCRIPT = """\
#!{python}
import os, sys
table = {table!r}
if sys.argv[1:] == ["-l"]:
    if not os.path.exists(table):
        sys.stderr.write("no crontab for " + os.environ.get("USER", "root") + "\\n")
        sys.exit(1)
    sys.stdout.write(open(table).read())
elif sys.argv[1:] == ["-"]:
    text = sys.stdin.read()
    if text and not text.endswith("\\n"):
        sys.stderr.write("crontab: the table must end with a newline\\n")
        sys.exit(1)
    with open(table + ".tmp", "w") as f:
        f.write(text)
    os.replace(table + ".tmp", table)
else:
    sys.stderr.write("stand-in crontab: only -l and - are supported\\n")
    sys.exit(2)
"""


def install_crontab(directory: Path) -> tuple[Path, Path]:
    """(program, table file) of a new stand-in crontab in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    program, table = directory / "crontab", directory / "crontab.txt"
    program.write_text(SCRIPT.format(python=sys.executable, table=str(table)))
    program.chmod(program.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return program, table


def env_with_crontab(env: dict[str, str], program: Path) -> dict[str, str]:
    return {**env, "ELTCTL_CRONTAB": str(program)}


__all__ = ["install_crontab", "env_with_crontab"]

"""Shell completion as typer offers it (`eltctl --install-completion`, `--show-completion`),
and what it completes: commands, options, and the inventory's host names for HOST."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT = 120

INVENTORY = ('[job]\nname = "j"\ncommand = "python train.py"\n\n'
             '[[hosts]]\nname = "ws1"\naddress = "local"\n\n'
             '[[hosts]]\nname = "ws2"\naddress = "local"\n\n'
             '[[hosts]]\nname = "gpu9"\naddress = "local"\n')


def run(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("ELTCTL_INVENTORY", "FORCE_COLOR", "CLICOLOR_FORCE", "COLUMNS")
            and not k.startswith("_ELTCTL_COMPLETE")}
    base.update({"NO_COLOR": "1", "TERM": "dumb", **(env or {})})
    # No terminal: stdin from /dev/null, output captured.
    return subprocess.run([sys.executable, "-m", "eltctl", *args], cwd=cwd, env=base, capture_output=True,
                          text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)


def test_help_offers_completion(tmp_path):
    r = run(tmp_path, "--help")
    assert r.returncode == 0, r.stderr
    assert "--install-completion" in r.stdout and "--show-completion" in r.stdout


@pytest.mark.parametrize("shell, marks", [
    ("bash", ["complete -o default -F _eltctl_completion eltctl", "_ELTCTL_COMPLETE=complete_bash"]),
    ("zsh", ["#compdef eltctl", "_ELTCTL_COMPLETE=complete_zsh"]),
    ("fish", ["complete --command eltctl", "_ELTCTL_COMPLETE=complete_fish"]),
])
def test_show_completion_prints_the_script_of_the_shell_given(tmp_path, shell, marks):
    # typer detects the shell; its documented switch lets the shell be named instead,
    # so what is printed does not depend on the shell that runs the tests.
    r = run(tmp_path, "--show-completion", shell, env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    for mark in marks:
        assert mark in r.stdout, r.stdout


def complete(cwd: Path, words: str, env: dict[str, str] | None = None) -> list[str]:
    """What bash completion offers for the last of `words` (the protocol of the script above)."""
    parts = words.split(" ")
    r = run(cwd, env={"_ELTCTL_COMPLETE": "complete_bash", "COMP_WORDS": words,
                      "COMP_CWORD": str(len(parts) - 1), **(env or {})})
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_completion_offers_commands_options_and_host_names(tmp_path):
    (tmp_path / "hosts.toml").write_text(INVENTORY)
    (tmp_path / "lab.toml").write_text(INVENTORY.replace('"gpu9"', '"lab1"'))
    assert complete(tmp_path, "eltctl st") == ["status"]
    assert {"--failed", "--worker", "--follow"} <= set(complete(tmp_path, "eltctl logs here --"))
    assert complete(tmp_path, "eltctl logs ws") == ["ws1", "ws2"]
    assert complete(tmp_path, "eltctl status ") == ["ws1", "ws2", "gpu9"]
    assert complete(tmp_path, "eltctl -i lab.toml status l") == ["lab1"]
    assert complete(tmp_path, "eltctl logs l", env={"ELTCTL_INVENTORY": "lab.toml"}) == ["lab1"]


def test_completion_with_a_broken_inventory_offers_nothing(tmp_path):
    (tmp_path / "hosts.toml").write_text("[job\n")
    assert complete(tmp_path, "eltctl logs ") == []

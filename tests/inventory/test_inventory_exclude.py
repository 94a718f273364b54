"""[job] exclude and include (issue 50): lists of gitignore patterns choosing what of the
workdir goes to the hosts (eltctl/hosts/ignore.py); a bad one names the file and key."""

from __future__ import annotations

import pytest

from eltctl.errors import ConfigError
from eltctl.inventory import parse_inventory

BASE = '[job]\nname = "j"\ncommand = "python t.py"\n'
HOST = '[[hosts]]\nname = "a"\naddress = "a.lab"\n'


def test_absent_they_are_empty_and_given_they_are_read_in_order():
    inv = parse_inventory(BASE + HOST, "hosts.toml")
    assert (inv.job.exclude, inv.job.include) == ((), ())
    inv = parse_inventory(BASE + 'exclude = ["data/", "*.bin", "!keep.bin"]\ninclude = ["weights/init.pt"]\n'
                          + HOST, "hosts.toml")
    assert inv.job.exclude == ("data/", "*.bin", "!keep.bin")
    assert inv.job.include == ("weights/init.pt",)


@pytest.mark.parametrize("line, message", [
    ('exclude = "data/"', 'hosts.toml:4: job.exclude: must be a list of patterns, got a string ("data/"); '
                          'write exclude = ["data/"]'),
    ("exclude = 3", 'hosts.toml:4: job.exclude: must be a list of patterns, got an integer (3); '
                    'write exclude = ["data/", "*.bin"]'),
    ('exclude = ["ok", 3]', 'hosts.toml:4: job.exclude[1]: must be a string (a pattern such as "data/"), '
                            "got an integer (3)"),
    ('exclude = ["data["]', "hosts.toml:4: job.exclude[0]: 'data[' has a '[' that is not closed: close it "
                            "with ']' or write '\\['"),
    ('include = [""]', 'hosts.toml:4: job.include[0]: is empty: write a pattern such as "data/" or "*.bin"'),
    ('exclude = ["# secrets"]', "hosts.toml:4: job.exclude[0]: '# secrets' is a comment in gitignore's syntax "
                                "and matches nothing: write \\# for a '#'"),
    ('excludes = ["x"]', "hosts.toml:4: job.excludes: unknown key; did you mean exclude?"),
])
def test_mistakes_name_the_file_and_key(line, message):
    with pytest.raises(ConfigError) as info:
        parse_inventory(BASE + line + "\n" + HOST, "hosts.toml")
    assert info.value.message == message

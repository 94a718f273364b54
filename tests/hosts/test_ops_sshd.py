"""The code sync over SSH against a real sshd host (issue 50, finding 4): the host's copy
holds only what the ignore rules choose; what an earlier sync sent and the rules now leave
out (the inventory, an exported model) is deleted there."""

from __future__ import annotations

import asyncio

import pytest

from eltctl.hosts import ignore
from eltctl.hosts import ops as hostops
from eltctl.hosts.fleet import Fleet
from eltctl.inventory import load_inventory

pytestmark = pytest.mark.sshd


def test_code_sync_over_ssh_leaves_out_the_inventory_and_models_and_deletes_them_there(testbed, tmp_path):
    testbed.add_host("h1")
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print(1)\n")
    (work / "model.pt").write_bytes(b"\0" * 1000)
    (work / "secret.txt").write_text("token\n")
    (work / ".gitignore").write_text("runs/\n")
    (work / "runs").mkdir()
    (work / "runs" / "r1.csv").write_text("1\n")
    inv = load_inventory(testbed.write_inventory(work / "hosts.toml", job={
        "workdir": str(work), "exclude": ["secret.txt"]}))

    async def main():
        async with Fleet(inv) as fleet:
            t = await fleet.transport(inv.hosts[0])
            dest = f"{await hostops.remote_home(t)}/code"
            # no rule but the ignore files: hosts.toml and model.pt go, as they went before issue 50
            before = await hostops.sync_code(t, work, dest, ignore.Rules())
            after = await hostops.sync_code(t, work, dest, hostops.code_rules(inv))
            listing = await t.run(f"cd {dest} && find . -type f | sort")
            return before, after, listing.stdout.split()

    before, after, there = asyncio.run(main())
    assert "hosts.toml" in before.sent and "model.pt" in before.sent and "runs/r1.csv" not in before.sent
    assert after.sent == () and after.deleted == ("hosts.toml", "model.pt", "secret.txt")
    assert there == ["./.gitignore", "./train.py"]

"""`eltctl checkpoints`: the listing as drawn (no SSH: listings built by hand)."""

from __future__ import annotations

from eltctl.commands.checkpoints import render
from eltctl.mirror.listing import CheckpointListing


def test_no_checkpoints_is_a_sentence_not_an_empty_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    render(CheckpointListing((), (), None))
    out = capsys.readouterr().out
    assert out == ("mirror: none (set [storage] mirror)\n"
                   "no checkpoints on the hosts yet: rank 0 writes one every checkpoint_every_steps (or _seconds) "
                   "of ElasticJob while the job trains\n")


def test_no_checkpoints_found_where_a_host_failed_names_the_failure(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    render(CheckpointListing((), (("h2", "unreachable: timed out"),), "/srv/mirror"))
    out = capsys.readouterr().out
    assert out == ("mirror: /srv/mirror\nno checkpoints on the hosts or the mirror\nh2: unreachable: timed out\n")
    assert "┃" not in out and "━" not in out

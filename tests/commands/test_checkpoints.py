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


def test_export_refuses_to_replace_a_file_without_force(tmp_path, monkeypatch, capsys):
    from eltctl.cli import main

    (tmp_path / "hosts.toml").write_text('[job]\nname = "t"\ncommand = ["python", "train.py"]\n'
                                         '[[hosts]]\nname = "a"\naddress = "local"\n')
    out = tmp_path / "model.pt"
    out.write_bytes(b"mine")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("COLUMNS", "200")
    code = main(["-i", str(tmp_path / "hosts.toml"), "checkpoints", "export", str(out)])
    err = capsys.readouterr().err
    assert (code, out.read_bytes()) == (2, b"mine")
    assert err == (f"error: {out} already exists; not overwriting it\n"
                   f"  hint: `eltctl checkpoints export {out} --force` replaces it, or name another file\n")
    # --force goes on to look for a checkpoint (this host has none): another error, the file kept
    code = main(["-i", str(tmp_path / "hosts.toml"), "checkpoints", "export", str(out), "--force"])
    err = capsys.readouterr().err
    assert code != 0 and "already exists" not in err and out.read_bytes() == b"mine", err

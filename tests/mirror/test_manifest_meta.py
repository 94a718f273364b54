"""A restart-mode snapshot's manifest names the script's step (`meta`), and the
checkpoint listing (`eltctl checkpoints`) shows it beside the snapshot counter."""

from __future__ import annotations

import io

from rich.console import Console

from eltctl.mirror.manifests import SECTION, manifest_script_step, parse_listing
from eltctl.mirror.values import Place
from eltctl_runtime.checkpoint.format import MANIFEST_FILE
from eltctl_runtime.checkpoint.store import CheckpointStore


def test_a_snapshots_manifest_carries_the_scripts_step_to_the_listing(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "ckpt")
    store.save_async(3, {"x": 1}, meta={"mode": "restart", "snapshot": 3, "script_step": 6784})
    store.wait()
    store.save(4, {"x": 2})
    store.close()
    text = "".join(f"{SECTION}{d.name}\n{(d / MANIFEST_FILE).read_text()}"
                   for d in sorted((tmp_path / "ckpt").iterdir()))
    found = parse_listing(text, Place("h1", None, str(tmp_path / "ckpt")))  # type: ignore[arg-type]
    assert [(c.step, c.script_step) for c in found] == [(4, None), (3, 6784)]
    assert found[1].as_json()["script_step"] == 6784 and "script_step" not in found[0].as_json()
    assert manifest_script_step("not json") is None

    from eltctl.commands import checkpoints
    from eltctl.mirror.listing import CheckpointListing

    buf = io.StringIO()
    monkeypatch.setattr("rich.console.Console", lambda **kw: Console(file=buf, width=120, **kw))
    checkpoints.render(CheckpointListing(tuple(found), (), None))
    out = buf.getvalue()
    assert "snapshot" in out and "script step" in out and "6784" in out, out

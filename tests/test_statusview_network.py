"""Where a step's time goes (issue 51), on the control side: the controller's document
carries rank 0's `network` figures, `eltctl status` shows them (and says when the
network sets the job's speed), the metrics file exports them. Fixed documents, exact text."""

from __future__ import annotations

import copy

from eltctl.controller.status import network_entry
from eltctl.metrics import render
from eltctl.statusview import Source
from eltctl.statusview.job import format_bytes, network_hint, network_line
from tests.test_statusview import NOW, TRAINING, view_text
from tests.testbed.promtext import parse, value

BOUND = {"wait_s": 1.2, "compute_s": 0.6, "share": 0.6667, "bytes_per_step": 200_000_128}
HIDDEN = {"wait_s": 0.02, "compute_s": 0.58, "share": 0.0333, "bytes_per_step": 4_096}


def test_network_entry_passes_rank0s_figures_and_drops_what_is_not_a_number():
    assert network_entry({"network": BOUND}) == BOUND
    assert network_entry({"network": {**BOUND, "wait_s": "x", "extra": 1}}) == {**BOUND, "wait_s": None}
    # an older runtime, restart mode or sharded training: no figures, and none without a share
    assert network_entry({}) is None and network_entry({"network": [1]}) is None
    assert network_entry({"network": {"wait_s": 1.0}}) is None


def test_the_controllers_document_carries_the_figures_while_workers_run():
    from tests.controller.test_status import RS2, RUNNING, _doc

    rs = {**RS2, "members": ["a/0/1"], "world_size": 1, "workers": None, "network": BOUND}
    assert _doc(RUNNING, rs)["network"] == BOUND
    assert _doc(RUNNING, {**rs, "paused": True})["network"] is None  # no worker runs: no live figure
    assert _doc(RUNNING, RS2)["network"] is None  # the runtime reported none


def test_the_network_line_and_the_hint_over_half_the_step():
    assert network_line(BOUND) == "67% of the step (wait 1.2 s of 1.8 s), 200 MB per step"
    assert network_line(HIDDEN) == "3% of the step (wait 0.02 s of 0.6 s), 4.1 kB per step"
    assert network_line(None) is None and network_line({"share": None}) is None
    assert "the network sets the job's speed" in network_hint(BOUND)
    assert "bf16 all-reduce" in network_hint(BOUND) and 'grad_dtype="bf16"' in network_hint(BOUND)
    assert network_hint(HIDDEN) is None and network_hint({"share": 0.5}) is None and network_hint(None) is None
    assert [format_bytes(n) for n in (812, 999, 1500, 2.5e9, 4e12)] == ["812 B", "999 B", "1.5 kB", "2.5 GB",
                                                                       "4 TB"]


def test_the_view_shows_the_network_row_under_progress_and_the_hint():
    doc = copy.deepcopy(TRAINING)
    doc["network"] = BOUND
    lines = view_text(doc, Source.CONTROLLER, NOW + 0.5).splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("progress"))
    assert lines[i + 1] == "network     67% of the step (wait 1.2 s of 1.8 s), 200 MB per step"
    assert lines[i + 2].startswith("hint        the network sets the job's speed, not the workers' compute")
    doc["network"] = HIDDEN
    text = view_text(doc, Source.CONTROLLER, NOW + 0.5)
    assert "network     3% of the step" in text and "hint" not in text
    assert "network" not in view_text(TRAINING, Source.CONTROLLER, NOW + 0.5)  # no figures: no row


def test_the_metrics_file_exports_the_share_and_the_bytes():
    fams = parse(render({**TRAINING, "mode": "elastic", "network": BOUND}, None))
    assert value(fams, "eltctl_network_share", job="mnist") == BOUND["share"]
    assert value(fams, "eltctl_bytes_per_step", job="mnist") == BOUND["bytes_per_step"]
    fams = parse(render({**TRAINING, "mode": "elastic", "network": None}, None))
    assert "eltctl_network_share" not in fams and "eltctl_bytes_per_step" not in fams  # left out, never 0


def test_local_steps_are_named_in_the_document_the_line_and_the_hint():
    """Local steps (runtime/train/local.py) add mode and sync_every to rank 0's `network`, and
    the options that are on (sync_overlap, grad_dtype="bf16", inner_batch)."""
    local = {**BOUND, "mode": "local", "sync_every": 16}
    assert network_entry({"network": local}) == local
    assert network_entry({"network": {**BOUND, "mode": "local", "sync_every": "x"}}) == BOUND
    assert network_line(local) == ("67% of the step (wait 1.2 s of 1.8 s), 200 MB per step; local steps, "
                                   "averaged every 16 steps")
    assert "a larger sync_every" in network_hint(local) and "sync_overlap=True hides" in network_hint(local)
    assert 'grad_dtype="bf16" halves its bytes' in network_hint(local)
    # its options (sync_overlap, grad_dtype, inner_batch): carried, shown, and no longer suggested once on
    full = {**local, "sync_overlap": True, "grad_dtype": "bf16", "inner_batch": 16}
    assert network_entry({"network": full}) == full
    assert network_entry({"network": {**local, "sync_overlap": "yes", "grad_dtype": "fp16", "inner_batch": 0}}) == local
    assert network_line(full).endswith("local steps, averaged every 16 steps (overlapped, in bf16, inner steps of 16)")
    assert network_line({**local, "sync_overlap": True}).endswith("averaged every 16 steps (overlapped)")
    hint = network_hint(full)
    assert "a larger sync_every" in hint and "sync_overlap" not in hint and "bf16" not in hint

"""Extra state (a scheduler, a GradScaler) travels with model and optimizer, and
the trained state leaves eltctl as a plain file (load_checkpoint, export_checkpoint)."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
import torch

import eltctl_runtime as elt
from eltctl_runtime.train import state as st
from eltctl_runtime.checkpoint.store import CheckpointStore, InvalidCheckpoint
from tests.testbed.hostpython import HOST_PYTHON


def trained(steps: int = 5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    for _ in range(steps):
        scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()
    return model, opt, {"scheduler": sched, "grad_scaler": scaler}


def test_a_scheduler_and_a_grad_scaler_travel_with_the_state():
    model, opt, extra = trained()
    header, flat = st.pack(st.capture(model, opt, {"step": 5}, extra))
    other, other_opt, other_extra = trained(steps=0)
    assert st.fingerprint(other, other_opt, other_extra) != st.fingerprint(model, opt, extra)
    st.apply(st.unpack(header, flat), other, other_opt, other_extra)
    assert other_extra["scheduler"].get_last_lr() == extra["scheduler"].get_last_lr()
    assert other_extra["scheduler"].last_epoch == 5
    assert other_extra["grad_scaler"].get_scale() == extra["grad_scaler"].get_scale() != 1024.0
    assert other_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert st.fingerprint(other, other_opt, other_extra) == st.fingerprint(model, opt, extra)
    extra["scheduler"].step()  # the fingerprint covers the extra state
    assert st.fingerprint(other, other_opt, other_extra) != st.fingerprint(model, opt, extra)


class Holder:
    def __init__(self, state) -> None:
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, s) -> None:
        self.state = s


@pytest.mark.parametrize("bad, where", [
    ({"fn": len}, "state['extra_state']['ema']['fn'] is a builtin_function_or_method"),
    ({"w": [1, {"x": object()}]}, "state['extra_state']['ema']['w'][1]['x'] is a object"),
    ({(1, 2): 3}, "state['extra_state']['ema'] has the key (1, 2)"),
])
def test_state_that_cannot_travel_is_refused_naming_its_key(bad, where):
    with pytest.raises(TypeError) as e:
        st.check_encodable({"ema": Holder(bad)})
    assert where in str(e.value)


def test_extra_state_must_be_stateful_and_the_scaler_name_is_reserved():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.zeros(4, 2))
    with pytest.raises(TypeError, match=r"extra_state\['lr'\] is a float, which has no state_dict"):
        elt.ElasticJob(model, opt, data, global_batch_size=2, max_steps=1, extra_state={"lr": 0.1})
    with pytest.raises(ValueError, match="reserved for grad_scaler"):
        elt.ElasticJob(model, opt, data, global_batch_size=2, max_steps=1, extra_state={"grad_scaler": Holder({})},
                       grad_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="max_grad_norm"):
        elt.ElasticJob(model, opt, data, global_batch_size=2, max_steps=1, max_grad_norm=0)


def test_a_state_without_an_entry_for_an_extra_object_leaves_it_as_it_is(caplog):
    model, opt, extra = trained()
    saved = st.capture(model, opt, {"step": 5})  # written before the job had a scheduler
    other, other_opt, other_extra = trained(steps=0)
    st.apply(saved, other, other_opt, other_extra)
    assert other_extra["scheduler"].last_epoch == 0
    assert "no extra_state['scheduler']" in caplog.text


def write_checkpoints(directory, steps=(2, 4)):
    model, opt, extra = trained()
    with CheckpointStore(directory) as store:
        for s in steps:
            store.save(s, st.capture(model, opt, {"step": s, "epoch": s // 2, "position": 0}, extra))
    return model, opt, extra


def test_load_checkpoint_takes_the_newest_valid_or_the_step_asked_for(tmp_path):
    model, opt, extra = write_checkpoints(tmp_path / "ckpt")
    got = elt.load_checkpoint(tmp_path / "ckpt")
    assert set(got) == {"model", "optimizer", "extra_state", "step", "epoch"}
    assert (got["step"], got["epoch"]) == (4, 2)
    assert all(torch.equal(got["model"][k], v) for k, v in model.state_dict().items())
    assert got["extra_state"]["scheduler"]["last_epoch"] == 5
    assert got["extra_state"]["grad_scaler"]["scale"] == extra["grad_scaler"].get_scale()
    assert elt.load_checkpoint(tmp_path / "ckpt" / "step-00000002")["step"] == 2
    assert elt.load_checkpoint(tmp_path / "ckpt", step=2)["step"] == 2
    with pytest.raises(InvalidCheckpoint, match=r"no checkpoint of step 3 \(steps there: 4, 2\)"):
        elt.load_checkpoint(tmp_path / "ckpt", step=3)
    with (tmp_path / "ckpt" / "step-00000004" / "state.pt").open("r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    assert elt.load_checkpoint(tmp_path / "ckpt")["step"] == 2  # the damaged newest is skipped
    with pytest.raises(InvalidCheckpoint, match="sha256"):
        elt.load_checkpoint(tmp_path / "ckpt" / "step-00000004")
    with pytest.raises(InvalidCheckpoint, match="no checkpoint here"):
        elt.load_checkpoint(tmp_path)


def test_an_exported_checkpoint_opens_with_weights_only_load_without_eltctl(tmp_path):
    model, _opt, _extra = write_checkpoints(tmp_path / "ckpt")
    out = tmp_path / "model.pt"
    info = elt.export_checkpoint(tmp_path / "ckpt", out)
    assert (info["step"], info["out"]) == (4, str(out))
    script = textwrap.dedent(f"""
        import sys, torch
        assert not any("eltctl" in (p or "") for p in sys.path), sys.path
        try:
            import eltctl_runtime
            raise SystemExit("eltctl_runtime is importable")
        except ImportError:
            pass
        d = torch.load({str(out)!r}, weights_only=True)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        model.load_state_dict(d["model"])
        print(sorted(d), d["step"], d["epoch"], d["extra_state"]["scheduler"]["last_epoch"])
    """)
    # -I: no PYTHONPATH, no user site, no current directory: a machine without eltctl
    done = subprocess.run([HOST_PYTHON, "-I", "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "['epoch', 'extra_state', 'model', 'optimizer', 'step'] 4 2 5"

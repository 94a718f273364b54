"""An aborted generation stops the forward pass of the script's loss function
(ElasticJob._forward_abortable), as a gradient hook stops backward."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from eltctl_runtime.member.collectives import Aborted
from eltctl_runtime.train.job import ElasticJob


class Counting(torch.nn.Module):
    def __init__(self, abort: threading.Event, at: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(6))
        self.ran, self._abort, self._at = 0, abort, at

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == self._at:
                self._abort.set()  # the control thread's abort arrives while layer i-1 has run
            x = layer(x)
            self.ran += 1
        return x


def job_at(abort: threading.Event, mb_left: int = 1, compiled: bool = False) -> ElasticJob:
    """The parts of a job in a generation that _forward_abortable reads."""
    job = ElasticJob.__new__(ElasticJob)
    job._session = SimpleNamespace(gen=SimpleNamespace(abort=abort),  # its MemberSession's
                                   control=SimpleNamespace(abort_reason=lambda: '{"reason": "crash"}'))
    job._mb_left, job._compiled = mb_left, compiled
    return job


def test_an_abort_stops_the_last_micro_batchs_forward_at_the_next_module_and_leaves_no_hook():
    abort = threading.Event()
    model = Counting(abort, at=2)
    with pytest.raises(Aborted, match="aborted during forward"):
        with job_at(abort)._forward_abortable():
            model(torch.randn(2, 4))
    assert model.ran == 2  # the layers after the abort did not run
    assert not torch.nn.modules.module._global_forward_pre_hooks  # the hook was for the call only
    model.ran = 0
    model(torch.randn(2, 4))  # outside the job's call nothing is stopped
    assert model.ran == 6


@pytest.mark.parametrize("mb_left, compiled", [(2, False), (1, True)])
def test_an_earlier_micro_batch_or_a_compiled_model_runs_its_forward_to_the_end(mb_left, compiled):
    """Before the last micro-batch a dropped step is found at the end of the step (as in
    backward); a compiled model gets no global hook (torch.compile warns of them)."""
    abort = threading.Event()
    model = Counting(abort, at=2)
    with job_at(abort, mb_left, compiled)._forward_abortable():
        model(torch.randn(2, 4))
    assert model.ran == 6

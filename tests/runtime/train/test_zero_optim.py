"""Which optimizers shard (train/zero/optim.py)."""

from __future__ import annotations

import pytest
import torch

from zero_ranks import members

from eltctl_runtime.train.zero import ShardedGradients, shard_layout


class SGDWithATwist(torch.optim.SGD):
    """A subclass may change step(): refused like any other optimizer."""


def test_an_unsupported_optimizer_is_refused_naming_the_supported_ones():
    model = torch.nn.Linear(2, 2)
    params = list(model.parameters())
    opt = SGDWithATwist(params, lr=0.1)
    with pytest.raises(ValueError, match="supports AdamW, Adam, SGD, RMSprop, Adamax, RAdam, Adadelta .*got SGDWithATwist"):
        ShardedGradients(params, opt, shard_layout(params, opt, members("a")), 0)
    for opt, why in ((torch.optim.Adagrad(params), "made when it is built"),
                     (torch.optim.NAdam(params), "mu_product"),
                     (torch.optim.Adam(params, capturable=True), "capturable=True"),
                     (torch.optim.RMSprop(params, foreach=False, differentiable=True), "differentiable=True")):
        with pytest.raises(ValueError, match=why):
            ShardedGradients(params, opt, shard_layout(params, opt, members("a")), 0)

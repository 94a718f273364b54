"""The training job: `ElasticJob` (`job`) and its concerns beside it: the control
tail's layout (`tail`), what a step boundary owes (`boundary`), this rank's share
of each step (`shares`), checkpoints as the job takes them (`checkpoints`), the
state's agreement at each generation (`agreement`), one step's parts (`step`), a
membership change's pause (`pause`); the gradient paths (`gradients`),
speed-proportional shares (`balance`), the elastic sampler (`sampler`), the
input pipeline (`pipeline`), the training state as data (`state`), and sharded
optimizer state (`zero/`). Needs torch.
"""

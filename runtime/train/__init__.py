"""The training job: `ElasticJob` (`job`), the gradient paths (`gradients`),
speed-proportional shares (`balance`), the elastic sampler (`sampler`), the
input pipeline (`pipeline`), the training state as data (`state`), and sharded
optimizer state (`zero/`). Needs torch.
"""

"""Sharded optimizer state (ZeRO-1 and ZeRO-2) whose shards move live between members
(docs/sharding.md).

One module per concern:

- `optim`: which optimizers shard, and the state they keep per parameter;
- `layout` (pure): which rank holds which chunk of which bucket (`plan_shards`), and a
  rank's `Placement` in it;
- `buffers`, `reducer`, `stepper`: the three collaborators one rank's `ShardedGradients`
  (`sharded`) holds: `ShardBuffers` (its buffers, views and optimizer state), `Reducer`
  (the gradient reduction), `Stepper` (the step);
- `sharded`: `ShardedGradients` and its state in and out (state dicts, checkpoint parts);
- `resharding`: the transfer plan (pure) and the live move of the shards;
- `prepare`: host memory touched ahead of a move (`MemoryPreparation`); `hostmem`: carving it;
- `path`: `ShardedPath`, the job's sharded gradient path.
- `checkpoint`: sharded checkpoints (each rank's shard file, the restore of its chunks).

The public names are importable from here (`from eltctl_runtime.train.zero import
ShardedPath`). They are looked up on first use, not imported with the package:
`train/gradients.py` imports `hostmem` from here, and this package's modules import
`train/gradients.py` (an import at the top would be circular), and a replicated job
does not pay for importing the sharded path.
"""

from __future__ import annotations

from typing import Any

# public name -> its module
_EXPORTS = {
    "SHARD_MODES": "optim", "SUPPORTED_OPTIMIZERS": "optim", "check_optimizer": "optim",
    "counts_steps": "optim", "state_names": "optim", "step_tensor": "optim",
    "Member": "layout", "ShardBucket": "layout", "ShardLayout": "layout", "place_replicas": "layout",
    "plan_shards": "layout", "shard_layout": "layout", "member_of": "layout",
    "PAD_QUANTUM": "layout", "PAD_MIN_QUANTA": "layout",
    "StepResult": "stepper",
    "FORMAT": "sharded", "SHARD_FILE_FORMAT": "sharded", "ShardedGradients": "sharded",
    "checkpoint_shard": "sharded", "checkpoint_layout": "sharded", "checkpoint_param_groups": "sharded",
    "checkpoint_chunks_needed": "sharded", "load_checkpoint_chunks": "sharded",
    "ShardsLost": "resharding", "Segment": "resharding", "plan_transfers": "resharding", "reshard": "resharding",
    "ShardedPath": "path", "sharded_path": "path",
    "Recycler": "hostmem",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import hostmem, layout, optim, path, resharding, sharded, stepper

    module = {"hostmem": hostmem, "layout": layout, "optim": optim, "path": path, "resharding": resharding,
              "sharded": sharded, "stepper": stepper}[where]
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

"""Checkpoints on a worker's local disk: atomic, self-verifying, loadable
without eltctl. Standard library only at import (torch on first use): the
control side's mirror reads and copies them.

`format` (the on-disk layout, names, manifest, hashing and verification),
`store` (`CheckpointStore`: atomic writes on a background thread, retention,
listing), `load` (a checkpoint's state, the restore's choice, another rank's
restore taken up, `load_checkpoint` / `export_checkpoint`). Sharded optimizer
state's checkpoints (process groups, torch) are runtime/train/zero/checkpoint.py.
"""

"""Restart mode: an unmodified torchrun script under eltctl's membership.

`python -m eltctl_runtime.restart -- <command>` runs the supervisor
(`supervisor`); the script's output is watched (`watch`), its checkpoint
directory snapshotted (`snapshots`), its next generation started in a warm
interpreter (`warmstart`); `progress` is what a script may tell eltctl
(standard library only: the control side imports it, so this package's top
imports nothing).
"""

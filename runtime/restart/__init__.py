"""Restart mode: an unmodified torchrun script under eltctl's membership.

`python -m eltctl_runtime.restart -- <command>` runs the supervisor
(`supervisor`: a member of the job through member/session.py's
`MemberSession`, like an ElasticJob worker); the script's process, its
torchrun environment and its rendezvous store are `launch`; its output is
watched (`watch`), its checkpoint directory snapshotted (`snapshots`) and the
snapshots held, saved and restored (`keeper`), its next generation started in
a warm interpreter (`warmstart`); `progress` is what a script may tell eltctl
(standard library only: the control side imports it, so this package's top
imports nothing).
"""

"""The controller: one long-lived process per job that keeps it running.

`python -m eltctl.controller --inventory PATH` (started detached by `eltctl up`)
holds the job's lock, keeps its store keeper alive, and reconciles (`loop.py`):
observe the store and the hosts (`observe.py`, pure views), decide with the pure
policy (`policy.py`), act on the store and over SSH (`act.py`), and write the status
document (`status.py`). `client.py` is the side the CLI commands use (no torch). The
processes, files and messages are in docs/control-plane.md. Importing this package
imports nothing.
"""

"""Callbacks that make the training frameworks people use lose nothing at a restart.

Restart mode (restart/supervisor.py) stops a script with SIGTERM at every membership change
and gives it `stop_grace` seconds to save. Hugging Face `Trainer` and PyTorch
Lightning do not save on SIGTERM, so without help each owner yield costs them up
to a whole save interval. One module per framework, each imported only by the
user (importing this package imports neither framework):

- `eltctl_runtime.integrations.hf`: `EltctlCallback` (a `TrainerCallback`) and
  `last_checkpoint(output_dir)`;
- `eltctl_runtime.integrations.lightning`: `EltctlCallback` (a Lightning
  `Callback`), `last_checkpoint(dirpath)` and `trainer_kwargs()`.

Each callback, on every rank: turns SIGTERM into a flag; at each optimizer
step's end agrees with the other ranks on it (one all-reduce of one integer: the
ranks stop after the same step, and the frameworks' saves, which hold
collectives, line up); on a stop saves at once, tells the supervisor about the
checkpoint (`eltctl_runtime.checkpoint_saved`) and exits with status 143
(stopped by SIGTERM, state saved). It reports progress
(`eltctl_runtime.report`) and every checkpoint the framework saves. Outside
eltctl the reports are no-ops and the SIGTERM save still works (a preemption).
See docs/integrations.md.
"""

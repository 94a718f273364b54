"""A warm interpreter for restart mode: torch imported before the script is known.

Most of a restarted torchrun script's start-up is the interpreter's and
`import torch` (seconds; more on a loaded host). The restart supervisor
(restart/supervisor.py) therefore starts the next generation's process ahead of time as
`python -m eltctl_runtime.restart.warmstart FD READY_FD`: it imports torch, writes one
byte to READY_FD (the supervisor joins the job only once it is warm) and waits. When the
generation starts, the supervisor writes one JSON line to the pipe FD::

    {"argv": ["train.py", "--lr", "0.1"], "module": false, "env": {...}}

and this process takes the environment (torchrun's variables included: torch
reads them when the script calls init_process_group, and CUDA only reads
CUDA_VISIBLE_DEVICES when it first initialises, which importing torch does not),
sets sys.argv and sys.path[0] as `python train.py ...` (or `python -m mod ...`)
would, and runs the script as `__main__` with runpy. The script is unchanged;
its exit status is the process's.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
from typing import Sequence

_PYTHON = re.compile(r"python[\d.]*$")


def import_torch() -> None:
    """What a warm interpreter imports ahead (here, and in the daemon's and the restart
    supervisor's fork server, daemon/zygote.py): torch and what scripts import first."""
    import torch  # noqa: F401 - the point of this process
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.utils.data  # noqa: F401
    try:  # torch's optimizers (Optimizer.add_param_group) and DistributedDataParallel's constructor
        # import these at their first call (about 1.5 CPU-s here): not on the pause
        import torch._dynamo  # noqa: F401
        import torch.fx.experimental.symbolic_shapes  # noqa: F401
    except ImportError:  # pragma: no cover - another torch version
        pass


def main() -> None:
    fd, ready = int(sys.argv[1]), int(sys.argv[2])
    import_torch()  # nothing to do where a fork server's fork runs this
    try:
        os.write(ready, b"1")
        os.close(ready)
    except OSError:
        pass
    with os.fdopen(fd, "rb") as pipe:
        line = pipe.readline()
    if not line:
        sys.exit(0)  # the supervisor went away or does not need this process
    spec = json.loads(line)
    os.environ.clear()
    os.environ.update(spec["env"])
    run_script(list(spec["argv"]), module=bool(spec.get("module")))


def warm_form(argv: Sequence[str]) -> tuple[str, list[str], bool] | None:
    """(interpreter, the script's argv, whether it is `-m module`) when `argv` is
    `python script.py ...` or `python -m module ...` (no interpreter options), the
    forms a warm interpreter (warmstart.py) can run; None otherwise."""
    if len(argv) < 2 or not _PYTHON.match(os.path.basename(argv[0])):
        return None
    if argv[1] == "-m":
        return (argv[0], list(argv[2:]), True) if len(argv) > 2 else None
    if argv[1].startswith("-"):
        return None
    return argv[0], list(argv[1:]), False


def run_script(argv: list[str], module: bool) -> None:
    """Run `argv` (a script and its arguments, or with `module` a module's name and its
    arguments) as `__main__`, with sys.argv and sys.path[0] as `python argv...` (or
    `python -m argv...`) sets them. The daemon's fork server (daemon/zygote.py) runs its
    workers through this too."""
    if module:
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The GPU checks (tests/gpu/), for a machine with one NVIDIA GPU: the real nvidia-smi, a
# CUDA build of torch (>= 2.6) and typer, rich and pytest for the python that runs them
# (PYTHON, default python3). It needs no network and no SSH server: the host is this
# machine (`address = "local"`). Usage: bash scripts/gpu-check.sh [pytest args]
#
# What it checks, in order, on one job: the probe reads the GPU through the real
# nvidia-smi; `eltctl up` trains on it with NCCL; a CUDA process of another user
# (`nobody`, when run as root) appearing on the GPU makes our worker leave and release
# its memory (the time is printed); the job resumes when the owner has gone; `down`
# takes a final checkpoint and `up` restores it; nothing is left running. Then restart
# mode on NCCL (examples/ddp_restart.py, unmodified) through an owner yield: it resumes at
# the step it stopped at; and examples/train_real.py with fp16 autocast and its GradScaler
# on CUDA through a yield, a resume and `eltctl checkpoints export`. Last, sharded training
# (issue 22) at world 1 on NCCL: replicated, ZeRO-2 and ZeRO-1 three times, each ending at
# replicated's loss and parameters, with each run's CUDA peak printed. Events are waited
# for, not asserted the instant the GPU is free. A few minutes in all (under 5).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

command -v nvidia-smi >/dev/null || { echo "gpu-check: nvidia-smi is not on PATH (no NVIDIA driver here?)" >&2; exit 2; }
nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv
"$PY" - <<'PYEOF' || exit 2
import sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}")
if not torch.cuda.is_available():
    sys.exit("gpu-check: torch does not see a GPU (a CPU build of torch, or no driver)")
print(f"device 0: {torch.cuda.get_device_name(0)}")
PYEOF
for m in typer rich pytest; do
  "$PY" -c "import $m" 2>/dev/null || { echo "gpu-check: $PY cannot import $m: pip install $m" >&2; exit 2; }
done

# eltctl from this checkout without installing it: the repository root for `eltctl`, and
# a directory where `eltctl_runtime` is the runtime/ folder (as an installed eltctl has it).
shim=build/gpu-check
mkdir -p "$shim"
ln -sfn "$PWD/runtime" "$shim/eltctl_runtime"
export PYTHONPATH="$PWD:$PWD/$shim${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" -m pytest -v -s -p no:cacheprovider tests/gpu "$@"

#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run `eltctl demo`: the real system on this
# machine with no SSH server (local hosts with simulated GPUs). Extra arguments go to
# `eltctl demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/eltctl demo "$@"

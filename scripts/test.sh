#!/usr/bin/env bash
# Set up (scripts/setup.sh --sshd) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --sshd
exec .venv/bin/python -m pytest -q -ra "$@"

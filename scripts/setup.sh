#!/usr/bin/env bash
# Set up a development environment in ./.venv: torch 2.13.0 (CPU build where that is
# what the machine has), eltctl itself (editable) and its test tools; and ./.venv-host,
# the interpreter the test bed's simulated hosts run the runtime with: what
# `pip install torch==2.13.0` leaves on a lab host, nothing more (no numpy). With --sshd it
# also installs Debian's openssh-server/openssh-client when missing (the multi-host
# tests start real sshd servers on loopback). Idempotent: a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."

want_sshd=0
[ "${1:-}" = "--sshd" ] && want_sshd=1

if [ "$want_sshd" = 1 ] && { [ ! -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null || ! command -v ssh-keygen >/dev/null; }; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing openssh-server and openssh-client (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends openssh-server openssh-client procps >/dev/null
  else
    echo "setup: sshd is missing; install it with: sudo apt-get install openssh-server openssh-client" >&2
    echo "setup: (the tests that need it will be skipped)" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }; }

# torch first, pinned: an open `torch` requirement would pull several GB of CUDA
# packages onto a CPU machine. Nothing later asks for torch in a way 2.13.0 misses.
if ! .venv/bin/python -c 'import importlib.metadata as m; assert m.version("torch").startswith("2.13.0")' 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  pip install "torch==2.13.0"
fi
echo "setup: installing eltctl (editable) with its test tools"
pip install -e '.[test]'

# The simulated hosts' interpreter: Python and torch only, as on a lab host.
if [ ! -x .venv-host/bin/python ]; then
  echo "setup: creating .venv-host (Python and torch only, for the simulated hosts)"
  "$PY" -m venv .venv-host
fi
if ! .venv-host/bin/python -c 'import importlib.metadata as m; assert m.version("torch").startswith("2.13.0")' 2>/dev/null; then
  echo "setup: installing torch==2.13.0 into .venv-host"
  .venv-host/bin/python -m pip --disable-pip-version-check -q install "torch==2.13.0" 2>&1 | { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }
fi
echo "setup: ready (.venv/bin/eltctl)"

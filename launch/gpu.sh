#!/usr/bin/env bash
# Run the trainer (or any workflow_r1 entry point) on one host with all its local GPUs.
#
#   bash launch/gpu.sh --config=configs/gsspo.py:paper --config.model.checkpoint=/models/Qwen2.5-7B-Instruct \
#       --config.executor.url=http://localhost:8000 --config.data.train_files=data/train_10k.jsonl --workdir=runs/paper \
#       --config.rollout.max_rows_in_flight=32
#
# (32 rows in flight: off TPU every GPU holds the paper preset's whole KV page pool, 129.5 GiB at
# its 256 rows; docs/replicate.md.)
# One process drives every GPU that CUDA_VISIBLE_DEVICES shows (default: all); the mesh is the
# config's (mesh.data / mesh.fsdp / mesh.tensor; -1 data = all devices left after fsdp x
# tensor). GPU memory is preallocated up to XLA_PYTHON_CLIENT_MEM_FRACTION (default here 0.9;
# leave room if the executor's vLLM shares the GPUs, e.g. 0.45, or give vLLM its own GPUs).
#
# Environment: PYTHON (default .venv/bin/python); MODULE (default workflow_r1.train; e.g.
# workflow_r1.evaluate); SETUP=1 first installs requirements.txt with jax[cuda12] into .venv;
# DRY_RUN=1 prints the command and its environment instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
MODULE="${MODULE:-workflow_r1.train}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
# Overlap collectives with compute (FSDP all-gathers) on GPU.
export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true}"
cmd=("$PYTHON" -m "$MODULE" "$@")
if [ "${DRY_RUN:-0}" = "1" ]; then
  echo "XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION XLA_FLAGS=$XLA_FLAGS" \
       "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}"
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
if [ "${SETUP:-0}" = "1" ]; then
  jax_version="$(sed -n 's/^jax==\([0-9.]*\).*/\1/p' requirements.txt)"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/pip install -q -r requirements.txt "jax[cuda12]==$jax_version"
fi
exec "${cmd[@]}"

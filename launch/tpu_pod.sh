#!/usr/bin/env bash
# Run the trainer (or any workflow_r1 entry point) on every worker of a TPU VM slice at once.
#
#   TPU_NAME=wr1-v5p-64 ZONE=us-east5-a bash launch/tpu_pod.sh --config=configs/gsspo.py:paper \
#       --config.model.checkpoint=/mnt/models/Qwen2.5-7B-Instruct --config.executor.url=http://10.0.0.5:8000 \
#       --config.data.train_files=/mnt/data/train_10k.jsonl --workdir=gs://my-bucket/runs/paper-gsspo
#
# Every worker runs `python -m $MODULE <the arguments>` in $REPO_DIR through
# `gcloud compute tpus tpu-vm ssh --worker=all`; WORKFLOW_R1_DISTRIBUTED=1 makes each process call
# jax.distributed.initialize(), which reads the slice's topology from the TPU environment, and the
# mesh is the config's (mesh.data / mesh.fsdp / mesh.tensor; -1 data = all devices left).
# The checkout, the model directory and the data must exist on every worker (same paths), and the
# work directory must be shared (a gs:// bucket or NFS) for checkpoints.
#
# Preemptible (spot) slices: on the preemption notice (SIGTERM) every worker stops at the same safe
# point, the run saves its progress, prints one line ("preempted: ... rerun the same command to resume
# at step N") and exits 0. Restart with this same command, on the recreated slice or a new one: the
# run resumes from the newest checkpoint in --workdir exactly (docs/replicate.md, "Preemptible (spot)
# slices"). A wrapper that reruns the command until it exits 0 with summary.json in --workdir, or a
# queued resource / GKE job restarted on preemption, needs nothing else.
#
# Environment: TPU_NAME, ZONE (required); PROJECT (gcloud project, optional); REPO_DIR (the checkout
# on the workers, default ~/workflow-r1); PYTHON (default .venv/bin/python); MODULE (default
# workflow_r1.train; e.g. workflow_r1.evaluate); SETUP=1 first creates the venv on every worker and
# installs requirements-tpu.txt (the runtime, jax[tpu], and gcsfs + google-cloud-storage for a gs://
# work directory); DRY_RUN=1 prints the gcloud command instead of running it.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
: "${ZONE:?set ZONE to the TPU VM zone}"
REPO_DIR="${REPO_DIR:-~/workflow-r1}"
PYTHON="${PYTHON:-.venv/bin/python}"
MODULE="${MODULE:-workflow_r1.train}"

args=""
for a in "$@"; do args+=" $(printf '%q' "$a")"; done
remote="cd $REPO_DIR && "
if [ "${SETUP:-0}" = "1" ]; then
  remote+="(test -x .venv/bin/python || python3 -m venv .venv) && .venv/bin/pip install -q -r requirements-tpu.txt && "
fi
remote+="WORKFLOW_R1_DISTRIBUTED=1 $PYTHON -m $MODULE$args"

cmd=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" "--zone=$ZONE" --worker=all "--command=$remote")
if [ -n "${PROJECT:-}" ]; then cmd+=("--project=$PROJECT"); fi
if [ "${DRY_RUN:-0}" = "1" ]; then
  echo "on every worker of $TPU_NAME: $remote"
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"

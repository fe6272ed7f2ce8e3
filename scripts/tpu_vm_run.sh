#!/usr/bin/env bash
# Train on every worker of a TPU VM at once (`--worker=all`): the same command on each host, as
# multi-host JAX requires. On a Cloud TPU `jax.distributed.initialize()` finds the coordinator and
# the process ids by itself, so nothing host-specific is passed.
#
# Logs: gcloud streams each worker's stdout+stderr into LOG_DIR/<worker>.log on this machine
# (`--output-directory`) while the run goes; follow them with `tail -f LOG_DIR/0.log`.
# Checkpoints: the work directory is a gs:// path; orbax writes checkpoints there directly from
# every host (no local disk, no copy step), and running again with the same WORKDIR resumes, e.g.
# after a Spot preemption.
#
# Usage:
#   BUCKET=my-bucket scripts/tpu_vm_run.sh [--dry-run] [-- --config.rl.max_staleness=2 ...]
#   CONFIG=configs/gsm8k_grpo.py:size=small RUN_NAME=gsm8k-1 BUCKET=my-bucket scripts/tpu_vm_run.sh
#
# Settings (environment variables):
#   PROJECT, ZONE, TPU_NAME  as for tpu_vm_create.sh
#   BUCKET      GCS bucket for the work directory (required unless WORKDIR is set)
#   CONFIG      config file[:variant] relative to the repository (default: configs/addition_grpo.py)
#   RUN_NAME    run name (default: <config name>-<UTC time>)
#   WORKDIR     work directory (default: gs://$BUCKET/tunixlike/$RUN_NAME)
#   LOG_DIR     local directory for the per-worker logs (default: logs/$RUN_NAME)
#   REMOTE_DIR, VENV  as for tpu_vm_setup.sh (defaults: ~/tunixlike, ~/tunixlike-venv)
#   Arguments after `--` are passed on to `python -m tunixlike.train` (config overrides).
#
# Options:
#   --dry-run   print the commands instead of running them
#   -h, --help  this text
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
parse_common_args "$@"

ZONE="${ZONE:-us-central2-b}"
TPU_NAME="${TPU_NAME:-tunixlike-tpu}"
CONFIG="${CONFIG:-configs/addition_grpo.py}"
CONFIG_NAME="$(basename "${CONFIG%%:*}" .py)"
RUN_NAME="${RUN_NAME:-$CONFIG_NAME-$(date -u +%Y%m%d-%H%M%S)}"
if [[ -z "${WORKDIR:-}" ]]; then
  require BUCKET
  WORKDIR="gs://${BUCKET#gs://}/tunixlike/$RUN_NAME"
fi
LOG_DIR="${LOG_DIR:-logs/$RUN_NAME}"
REMOTE_DIR="${REMOTE_DIR:-~/tunixlike}"
VENV="${VENV:-~/tunixlike-venv}"
require ZONE TPU_NAME CONFIG RUN_NAME WORKDIR LOG_DIR
gcloud_scope_flags

TRAIN=("$VENV/bin/python" -m tunixlike.train --config="$CONFIG" --workdir="$WORKDIR" "${EXTRA_ARGS[@]}")
TRAIN_LINE=""
for word in "${TRAIN[@]}"; do
  case "$word" in
    "~/"*) TRAIN_LINE+=" $word" ;;  # keep ~ unquoted so the worker's shell expands it
    *) TRAIN_LINE+=" $(_quote "$word")" ;;
  esac
done

run mkdir -p "$LOG_DIR"  # gcloud requires the directory to exist
echo "# Logs: $LOG_DIR/<worker>.log    Work directory: $WORKDIR"
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_SCOPE[@]}" --worker=all \
  --output-directory="$LOG_DIR" --command="cd $REMOTE_DIR &&$TRAIN_LINE 2>&1"

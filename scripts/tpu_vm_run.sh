#!/usr/bin/env bash
# Train on every worker of a TPU VM at once (`--worker=all`): the same command on each host, as
# multi-host JAX requires. On a Cloud TPU `jax.distributed.initialize()` finds the coordinator and
# the process ids by itself, so nothing host-specific is passed.
#
# Whole workers per side (the by-host layout: SAMPLER_HOSTS=N, or --config.mesh.sampler_hosts=N
# after `--`): the last N workers decode, the others train, and the weights cross by cross-host
# `jax.device_put`, whose transfer server needs each process's address before JAX starts. So each
# worker first reads its id and worker 0's address from the TPU metadata server (as JAX's own
# detection does) and exports JAX_COORDINATOR_ADDRESS (worker 0, port PORT), JAX_NUM_PROCESSES and
# JAX_PROCESS_ID; worker i's transfer server listens on PORT + 1 + i.
#
# Logs: gcloud streams each worker's stdout+stderr into LOG_DIR/<worker>.log on this machine
# (`--output-directory`) while the run goes; follow them with `tail -f LOG_DIR/0.log`.
# Checkpoints: the work directory is a gs:// path; orbax writes checkpoints there directly from
# every host (no local disk, no copy step), and running again with the same WORKDIR resumes, e.g.
# after a Spot preemption.
#
# Usage:
#   BUCKET=my-bucket scripts/tpu_vm_run.sh [--dry-run] [-- --config.rl.max_staleness=2 ...]
#   CONFIG=gsm8k_grpo RUN_NAME=gsm8k-1 BUCKET=my-bucket scripts/tpu_vm_run.sh -- --config.model.hf_path=...
#
# Settings (environment variables):
#   PROJECT, ZONE, TPU_NAME  as for tpu_vm_create.sh
#   BUCKET      GCS bucket for the work directory (required unless WORKDIR is set)
#   CONFIG      a shipped config's name[:variant] (python -m tunixlike.train --list_configs), or a config
#               file relative to the repository's copy in REMOTE_DIR (default: addition_grpo)
#   RUN_NAME    run name (default: <config name>-<UTC time>)
#   WORKDIR     work directory (default: gs://$BUCKET/tunixlike/$RUN_NAME)
#   LOG_DIR     local directory for the per-worker logs (default: logs/$RUN_NAME)
#   REMOTE_DIR, VENV  as for tpu_vm_setup.sh (defaults: ~/tunixlike, ~/tunixlike-venv)
#   SAMPLER_HOSTS  workers that only decode (default 0: every worker both, the per-host split)
#   PORT        the coordinator's port on worker 0 in the by-host layout (default: 8482)
#   TUNIXLIKE_HOSTS_SECRET_FILE  the by-host layout's secret (default: LOG_DIR/hosts_secret, drawn for
#               the run), copied to every worker as ~/.tunixlike_hosts_secret (mode 600)
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
CONFIG="${CONFIG:-addition_grpo}"
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
by_host_layout
PORT="${PORT:-8482}"
[[ "$PORT" =~ ^[1-9][0-9]*$ ]] || die "PORT='$PORT' is not a port number"

# From REMOTE_DIR, so that a config file's path is relative to the repository's copy; -P keeps that
# directory off sys.path, so the installed package runs, not the copy's tunixlike/.
TRAIN=("$VENV/bin/python" -P -m tunixlike.train --config="$CONFIG" --workdir="$WORKDIR" "${EXTRA_ARGS[@]}")
TRAIN_LINE=""
for word in "${TRAIN[@]}"; do
  case "$word" in
    "~/"*) TRAIN_LINE+=" $word" ;;  # keep ~ unquoted so the worker's shell expands it
    *) TRAIN_LINE+=" $(_quote "$word")" ;;
  esac
done

SETUP=""
if ((SAMPLER_HOSTS > 0)); then
  # Runs on each worker: its id, and worker 0's address from the list of workers (entries are
  # hostnames, or name:id:ip in older images).
  # shellcheck disable=SC2016
  SETUP='M=http://metadata.google.internal/computeMetadata/v1/instance/attributes;'
  SETUP+=' ID=$(curl -sf -H Metadata-Flavor:Google $M/agent-worker-number) &&'
  SETUP+=' EPS=$(curl -sf -H Metadata-Flavor:Google $M/worker-network-endpoints) &&'
  SETUP+=' FIRST=${EPS%%,*} && COMMAS=${EPS//[^,]/} &&'
  SETUP+=' export JAX_COORDINATOR_ADDRESS=${FIRST##*:}:'"$PORT"' JAX_NUM_PROCESSES=$((${#COMMAS} + 1))'
  SETUP+=' JAX_PROCESS_ID=$ID &&'
  SETUP+=' chmod 600 ~/.tunixlike_hosts_secret; export TUNIXLIKE_HOSTS_SECRET_FILE=~/.tunixlike_hosts_secret &&'
fi

run mkdir -p "$LOG_DIR"  # gcloud requires the directory to exist
if ((SAMPLER_HOSTS > 0)); then  # the run's secret, on every worker (never on a command line)
  SECRET="${TUNIXLIKE_HOSTS_SECRET_FILE:-$LOG_DIR/hosts_secret}"
  [[ -f "$SECRET" ]] || run bash -c "umask 077 && head -c 32 /dev/urandom | base64 > $(_quote "$SECRET")"
  run gcloud compute tpus tpu-vm scp "$SECRET" "$TPU_NAME:.tunixlike_hosts_secret" "${GCLOUD_SCOPE[@]}" --worker=all
fi
echo "# Logs: $LOG_DIR/<worker>.log    Work directory: $WORKDIR"
print_roles
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_SCOPE[@]}" --worker=all \
  --output-directory="$LOG_DIR" --command="cd $REMOTE_DIR &&${SETUP:+ $SETUP}$TRAIN_LINE 2>&1"

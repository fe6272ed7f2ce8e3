#!/usr/bin/env bash
# Create a Cloud TPU VM: one host (v4-8, v5litepod-8, v6e-8) or a pod slice of several hosts
# (v4-16, v5p-16, v5litepod-16, ...). A pod slice is one TPU "node" whose workers all run the
# same program; tpu_vm_setup.sh and tpu_vm_run.sh address them together with --worker=all.
#
# Usage:
#   scripts/tpu_vm_create.sh [--dry-run]
#   TPU_NAME=rl-pod ACCELERATOR_TYPE=v4-16 scripts/tpu_vm_create.sh
#   QUEUED=1 SPOT=1 ACCELERATOR_TYPE=v5p-16 ZONE=us-east5-a scripts/tpu_vm_create.sh
#
# Settings (environment variables):
#   PROJECT           GCP project (default: gcloud's configured project)
#   ZONE              zone that has the accelerator (default: us-central2-b, where v4 lives)
#   TPU_NAME          name of the TPU VM / node (default: tunixlike-tpu)
#   ACCELERATOR_TYPE  v4-8, v4-16, v5litepod-8, v5p-16, v6e-8, ... (default: v4-8)
#   RUNTIME_VERSION   TPU software version (default from ACCELERATOR_TYPE: v4 and older
#                     tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5,
#                     v6e v2-alpha-tpuv6e)
#   QUEUED=1          request through the queued-resources API (waits for capacity instead of
#                     failing when none is free; recommended by Google for larger slices)
#   QUEUED_RESOURCE   queued-resource id (default: $TPU_NAME-qr)
#   SPOT=1            Spot capacity (cheaper, preemptible: training resumes from the last checkpoint)
#
# Options:
#   --dry-run   print the gcloud commands instead of running them
#   -h, --help  this text
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
parse_common_args "$@"

ZONE="${ZONE:-us-central2-b}"
TPU_NAME="${TPU_NAME:-tunixlike-tpu}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-8}"
QUEUED="${QUEUED:-0}"
QUEUED_RESOURCE="${QUEUED_RESOURCE:-$TPU_NAME-qr}"
SPOT="${SPOT:-0}"

if [[ -z "${RUNTIME_VERSION:-}" ]]; then
  case "$ACCELERATOR_TYPE" in
    v6e-*) RUNTIME_VERSION=v2-alpha-tpuv6e ;;
    v5p-*) RUNTIME_VERSION=v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) RUNTIME_VERSION=v2-alpha-tpuv5-lite ;;
    v2-* | v3-* | v4-*) RUNTIME_VERSION=tpu-ubuntu2204-base ;;
    *) die "ACCELERATOR_TYPE='$ACCELERATOR_TYPE' is not one of v2-*, v3-*, v4-*, v5litepod-*, v5p-*, v6e-*; set RUNTIME_VERSION too" ;;
  esac
fi
require ZONE TPU_NAME ACCELERATOR_TYPE RUNTIME_VERSION
gcloud_scope_flags

OPTIONAL=()
if [[ "$SPOT" == 1 ]]; then
  OPTIONAL+=(--spot)
fi

if [[ "$QUEUED" == 1 ]]; then
  run gcloud compute tpus queued-resources create "$QUEUED_RESOURCE" "${GCLOUD_SCOPE[@]}" \
    --node-id="$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" \
    --runtime-version="$RUNTIME_VERSION" "${OPTIONAL[@]}"
  echo "# Queued. Wait for state ACTIVE before tpu_vm_setup.sh:"
  echo "#   gcloud compute tpus queued-resources describe $QUEUED_RESOURCE --zone=$ZONE"
else
  run gcloud compute tpus tpu-vm create "$TPU_NAME" "${GCLOUD_SCOPE[@]}" \
    --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${OPTIONAL[@]}"
fi
echo "# Next: TPU_NAME=$TPU_NAME ZONE=$ZONE scripts/tpu_vm_setup.sh"
echo "# Delete when done: gcloud compute tpus tpu-vm delete $TPU_NAME --zone=$ZONE"

#!/usr/bin/env bash
# Install tunixlike on every worker of a TPU VM (one host or a pod slice), then check that JAX sees
# the TPU. Every step runs on all workers at once (`--worker=all`): on a pod slice each host needs
# the same code and packages, and the TPU runtime only comes up when all hosts start together.
#
# The code comes either from git (REPO_URL) or, by default, from this checkout: it is packed into
# a tarball (without .git, runs/ and caches) and copied to every worker with `tpu-vm scp`. Either
# way it lands in REMOTE_DIR and is installed from there as a package (not editable): the run
# imports the installed tunixlike, with its shipped configs (`CONFIG=addition_grpo`), and
# REMOTE_DIR keeps the repository's files for configs and data of your own.
# The TPU VM images ship Python 3.10 and tunixlike needs >= 3.11, so a venv is built with
# python$PYTHON_VERSION (from the deadsnakes PPA when the image lacks it).
#
# Usage:
#   TPU_NAME=rl-pod ZONE=us-central2-b scripts/tpu_vm_setup.sh [--dry-run]
#   REPO_URL=https://github.com/you/tunixlike.git REPO_REF=main scripts/tpu_vm_setup.sh
#
# Settings (environment variables):
#   PROJECT, ZONE, TPU_NAME  as for tpu_vm_create.sh (defaults: gcloud's project, us-central2-b,
#                            tunixlike-tpu)
#   REPO_URL          git URL to clone on the workers (default: empty = copy this checkout)
#   REPO_REF          branch or tag for REPO_URL (default: main)
#   REMOTE_DIR        where the code lives on the workers (default: ~/tunixlike)
#   VENV              virtualenv on the workers (default: ~/tunixlike-venv)
#   PYTHON_VERSION    Python for the venv (default: 3.11)
#   JAX_TPU_INDEX     pip -f URL for libtpu wheels, as in the JAX installation guide (default:
#                     https://storage.googleapis.com/jax-releases/libtpu_releases.html; recent
#                     libtpu releases are also on PyPI, set it empty to use PyPI only)
#   EXTRA_PIP         extra packages (default: gcsfs, so gs:// work directories work everywhere)
#
# Options:
#   --dry-run   print the commands instead of running them
#   -h, --help  this text
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
parse_common_args "$@"

ZONE="${ZONE:-us-central2-b}"
TPU_NAME="${TPU_NAME:-tunixlike-tpu}"
REPO_URL="${REPO_URL:-}"
REPO_REF="${REPO_REF:-main}"
REMOTE_DIR="${REMOTE_DIR:-~/tunixlike}"
VENV="${VENV:-~/tunixlike-venv}"
PYTHON_VERSION="${PYTHON_VERSION:-3.11}"
JAX_TPU_INDEX="${JAX_TPU_INDEX-https://storage.googleapis.com/jax-releases/libtpu_releases.html}"
EXTRA_PIP="${EXTRA_PIP-gcsfs}"
require ZONE TPU_NAME REMOTE_DIR VENV PYTHON_VERSION
gcloud_scope_flags
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SSH=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_SCOPE[@]}" --worker=all)

# 1. Code on every worker.
if [[ -n "$REPO_URL" ]]; then
  run "${SSH[@]}" --command="set -e; if [ -d $REMOTE_DIR/.git ]; then git -C $REMOTE_DIR fetch --depth 1 origin $REPO_REF && git -C $REMOTE_DIR checkout -f FETCH_HEAD; else git clone --depth 1 --branch $REPO_REF $REPO_URL $REMOTE_DIR; fi"
else
  TARBALL="${TMPDIR:-/tmp}/tunixlike-src.tgz"
  run tar -czf "$TARBALL" -C "$ROOT" --exclude=.git --exclude=runs --exclude=__pycache__ \
    --exclude='*.egg-info' --exclude=.pytest_cache .
  run gcloud compute tpus tpu-vm scp "$TARBALL" "$TPU_NAME:tunixlike-src.tgz" "${GCLOUD_SCOPE[@]}" --worker=all
  run "${SSH[@]}" --command="set -e; mkdir -p $REMOTE_DIR && tar -xzf ~/tunixlike-src.tgz -C $REMOTE_DIR"
fi

# 2. Python >= 3.11 venv, the tunixlike package and JAX for TPU (jax[tpu] pulls the matching libtpu).
PY="python$PYTHON_VERSION"
FIND_LINKS=""
if [[ -n "$JAX_TPU_INDEX" ]]; then
  FIND_LINKS=" -f $JAX_TPU_INDEX"
fi
run "${SSH[@]}" --command="set -e; if ! command -v $PY >/dev/null; then sudo apt-get update -qq && sudo apt-get install -y -qq software-properties-common && sudo add-apt-repository -y ppa:deadsnakes/ppa && sudo apt-get update -qq && sudo apt-get install -y -qq $PY $PY-venv; fi; [ -x $VENV/bin/python ] || $PY -m venv $VENV; $VENV/bin/pip install -q -U pip; $VENV/bin/pip install $REMOTE_DIR \"jax[tpu]\"$FIND_LINKS $EXTRA_PIP"

# 3. Every worker must see every chip of the slice (device_count is global, local is per host).
run "${SSH[@]}" --command="$VENV/bin/python -c \"import jax; print(jax.process_index(), 'devices', jax.device_count(), 'local', jax.local_device_count())\""
echo "# Next: TPU_NAME=$TPU_NAME ZONE=$ZONE BUCKET=... scripts/tpu_vm_run.sh"

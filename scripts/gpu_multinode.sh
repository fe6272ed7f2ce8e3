#!/usr/bin/env bash
# Train on several GPU nodes: one process per node, each seeing all of its node's GPUs, joined into
# one JAX program by `jax.distributed.initialize` through these environment variables:
#   JAX_COORDINATOR_ADDRESS  host:port of process 0 (read by JAX itself)
#   JAX_NUM_PROCESSES        number of processes (= nodes)
#   JAX_PROCESS_ID           this process's id, 0 .. JAX_NUM_PROCESSES-1
#   JAX_LOCAL_DEVICE_IDS     GPUs this process drives, 0,..,GPUS_PER_NODE-1 (read by JAX). Set on
#                            purpose: under SLURM, JAX's auto-detection would otherwise give a
#                            one-process-per-node job only GPU 0 on each node.
#
# Whole nodes per side (the by-host layout): SAMPLER_HOSTS=N (or --sampler-hosts=N, or
# --config.mesh.sampler_hosts=N after `--`) makes the last N nodes decode and the others train, the
# same command on every node; the weights cross by cross-host `jax.device_put`, whose transfer
# server on node i listens on the coordinator's port + 1 + i (and opens 4 data connections on
# ports the system picks): the nodes must reach each other on those ports.
#
# Two ways to launch:
#   SLURM (inside sbatch / salloc, or --slurm): `srun` starts one task per node; each task takes
#     its id from SLURM_PROCID and the coordinator from the first node of the allocation.
#       sbatch --nodes=2 --gpus-per-node=8 scripts/gpu_multinode.sh
#   Explicit (any cluster, ssh, k8s): run this on every node with the same coordinator and its
#     own id.
#       scripts/gpu_multinode.sh --coordinator=10.0.0.1:12345 --num-processes=2 --process-id=0
#       scripts/gpu_multinode.sh --coordinator=10.0.0.1:12345 --num-processes=2 --process-id=1
#
# Settings (environment variables):
#   CONFIG         a shipped config's name[:variant] (python -m tunixlike.train --list_configs) or a
#                  config file, relative to the directory the script is started from (default: addition_grpo)
#   WORKDIR        work directory, on storage every node sees (NFS / Lustre / gs://) since each
#                  host writes its own shards of the orbax checkpoint (default under SLURM:
#                  runs/<config>-<job id>; required otherwise, so all nodes agree on it)
#   GPUS_PER_NODE  GPUs per node (default: SLURM_GPUS_ON_NODE, else 8)
#   NNODES         nodes, SLURM mode (default: SLURM_JOB_NUM_NODES, else 2)
#   PORT           coordinator port, SLURM mode (default: 12345)
#   PYTHON         an interpreter with tunixlike installed on every node (default: python3)
#   SAMPLER_HOSTS  nodes that only decode (default 0: every node both, the per-host split)
#   TUNIXLIKE_HOSTS_SECRET_FILE  with SAMPLER_HOSTS: the run's secret, a file at the same path on every
#                  node, readable by you only; every message between hosts is sealed with it
#   COORDINATOR, NUM_PROCESSES, PROCESS_ID  same as the explicit flags
#   Arguments after `--` are passed on to `python -m tunixlike.train` (config overrides).
#
# Options:
#   --slurm                 SLURM mode even outside an allocation (e.g. to see the srun line)
#   --coordinator=HOST:PORT, --num-processes=N, --process-id=I   explicit mode
#   --sampler-hosts=N       the by-host layout with N sampler nodes (same as SAMPLER_HOSTS=N)
#   --dry-run               print the commands instead of running them
#   -h, --help              this text
#SBATCH --job-name=tunixlike
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ ! -f "$HERE/_common.sh" && -n "${SLURM_SUBMIT_DIR:-}" ]]; then
  HERE="$SLURM_SUBMIT_DIR/scripts"  # sbatch runs a spooled copy of this file
fi
source "$HERE/_common.sh"

SLURM_MODE=0
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  SLURM_MODE=1  # inside sbatch / salloc
fi
EXTRA_ARGS=()
while (($#)); do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --slurm) SLURM_MODE=1 ;;
    --coordinator=*) COORDINATOR="${1#*=}" ;;
    --num-processes=*) NUM_PROCESSES="${1#*=}" ;;
    --process-id=*) PROCESS_ID="${1#*=}" ;;
    --sampler-hosts=*) SAMPLER_HOSTS="${1#*=}" ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA_ARGS=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
if [[ -n "${COORDINATOR:-}${NUM_PROCESSES:-}${PROCESS_ID:-}" ]]; then
  SLURM_MODE=0  # explicit settings win over an enclosing allocation
fi

CONFIG="${CONFIG:-addition_grpo}"
PYTHON="${PYTHON:-python3}"
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
[[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "GPUS_PER_NODE='$GPUS_PER_NODE' is not a positive integer"
LOCAL_DEVICE_IDS="$(seq -s, 0 $((GPUS_PER_NODE - 1)))"
by_host_layout
require_hosts_secret "a file at the same path on every node"

if [[ "$SLURM_MODE" == 1 ]]; then
  NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-2}}"
  PORT="${PORT:-12345}"
  [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES='$NNODES' is not a positive integer"
  WORKDIR="${WORKDIR:-runs/$(basename "${CONFIG%%:*}" .py)-${SLURM_JOB_ID:-local}}"
  TRAIN_LINE="exec $(_quote "$PYTHON") -m tunixlike.train"
  for word in --config="$CONFIG" --workdir="$WORKDIR" "${EXTRA_ARGS[@]}"; do
    TRAIN_LINE+=" $(_quote "$word")"
  done
  # Single quotes: SLURM_* and the head node are expanded by each task, not here.
  # shellcheck disable=SC2016
  TASK='export JAX_COORDINATOR_ADDRESS="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):'"$PORT"'"'
  TASK+=' JAX_NUM_PROCESSES="$SLURM_NTASKS" JAX_PROCESS_ID="$SLURM_PROCID"'
  TASK+=" JAX_LOCAL_DEVICE_IDS=$LOCAL_DEVICE_IDS; $TRAIN_LINE"
  print_roles "$NNODES"
  run srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$TASK"
else
  require COORDINATOR NUM_PROCESSES PROCESS_ID WORKDIR
  [[ "$COORDINATOR" =~ ^[^:]+:[0-9]+$ ]] || die "COORDINATOR='$COORDINATOR' is not HOST:PORT"
  [[ "$NUM_PROCESSES" =~ ^[1-9][0-9]*$ ]] || die "NUM_PROCESSES='$NUM_PROCESSES' is not a positive integer"
  [[ "$PROCESS_ID" =~ ^[0-9]+$ ]] && ((PROCESS_ID < NUM_PROCESSES)) ||
    die "PROCESS_ID='$PROCESS_ID' is not in 0..$((NUM_PROCESSES - 1))"
  print_roles "$NUM_PROCESSES"
  if ((SAMPLER_HOSTS > 0)); then
    role=learner
    ((PROCESS_ID < NUM_PROCESSES - SAMPLER_HOSTS)) || role=sampler
    echo "# this node (process $PROCESS_ID): $role host"
  fi
  run env JAX_COORDINATOR_ADDRESS="$COORDINATOR" JAX_NUM_PROCESSES="$NUM_PROCESSES" \
    JAX_PROCESS_ID="$PROCESS_ID" JAX_LOCAL_DEVICE_IDS="$LOCAL_DEVICE_IDS" \
    "$PYTHON" -m tunixlike.train --config="$CONFIG" --workdir="$WORKDIR" "${EXTRA_ARGS[@]}"
fi

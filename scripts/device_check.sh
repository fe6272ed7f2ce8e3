#!/usr/bin/env bash
# One-shot check on one borrowed GPU (an H100 / H200 image with Python 3.12, jax with its CUDA plugin,
# flax, optax, orbax-checkpoint, chex, transformers and torch, and no network), at most 8 minutes.
#
#   scripts/device_check.sh                       # on the GPU machine, from the repository root
#   DEVICE_CHECK_SMALL=1 scripts/device_check.sh  # the dry run: the same logic on CPU, tiny sizes
#
# The packages the image lacks (grain, ml-collections, tensorboardX, starlette, uvicorn and their own
# missing dependencies) come as wheels from .whl/ (fetched beforehand with `pip download`, see
# docs/hosts_and_accelerators.md) and go to /tmp/site without touching the installed jax / flax.
# Logs and the result go to $OUT (default: a new temporary directory): device_check.json there is
# the ONE JSON object the script prints last (versions, card, GPU tests, the main job, the 0.5B model).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then
  sed -n '2,12p' "$0"
  exit 0
fi
OUT="${OUT:-$(mktemp -d -t device-check-XXXXXX)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
SITE=/tmp/site
[[ "${DEVICE_CHECK_SMALL:-0}" == 1 ]] && SITE="$OUT/site"  # the dry run leaves /tmp alone
if compgen -G ".whl/*.whl" > /dev/null; then
  # --no-deps: the wheels' own dependencies are either among them or already installed there.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl > "$OUT/install.log" 2>&1 \
    || echo "wheel installation failed: see $OUT/install.log" >&2
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/device_check.py --out "$OUT"

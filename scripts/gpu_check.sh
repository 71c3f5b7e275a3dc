#!/usr/bin/env bash
# Check and time the stage5 Triton kernels on a CUDA GPU; see scripts/gpu_check.py --help.
#   scripts/gpu_check.sh [--out PATH] [--quick] [--skip-engine] ...
# GPU_CHECK_TIMEOUT (seconds, default 600) bounds the whole run.
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout "${GPU_CHECK_TIMEOUT:-600}" python3 scripts/gpu_check.py "$@"

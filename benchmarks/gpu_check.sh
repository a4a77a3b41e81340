#!/usr/bin/env bash
# One-call GPU check for a machine with CUDA, torch, transformers and triton already installed
# (nothing is installed or downloaded). Run from the repository root:  bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 470 python benchmarks/gpu_check.py "$@"

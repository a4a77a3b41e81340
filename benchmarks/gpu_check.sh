#!/usr/bin/env bash
# One-call GPU check for a machine with CUDA, torch, transformers and triton already installed
# (nothing is installed or downloaded). Run from the repository root:  bash benchmarks/gpu_check.sh
# Each section runs in a process of its own and the run ends with a PASS/FAIL table and the figures
# the README reports; under 8 minutes on an H200 (the sections share a 450 s budget, `timeout` is
# the backstop). `--dry-run` runs every section's code path on the CPU (Triton interpreter, tiny
# sizes); `--sections kernels,logits` reruns a subset; `--inject-slot-bug` shows the checks failing.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 470 python benchmarks/gpu_check.py "$@"

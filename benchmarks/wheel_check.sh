#!/usr/bin/env bash
# A wheel as a new user gets it (issue 41): built from a clean export of HEAD with `python -m build`, installed with
# the [worker] extra into a fresh venv, then `batchery run examples/chat.jsonl` from outside the repository, with a
# fresh kernel cache and model cache (so the wheel's csrc/ is compiled and the model fetched from scratch).
#   bash benchmarks/wheel_check.sh            # work dir /tmp/wheelcheck (WHEEL_CHECK_DIR to change it)
set -euo pipefail
W="${WHEEL_CHECK_DIR:-/tmp/wheelcheck}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
rm -rf "$W" && mkdir -p "$W/src"
git -C "$REPO" archive HEAD | tar -x -C "$W/src"
python3 -m venv "$W/buildenv" && "$W/buildenv/bin/pip" install -q build
"$W/buildenv/bin/python" -m build --wheel --outdir "$W/dist" "$W/src" >"$W/build.log"
echo "wheel: $(ls "$W"/dist/*.whl); C++ files in it: $(unzip -l "$W"/dist/*.whl | grep -c 'engine/csrc/'), Lua scripts: $(unzip -l "$W"/dist/*.whl | grep -c 'jobs/lua/.*\.lua')"
python3 -m venv "$W/venv"
"$W/venv/bin/pip" install -q torch==2.13.0  # the CPU build on disk; a looser pin downloads the CUDA build
"$W/venv/bin/pip" install -q "$(ls "$W"/dist/*.whl)[worker]"
cd "$W"
env -u PYTHONPATH XDG_CACHE_HOME="$W/cache" TORCH_EXTENSIONS_DIR="$W/torchext" \
  "$W/venv/bin/batchery" run "$W/src/examples/chat.jsonl" -o "$W/out.jsonl" --errors "$W/errors.jsonl"
echo "records: $(wc -l <"$W/out.jsonl") in out.jsonl, $(wc -l <"$W/errors.jsonl") in errors.jsonl; kernels built: $(ls "$W/torchext")"

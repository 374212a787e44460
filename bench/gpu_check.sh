#!/usr/bin/env bash
# One prepared check for a CUDA machine (about 3-4 minutes on one GPU):
#   1. every `gpu`-marked test (real CUDA-graph capture, weight updates with captured graphs, ...);
#   2. eager vs CUDA-graph decode step times of the engine at batch sizes 1, 8 and 32
#      (12-layer, 768-wide Llama, bfloat16), printed as a Markdown table.
# Usage: bash bench/gpu_check.sh        (or: make gpu-check)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="runtime:operator:.${PYTHONPATH:+:$PYTHONPATH}"

python3 - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu_check.sh: no CUDA device visible to torch; run it on a GPU machine")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY

echo "== gpu tests"
status=0
timeout 150 python3 -m pytest -m gpu tests/runtime tests/serving -q -p no:cacheprovider || status=$?

echo "== eager vs CUDA graph decode step (ms)"
timeout 120 python3 bench/engine.py --device cuda --dtype bfloat16 --graphs \
  --graph-batch-sizes 1 8 32 --prompt-len 128 --decode-steps 32 --repeats 3 --vocab 32000 || status=$?
exit "$status"

#!/usr/bin/env bash
# Quantization on a CUDA machine (issue 28; about 3 minutes on one GPU), beside bench/gpu_check.sh:
#   1. the quantized-GEMM kernels on CUDA against their dequantized references
#      (tests/runtime/test_quant_kernels.py: Triton block FP8 and W4A16, torch._scaled_mm FP8);
#   2. the decode table of bench/engine.py on the llama-1b preset, bf16 weights then online FP8
#      weights (--quantization fp8), batch 1, 8, 32 and contexts 512, 4096 with CUDA graphs.
#      Target: batch-1 decode with FP8 weights >= 1.6x the bf16 tokens/s.
#   3. the same decode table on a Qwen3-MoE (16 experts, top-2; hidden 1024, expert size 512,
#      8 layers), bf16 experts then online FP8 experts: the quantized-MoE CUDA path (experts
#      dequantized per forward into the Triton fused-MoE kernel), under CUDA graphs.
# Usage: bash bench/gpu_quant.sh
# CPU dry run (tiny sizes, Triton's interpreter): GPU_CHECK_DRY_RUN=1 bash bench/gpu_quant.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="runtime:operator:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0
start=$SECONDS
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "bench/gpu_quant.sh: installing .whl/*.whl failed"; exit 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# step caps (seconds: 20 + 2 x 20 + 2 x 20) sum to 100, gpu_check.sh's cap for this script; the CPU dry run gets 600 s
cap() { if [[ "${GPU_CHECK_DRY_RUN:-0}" == "1" ]]; then echo 600; else echo "$1"; fi; }
if [[ "${GPU_CHECK_DRY_RUN:-0}" == "1" ]]; then
  export TRITON_INTERPRET=1
  bench_args=(--device cpu --decode-table --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128
              --vocab 512 --dtype float32 --graph-batch-sizes 1 2 --contexts 16 32 --decode-steps 2 --no-transformers)
  moe_args=(--device cpu --decode-table --arch qwen3_moe --layers 2 --hidden 64 --heads 4 --kv-heads 2
            --experts 4 --top-k 2 --moe-intermediate 64 --vocab 512 --dtype float32 --graph-batch-sizes 1
            --contexts 16 --decode-steps 2 --no-transformers)
else
  python3 -c "import torch, sys; torch.cuda.is_available() or sys.exit('bench/gpu_quant.sh: no CUDA device')" || exit 1
  bench_args=(--device cuda --preset llama-1b --dtype bfloat16 --graph-batch-sizes 1 8
              --contexts 512 --decode-steps 8 --table-context-len 8192 --backends triton --no-transformers)
  moe_args=(--device cuda --decode-table --arch qwen3_moe --layers 8 --hidden 1024 --heads 16 --kv-heads 4
            --experts 16 --top-k 2 --moe-intermediate 512 --vocab 32000 --dtype bfloat16 --graph-batch-sizes 1 8
            --contexts 512 --decode-steps 8 --table-context-len 8192 --backends triton --no-transformers)
fi

echo "== quantized kernels ($((SECONDS - start)) s)"
timeout "$(cap 20)" python3 -m pytest -q -p no:cacheprovider -p no:tests.kube_fixtures tests/runtime/test_quant_kernels.py || status=1

for quantization in auto fp8; do
  echo "== decode table, --quantization $quantization ($((SECONDS - start)) s)"
  timeout "$(cap 20)" python3 bench/engine.py "${bench_args[@]}" --quantization "$quantization" || status=1
done
for quantization in auto fp8; do
  echo "== MoE decode table, --quantization $quantization ($((SECONDS - start)) s)"
  timeout "$(cap 20)" python3 bench/engine.py "${moe_args[@]}" --quantization "$quantization" || status=1
done
echo "== done in $((SECONDS - start)) s, status $status"
exit "$status"

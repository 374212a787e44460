#!/usr/bin/env bash
# One prepared check for a CUDA machine (each step has a time cap; the caps sum to 540 s, under
# the 9-minute budget, tests/test_gpu_check_dry_run.py checks the sum; none has run on a GPU yet):
#   1. every `gpu`-marked test: decode graphs per attention backend and KV dtype (fp8 too),
#      piecewise EXTEND graphs with a weight update that recaptures them, weight updates with
#      captured decode graphs, the CUDA runner against transformers;
#   2. the Triton kernels on CUDA (test_triton_attention.py: attention against the torch_native
#      backend; test_triton_fused_moe.py: fused MoE; tests/lora/test_triton_segment.py: LoRA), the modules CI runs under Triton's interpreter;
#   3. bench/engine.py --device cuda: the decode table (tokens/s at batch 1, 8, 32, 64 and
#      contexts 512, 4096; torch_native / triton, eager / graphs, transformers; HBM-roofline share)
#      on a random bf16 Llama shaped like a 1B model;
#   4. bench/graph_modes.py on the same shape: prefill tokens/s with piecewise graphs vs eager,
#      decode with an fp8 KV cache vs bf16 at 4096 context, decode graphs with LoRA and with the
#      expert-distribution recorder vs eager at batch 1 (fails when a graph row captured nothing);
#   5. bench/serving.py --device cuda --preset llama-1b: output tokens/s, TTFT and ITL p50/p99 at
#      concurrency 1, 16 and 64, overlap on and off (--compare-overlap);
#   6. bench/overlap_idle.py: the real scheduler loop under torch.profiler, overlap on and off:
#      idle time between consecutive decode kernels per step (issue 24 item 1), batch 1, 8, 64;
#   7. bench/gpu_quant.sh: the quantized-GEMM kernels on CUDA, and the decode table with bf16
#      against online FP8 weights (issue 28's target: batch-1 FP8 >= 1.6x bf16);
#   8. bench/engine.py --kernel-paths on the 1B shape: batch-1 decode tokens/s with graphs and
#      each one's HBM-roofline share, eager kernels vs the fused Triton kernels vs
#      --enable-torch-compile, ratios side by side (issue 24 item 3's target: >= 60%);
#   9. bench/speculative.py --graphs on a random float32 Llama (8 layers, hidden 1024) made to
#      copy a cycle: batch-1 and batch-8 output tokens/s with NGRAM, STANDALONE and EAGLE against
#      none, graphs on (decode, TARGET_VERIFY and the draft's decode graphs; each row prints what
#      was really captured), wall clock, ratios in one run (issue 30 item 5). Its 50 s came from
#      the table, modes, serving, quant and kernels steps (10 s each), none yet run on a GPU.
# Nothing GPU-marked may skip here: the script sets SHARDLINE_GPU_CHECK=1, under which the
# memory-saver test fails without torch-memory-saver, and it fails when tests/serving cannot run.
# Packages the GPU image lacks come as wheels in .whl/ (bash bench/fetch_gpu_wheels.sh, on a
# machine with network access), installed into /tmp/site first.
# Usage: bash bench/gpu_check.sh        (or: make gpu-check)
# CPU dry run of the same steps (tiny sizes, Triton's interpreter): GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh
# (tests/test_gpu_check_dry_run.py runs the graph-modes, serving and kernel-paths steps of it; the Triton and
# decode-table steps have their own CPU tests.)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="runtime:operator:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0
start=$SECONDS
export SHARDLINE_GPU_CHECK=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "bench/gpu_check.sh: installing .whl/*.whl failed"; exit 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# GPU_CHECK_STEPS picks steps (default all: tests triton table modes serving idle quant kernels spec).
steps=" ${GPU_CHECK_STEPS:-tests triton table modes serving idle quant kernels spec} "
wants() { [[ "$steps" == *" $1 "* ]]; }
# A step's time cap on the GPU; the CPU dry run (a busy CI machine) gets 600 s per step.
cap() { if [[ "${GPU_CHECK_DRY_RUN:-0}" == "1" ]]; then echo 600; else echo "$1"; fi; }

if [[ "${GPU_CHECK_DRY_RUN:-0}" == "1" ]]; then
  export TRITON_INTERPRET=1
  device=cpu
  bench_args=(--device cpu --decode-table --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128
              --vocab 512 --dtype float32 --graph-batch-sizes 1 2 --contexts 16 32 --decode-steps 2)
  test_args=(tests/runtime/test_triton_attention.py -k "not tiny_model")
  modes_args=(--device cpu --context 64 --prompt-len 16 --prefill-batch 2 --steps 2 --repeats 1)
  idle_args=(--device cpu --dtype float32 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128
             --vocab 512 --batch-size 1 2 --profile-steps 4 --warmup-steps 2)
  kernel_args=(--device cpu --kernel-paths --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128
               --vocab 512 --dtype float32 --graph-batch-sizes 1 --contexts 16 --decode-steps 2)
  spec_args=(--device cpu --layers 2 --hidden 64 --prompts 2 --max-new-tokens 8 --batches 1 2 --models copying
             --prompt-sets repetitive --graphs)
  serving_args=(--device cpu --concurrency 1 2 --compare-overlap --baseline none --requests-per-level 4
                --prompt-len 8 16 --output-len 2 4 --long-fraction 0 --max-total-tokens 4096)
else
  device=cuda
  bench_args=(--device cuda --preset llama-1b --dtype bfloat16 --graph-batch-sizes 1 8 64
              --contexts 512 4096 --decode-steps 8 --table-context-len 8192)
  test_args=(tests/runtime/test_triton_attention.py tests/runtime/test_triton_fused_moe.py tests/lora/test_triton_segment.py
             tests/runtime/test_triton_rms_norm.py tests/runtime/test_triton_silu_and_mul.py
             tests/runtime/test_triton_rope_kv.py tests/runtime/test_rope_kv_wiring.py)
  modes_args=(--device cuda --preset llama-1b --dtype bfloat16 --experts 8 --context 4096 --prompt-len 512
              --prefill-batch 4 --steps 16 --repeats 2)
  idle_args=(--device cuda --preset llama-1b --dtype bfloat16 --batch-size 1 8 64 --profile-steps 16)
  kernel_args=(--device cuda --kernel-paths --preset llama-1b --dtype bfloat16 --graph-batch-sizes 1
               --contexts 512 --decode-steps 16)
  spec_args=(--device cuda --graphs --clock wall --layers 8 --hidden 1024 --prompts 8 --max-new-tokens 64
             --batches 1 8 --models copying --prompt-sets repetitive)
  serving_args=(--device cuda --preset llama-1b --concurrency 1 16 64 --compare-overlap --baseline none
                --max-total-tokens 262144 --requests-per-level 64)
fi

python3 - "$device" <<'PY' || exit 1
import sys, torch, triton, transformers
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("bench/gpu_check.sh: no CUDA device visible to torch; run it on a GPU machine")
name = torch.cuda.get_device_name(0) if sys.argv[1] == "cuda" else "CPU dry run"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}, "
      f"transformers {transformers.__version__}, {name}")
PY

echo "== gpu tests ($((SECONDS - start)) s)"
if [[ "$device" == "cuda" ]] && wants tests; then
  # tests/serving's gpu tests (test_graph_settings_update.py) start the HTTP server: its packages
  # must be there (wheels in .whl/); the check fails instead of skipping them.
  if ! python3 -c "import zmq, fastapi, uvicorn, torch_memory_saver" 2>/dev/null; then
    echo "bench/gpu_check.sh: zmq/fastapi/uvicorn/torch_memory_saver missing: run bash bench/fetch_gpu_wheels.sh where"
    echo "pip can download and bring .whl/ along"
    status=1
  fi
  # -rs lists skips; any skip of a gpu test is a failure of the check.
  timeout "$(cap 100)" python3 -m pytest -m gpu tests/runtime tests/serving tests/lora -q -rs -p no:cacheprovider -p no:tests.kube_fixtures \
    --durations=8 2>&1 | tee /tmp/gpu_check_pytest.log
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  if grep -q "^SKIPPED" /tmp/gpu_check_pytest.log; then echo "bench/gpu_check.sh: gpu tests were skipped"; status=1; fi
fi

if wants triton; then
  echo "== triton kernels on $device ($((SECONDS - start)) s)"
  timeout "$(cap 40)" python3 -m pytest -q -p no:cacheprovider -p no:tests.kube_fixtures "${test_args[@]}" || status=$?
fi
if wants table; then
  echo "== decode table ($((SECONDS - start)) s)"
  timeout "$(cap 70)" python3 bench/engine.py "${bench_args[@]}" || status=$?
fi
if wants modes; then
  echo "== graphs in every mode ($((SECONDS - start)) s)"
  timeout "$(cap 50)" python3 bench/graph_modes.py "${modes_args[@]}" || status=$?
fi
if wants serving; then
  echo "== serving on $device ($((SECONDS - start)) s)"
  timeout "$(cap 70)" python3 bench/serving.py "${serving_args[@]}" || status=$?
fi
if wants idle; then
  echo "== overlap idle time on $device ($((SECONDS - start)) s)"
  timeout "$(cap 40)" python3 bench/overlap_idle.py "${idle_args[@]}" || status=$?
fi
if wants quant; then
  echo "== quantized weights on $device ($((SECONDS - start)) s)"
  timeout "$(cap 80)" bash bench/gpu_quant.sh || status=$?
fi
if wants kernels; then
  echo "== decode kernel paths on $device ($((SECONDS - start)) s)"
  timeout "$(cap 40)" python3 bench/engine.py "${kernel_args[@]}" || status=$?
fi
if wants spec; then
  echo "== speculative decoding with graphs on $device ($((SECONDS - start)) s)"
  timeout "$(cap 50)" python3 bench/speculative.py "${spec_args[@]}" || status=$?
fi
echo "== done in $((SECONDS - start)) s, status $status"
exit "$status"

"""FP8 and W4A16 against bf16 on one model: weight bytes, KV tokens on one memory budget, and
the CPU decode-step time (issue 28).

The model: a Llama (``--arch llama``) or a Qwen3-MoE (``--arch qwen3_moe``: 16 experts, top-4,
expert intermediate ``--hidden / 2``) of ``--hidden`` x ``--layers`` (random weights, written by
transformers in bfloat16), quantized by the compressed-tensors library
(``tests/runtime/quant_checkpoint.py``, FP8_DYNAMIC and W4A16 group 128; MoE experts included).
Each checkpoint is loaded by a CPU ModelRunner in bfloat16.

- weight bytes: the runner's ``weight_bytes`` (every parameter, LM head and embedding included);
- ``max_total_num_tokens`` on a GPU budget of ``--budget-gib`` at ``mem_fraction_static`` 0.85:
  ``(budget * 0.85 - weight bytes) / KV bytes per token`` (the GPU sizing rule of
  ``kv_pools.profile_max_num_token``; bf16 KV cache);
- CPU decode step: batch ``--batch`` after a 32-token prompt each, best and median of
  ``--steps`` steps, with ``--threads`` threads, the model in ``--decode-dtype`` (float32, what
  the CPU runs a bf16 checkpoint in by default; the quantized weights stay FP8 / int4).

Usage::

    python bench/quantization.py --threads 2
    python bench/quantization.py --arch qwen3_moe --layers 4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

import harness  # noqa: E402
from quant_checkpoint import quantize_checkpoint  # noqa: E402

from shardline_runtime.mem_cache.memory_pool import TokenToKVPool  # noqa: E402


def write_base(out: Path, hidden: int, layers: int, arch: str = "llama") -> Path:
    import transformers

    from shardline_runtime.tiny_checkpoint import tiny_config, train_tokenizer

    experts = (
        {
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": hidden // 2,
            "head_dim": 64,
        }
        if arch == "qwen3_moe"
        else {}
    )
    config = tiny_config(
        arch,
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4 // 128 * 128,
        **experts,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        initializer_range=0.02,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(str(out))
    train_tokenizer(out, vocab_size=512)
    return out


def decode_times(runner, batch: int, steps: int) -> list[float]:
    seqs = harness.new_seqs(runner, batch)
    harness.extend(runner, seqs, [[(7 * i + j) % 500 + 3 for j in range(32)] for i in range(batch)])
    times = []
    tokens = [5] * batch
    for _ in range(steps):
        start = time.perf_counter()
        out = harness.decode(runner, seqs, tokens)
        tokens = out.next_token_logits.argmax(-1).tolist()
        times.append(time.perf_counter() - start)
    harness.release(runner, seqs)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen3_moe"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--budget-gib", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = write_base(Path(tmp) / "bf16", args.hidden, args.layers, args.arch)
        paths = {
            "bf16": base,
            "fp8-w8a8-dynamic-channel": quantize_checkpoint(base, Path(tmp) / "fp8", "FP8_DYNAMIC"),
            "w4a16-g128": quantize_checkpoint(base, Path(tmp) / "w4", "W4A16", group_size=128),
        }
        print(
            f"{args.arch} hidden {args.hidden}, {args.layers} layers, vocab 32000; "
            f"budget {args.budget_gib} GiB x 0.85; decode {args.decode_dtype}, batch {args.batch}, "
            f"{args.threads} threads"
        )
        print(
            f"{'scheme':<26} {'weight MiB':>10} {'KV tokens':>10} {'best ms':>8} {'median ms':>9}"
        )
        for name, path in paths.items():
            runner = harness.make_runner(path, dtype="bfloat16", max_total_tokens=4096)
            cfg = runner.model_config
            per_token = TokenToKVPool.bytes_per_token(
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16
            )
            tokens = int((args.budget_gib * 2**30 * 0.85 - runner.weight_bytes) // per_token)
            weight_bytes = runner.weight_bytes
            if args.decode_dtype != "bfloat16":
                runner = harness.make_runner(path, dtype=args.decode_dtype, max_total_tokens=4096)
            times = decode_times(runner, args.batch, args.steps)[3:]
            print(
                f"{name:<26} {weight_bytes / 2**20:>10.1f} {tokens:>10} "
                f"{min(times) * 1e3:>8.1f} {statistics.median(times) * 1e3:>9.1f}"
            )


if __name__ == "__main__":
    main()

"""LoRA benchmark: cost of a mixed-adapter batch against a base-model batch, same runner.

One randomly initialised Llama (default 4 layers, hidden 512, 8 heads, vocab 8000) served by a
ModelRunner with ``--enable-lora`` and ``--adapters`` PEFT adapters of rank ``--rank`` on every
attention and MLP projection (made with ``peft``). Three batches of ``--batch-size`` requests run
interleaved, ``--repeats`` times after a warm-up:

- ``base``: no request uses an adapter (the LoRA wrappers add nothing but a check);
- ``one``: every request uses the same adapter;
- ``mixed``: requests cycle over the adapters and the base model (``--adapters + 1`` groups).

For each: one EXTEND of ``--prompt-len`` tokens per request, then the mean of ``--decode-steps``
DECODE steps. The table gives the best (minimum) time and the ratio to ``base``.

Usage::

    python bench/lora.py --threads 1              # CPU float32, about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from shardline_runtime.model_executor.model_runner import ModelRunner  # noqa: E402
from shardline_runtime.server_args import ServerArgs  # noqa: E402
from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402


def make_adapters(base: Path, root: Path, n: int, rank: int) -> dict[str, str]:
    import peft
    import transformers

    out = {}
    for i in range(n):
        torch.manual_seed(i + 1)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        peft.get_peft_model(model, cfg).save_pretrained(str(root / f"a{i}"))
        out[f"a{i}"] = str(root / f"a{i}")
    return out


def run_batch(runner: ModelRunner, names: list[str | None], prompt_len: int, steps: int) -> tuple[float, float]:
    """(prefill seconds, mean decode-step seconds) of one batch."""
    bs = len(names)
    rows = runner.req_to_token_pool.alloc(bs)
    slots = runner.token_to_kv_pool_allocator.alloc(bs * (prompt_len + steps)).view(bs, -1)
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write((row, slice(0, prompt_len + steps)), slots[i])
    ids = torch.randint(0, 1000, (bs * prompt_len,))
    fb = ForwardBatch.init_new(forward_mode=ForwardMode.EXTEND, input_ids=ids, req_pool_indices=rows,
                               seq_lens=[prompt_len] * bs, out_cache_loc=slots[:, :prompt_len].reshape(-1),
                               model_runner=runner)
    fb.lora_names = list(names)
    t0 = time.perf_counter()
    nxt = runner.forward(fb).next_token_logits.argmax(-1)
    prefill = time.perf_counter() - t0
    decode = []
    for s in range(steps):
        fb = ForwardBatch.init_new(forward_mode=ForwardMode.DECODE, input_ids=nxt, req_pool_indices=rows,
                                   seq_lens=[prompt_len + s + 1] * bs, out_cache_loc=slots[:, prompt_len + s],
                                   model_runner=runner)
        fb.lora_names = list(names)
        t0 = time.perf_counter()
        nxt = runner.forward(fb).next_token_logits.argmax(-1)
        decode.append(time.perf_counter() - t0)
    runner.token_to_kv_pool_allocator.free(slots.reshape(-1))
    for row in rows:
        runner.req_to_token_pool.free(row)
    return prefill, statistics.mean(decode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--adapters", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_checkpoint(root / "base", arch="llama", vocab_size=args.vocab, tokenizer=False,
                                    num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                                    num_key_value_heads=args.heads, intermediate_size=4 * args.hidden)
        adapters = make_adapters(base, root, args.adapters, args.rank)
        runner = ModelRunner(ServerArgs(
            model_path=str(base), device="cpu", dtype="float32", max_total_tokens=args.batch_size * (args.prompt_len + args.decode_steps) + 8,
            max_running_requests=args.batch_size, enable_lora=True, max_loras_per_batch=args.adapters, max_lora_rank=args.rank,
            lora_paths=tuple(f"{n}={p}" for n, p in adapters.items())))
        names = list(adapters)
        cycle = names + [None]
        batches = {
            "base": [None] * args.batch_size,
            "one": [names[0]] * args.batch_size,
            "mixed": [cycle[i % len(cycle)] for i in range(args.batch_size)],
        }
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in batches}
        for rep in range(args.repeats + 1):
            for key, batch in batches.items():
                r = run_batch(runner, batch, args.prompt_len, args.decode_steps)
                if rep:
                    results[key].append(r)
    print(f"LoRA on CPU: {args.layers} layers, hidden {args.hidden}, {args.adapters} adapters of rank {args.rank}, "
          f"batch {args.batch_size}, prompt {args.prompt_len}, threads {torch.get_num_threads()}")
    print("| batch | prefill ms (best) | vs base | decode step ms (best) | vs base |")
    print("|---|---|---|---|---|")
    best = {k: (min(r[0] for r in v), min(r[1] for r in v)) for k, v in results.items()}
    for key, (pf, dc) in best.items():
        print(f"| {key} | {pf * 1e3:.1f} | {pf / best['base'][0]:.2f} | {dc * 1e3:.2f} | {dc / best['base'][1]:.2f} |")


if __name__ == "__main__":
    main()

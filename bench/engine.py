"""Engine benchmark: Shardline's TpModelWorker against transformers, same model, side by side.

Measures, for one randomly initialised Llama (default 12 layers, hidden 768, 12 heads, vocab
32000; the shape of a GPT-2-small-sized Llama), or with ``--arch qwen3_moe`` / ``qwen2_moe`` /
``mixtral`` a mixture-of-experts model of ``--experts`` experts, top ``--top-k``, expert size
``--moe-intermediate``:

- prefill: one EXTEND of ``--prefill-batch`` prompts of ``--prompt-len`` tokens
  (Shardline: ``prepare_for_extend`` + ``forward_batch_generation`` incl. greedy sampling;
  transformers: ``model(ids, use_cache=True)`` + argmax of the last position);
- decode step at ``--batch-size`` requests after ``--prompt-len`` tokens of context
  (Shardline: ``prepare_for_decode`` + ``forward_batch_generation``; transformers: one
  ``model(next_ids, cache=cache)`` + argmax), mean over ``--decode-steps`` steps.

Both run in the same process, on the same device and dtype, interleaved (engine, transformers,
engine, ...), ``--repeats`` times after one warm-up round. The table gives the best (minimum) time
of each side, the least disturbed by other load on a shared machine, and also the ratio of the
medians. Ratios are Shardline / transformers (< 1: Shardline is faster).
Both produce the same greedy tokens (checked), so they do the same work.

With ``--device cuda`` it instead prints the GPU decode table of ``bench/decode_table.py``
(torch_native / triton backends, eager / CUDA graphs, and transformers with a static cache, at
``--graph-batch-sizes`` x ``--contexts``, with the HBM-roofline share); ``--preset llama-1b``
gives the 1B-shaped model (16 layers, hidden 2048, 32 heads, 8 KV heads, vocab 128256).
``--compare`` keeps the CPU-style Shardline-vs-transformers table on CUDA. With ``--graphs``
(CUDA only) it prints eager vs CUDA-graph decode step times at ``--graph-batch-sizes``.

Usage::

    python bench/engine.py                       # CPU float32 defaults, a few minutes on 2 cores
    python bench/engine.py --threads 1 --clock cpu   # the same, robust to other load on the machine
    python bench/engine.py --device cuda --preset llama-1b --dtype bfloat16   # the decode table
    python bench/engine.py --device cuda --graphs --graph-batch-sizes 1 8 32
    python bench/engine.py --threads 1 --profile     # per-operator profile of a decode step
    python bench/engine.py --kernel-paths --threads 1 --graph-batch-sizes 1 8 --contexts 128
        # decode: eager vs fused Triton kernels (CUDA) vs --enable-torch-compile (bench/kernel_paths.py)
    python bench/engine.py --host-overhead --threads 1 --clock cpu --baseline-tree /tmp/base
        # host work per decode step outside the forward, batch 1 and 64, two trees side by side
        # (bench/host_overhead.py)
    python bench/engine.py --arch qwen3_moe --layers 4 --hidden 512 --heads 8 --kv-heads 8 \
        --experts 16 --top-k 2 --moe-intermediate 512 --vocab 8000 --threads 1 --clock cpu   # tiny MoE
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardline_runtime.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from shardline_runtime.managers.tp_worker import TpModelWorker  # noqa: E402
from shardline_runtime.sampling import SamplingParams  # noqa: E402
from shardline_runtime.server_args import ServerArgs  # noqa: E402
from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

PRESETS = {
    "gpt2-small": dict(layers=12, hidden=768, heads=12, kv_heads=12, intermediate=2048, vocab=32000),
    "llama-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256),
}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=None, ignore_eos=True)
_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def clock() -> float:
    """Seconds from the clock chosen with ``--clock`` (wall time, or this process's CPU time)."""
    return _clock()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_checkpoint(out: Path, args) -> Path:
    moe = {}
    if args.arch in ("qwen3_moe", "qwen2_moe"):
        moe = dict(num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
                   head_dim=args.hidden // args.heads)
    elif args.arch == "mixtral":
        moe = dict(num_local_experts=args.experts, num_experts_per_tok=args.top_k)
    intermediate = args.moe_intermediate if args.arch == "mixtral" else args.intermediate
    return make_tiny_checkpoint(
        out, arch=args.arch, seed=0, vocab_size=args.vocab, tokenizer=False,
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=intermediate,
        max_position_embeddings=max(4096, args.context_len), initializer_range=0.02, dtype=args.dtype, **moe,
    )


def make_worker(path: Path, args, disable_cuda_graph: bool = True, attention_backend: str = "auto",
                max_total_tokens: int | None = None, **extra) -> TpModelWorker:
    server_args = ServerArgs(
        model_path=str(path), device=args.device, dtype=args.dtype,
        max_total_tokens=max_total_tokens or (args.prompt_len + args.decode_steps + 8) * max(
            args.batch_size, args.prefill_batch, 32),
        max_running_requests=max(args.batch_size, args.prefill_batch, 32),
        disable_cuda_graph=disable_cuda_graph, cuda_graph_max_bs=max(args.graph_batch_sizes),
        context_length=args.context_len, attention_backend=attention_backend,
        quantization=args.quantization, **extra,
    )
    return TpModelWorker(server_args, 0)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


# ---- Shardline -----------------------------------------------------------------------------------

def engine_prefill(worker, batch_prompts):
    """Returns (seconds, first tokens, batch) with the KV still held."""
    reqs = [Req(f"p{i}", p, GREEDY) for i, p in enumerate(batch_prompts)]
    batch = ScheduleBatch.init_new(reqs, worker)
    sync(worker.device)
    start = clock()
    batch.prepare_for_extend()
    result = worker.forward_batch_generation(batch.get_model_worker_batch()).copy_to_cpu().wait()
    tokens = result.next_token_ids.tolist()
    sync(worker.device)
    elapsed = clock() - start
    for req, token in zip(reqs, tokens):
        req.append_output(token)
    return elapsed, tokens, batch


def engine_decode(worker, batch, steps: int):
    """Mean seconds per decode step and the generated tokens; frees the batch's KV."""
    sync(worker.device)
    start = clock()
    for _ in range(steps):
        batch.prepare_for_decode()
        result = worker.forward_batch_generation(batch.get_model_worker_batch()).copy_to_cpu().wait()
        for req, token in zip(batch.reqs, result.next_token_ids.tolist()):
            req.append_output(token)
    sync(worker.device)
    elapsed = (clock() - start) / steps
    outputs = [r.output_ids for r in batch.reqs]
    for req in batch.reqs:
        batch.release_kv(req)
    return elapsed, outputs


# ---- transformers --------------------------------------------------------------------------------

@torch.inference_mode()
def hf_prefill(model, batch_prompts, device):
    ids = torch.tensor(batch_prompts, device=device)
    sync(device)
    start = clock()
    out = model(input_ids=ids, use_cache=True)
    tokens = out.logits[:, -1].argmax(-1)
    tokens_list = tokens.tolist()
    sync(device)
    return clock() - start, tokens_list, out.cache, tokens


@torch.inference_mode()
def hf_decode(model, cache, tokens, context_len: int, steps: int, device):
    generated = [[t] for t in tokens.tolist()]
    sync(device)
    start = clock()
    for step in range(steps):
        position = torch.full((tokens.shape[0], 1), context_len + step, device=device)
        out = model(input_ids=tokens[:, None], cache=cache, position_ids=position, use_cache=True)
        cache = out.cache
        tokens = out.logits[:, -1].argmax(-1)
        for g, t in zip(generated, tokens.tolist()):
            g.append(t)
    sync(device)
    return (clock() - start) / steps, generated


# ---- runs ----------------------------------------------------------------------------------------

def compare(args) -> list[tuple[str, float, float]]:
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), args)
        worker = make_worker(path, args)
        device = worker.device
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
        ).to(device).eval()
    pre_prompts = prompts(args.prefill_batch, args.prompt_len, args.vocab, seed=1)
    dec_prompts = prompts(args.batch_size, args.prompt_len, args.vocab, seed=2)
    rows = {"prefill": ([], []), "decode": ([], [])}
    for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
        e_pre, e_first, batch = engine_prefill(worker, pre_prompts)
        for req in batch.reqs:
            batch.release_kv(req)
        h_pre, h_first, _, _ = hf_prefill(hf, pre_prompts, device)
        _, _, batch = engine_prefill(worker, dec_prompts)
        e_dec, e_tokens = engine_decode(worker, batch, args.decode_steps)
        _, _, cache, first = hf_prefill(hf, dec_prompts, device)
        h_dec, h_tokens = hf_decode(hf, cache, first, args.prompt_len, args.decode_steps, device)
        if repeat == 0:
            same = e_first == h_first and e_tokens == h_tokens
            print(f"greedy tokens identical to transformers: {same}", flush=True)
            continue
        rows["prefill"][0].append(e_pre)
        rows["prefill"][1].append(h_pre)
        rows["decode"][0].append(e_dec)
        rows["decode"][1].append(h_dec)
        print(f"repeat {repeat}: prefill {e_pre * 1e3:.1f} / {h_pre * 1e3:.1f} ms, "
              f"decode step {e_dec * 1e3:.2f} / {h_dec * 1e3:.2f} ms", flush=True)
    return [(name, e, h) for name, (e, h) in rows.items()]


def profile_decode(args, steps: int = 6, rounds: int = 3) -> None:
    """torch.profiler over ``steps`` decode steps of each side, ``rounds`` times; prints each
    operator's self CPU time in ms per step (minimum over rounds), largest first, and the number
    of ATen operators called per step from Python (not counting the ones they call), the
    figure that decides a small model's step where every operator costs a few microseconds."""
    import transformers
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), args)
        worker = make_worker(path, args)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
        ).to(worker.device).eval()
    batch_prompts = prompts(args.batch_size, args.prompt_len, args.vocab, seed=2)
    per_op = {"Shardline": {}, "transformers": {}}
    op_calls = {"Shardline": [], "transformers": []}  # top-level ATen calls per step, each round

    def record(side, prof):
        for event in prof.key_averages():
            per_op[side].setdefault(event.key, []).append(event.self_cpu_time_total / steps / 1e3)
        top_level = [
            e for e in prof.events()
            if e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))
        ]
        op_calls[side].append(len(top_level) / steps)

    for _ in range(rounds):
        _, _, batch = engine_prefill(worker, batch_prompts)

        def engine_steps(n):
            for _ in range(n):
                batch.prepare_for_decode()
                result = worker.forward_batch_generation(batch.get_model_worker_batch()).copy_to_cpu().wait()
                for req, token in zip(batch.reqs, result.next_token_ids.tolist()):
                    req.append_output(token)

        engine_steps(2)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine_steps(steps)
        record("Shardline", prof)
        for req in batch.reqs:
            batch.release_kv(req)
        _, _, cache, tokens = hf_prefill(hf, batch_prompts, worker.device)
        with torch.inference_mode():
            for step in range(2 + steps):
                if step == 2:
                    prof = profile(activities=[ProfilerActivity.CPU])
                    prof.__enter__()
                position = torch.full((tokens.shape[0], 1), args.prompt_len + step, device=worker.device)
                out = hf(input_ids=tokens[:, None], cache=cache, position_ids=position, use_cache=True)
                cache, tokens = out.cache, out.logits[:, -1].argmax(-1)
                tokens.tolist()
            prof.__exit__(None, None, None)
        record("transformers", prof)
    for side, ops in per_op.items():
        rows = sorted(((min(v), k) for k, v in ops.items()), reverse=True)
        print(f"\n{side}: decode step, batch {args.batch_size}; sum of operators {sum(r[0] for r in rows):.1f} ms; "
              f"{min(op_calls[side]):.0f} top-level operator calls per step")
        for ms, name in rows[:12]:
            print(f"  {name:52s} {ms:8.2f} ms")


def graphs(args) -> None:
    if args.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit("--graphs needs --device cuda on a CUDA machine")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), args)
        eager = make_worker(path, args, disable_cuda_graph=True)
        captured = make_worker(path, args, disable_cuda_graph=False)
    assert captured.model_runner.graphs.decode is not None, "graphs were not captured"
    print("| batch size | eager decode step (ms) | CUDA graph decode step (ms) | speed-up |")
    print("|---:|---:|---:|---:|")
    for bs in args.graph_batch_sizes:
        batch_prompts = prompts(bs, args.prompt_len, args.vocab, seed=3)
        times, outputs = [], []
        for worker in (eager, captured):
            best = []
            for _ in range(args.repeats + 1):
                _, _, batch = engine_prefill(worker, batch_prompts)
                step, out = engine_decode(worker, batch, args.decode_steps)
                best.append(step)
            times.append(min(best[1:]))
            outputs.append(out)
        match = "" if outputs[0] == outputs[1] else " (tokens differ!)"
        print(f"| {bs} | {times[0] * 1e3:.3f} | {times[1] * 1e3:.3f} | {times[0] / times[1]:.2f}x{match} |", flush=True)


def add_model_shape_args(parser: argparse.ArgumentParser) -> None:
    """The Llama shape options (the defaults: GPT-2-small-sized), shared by the bench scripts."""
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen3_moe", "qwen2_moe", "mixtral"])
    parser.add_argument("--experts", type=int, default=16, help="MoE archs: experts per layer")
    parser.add_argument("--top-k", type=int, default=2, help="MoE archs: experts per token")
    parser.add_argument("--moe-intermediate", type=int, default=512, help="MoE archs: intermediate size of one expert")
    parser.add_argument("--quantization", default="auto", choices=["auto", "fp8"],
                        help="fp8: online FP8 weights (--quantization fp8 of the runtime) for every Shardline row")
    add_model_shape_args(parser)
    parser.add_argument("--batch-size", type=int, default=16, help="decode batch size")
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context-len", type=int, default=512,
                        help="engine context length (KV columns a captured decode graph reads)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=sorted(_CLOCKS),
                        help="wall time, or process CPU time (with --threads 1 on a shared CPU machine: "
                             "time spent waiting for the CPU is not counted)")
    parser.add_argument("--graphs", action="store_true", help="eager vs CUDA graph decode (CUDA only)")
    parser.add_argument("--graph-batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model shape preset (overrides --layers/--hidden/--heads/--kv-heads/--intermediate/--vocab)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096],
                        help="context lengths of the GPU decode table")
    parser.add_argument("--decode-table", action="store_true",
                        help="the GPU decode table (default with --device cuda; on CPU: a dry run of its logic)")
    parser.add_argument("--table-context-len", type=int, default=0,
                        help="decode table: the engine's context length (default: just what the table needs)")
    parser.add_argument("--backends", nargs="+", default=["torch_native", "triton"],
                        choices=["torch_native", "triton"], help="attention backends of the decode table")
    parser.add_argument("--no-transformers", action="store_true", help="decode table without the transformers column")
    parser.add_argument("--kernel-paths", action="store_true",
                        help="decode tokens/s: eager vs fused Triton kernels vs --enable-torch-compile (bench/kernel_paths.py)")
    parser.add_argument("--compare", action="store_true", help="Shardline vs transformers prefill/decode table (CPU default)")
    parser.add_argument("--profile", action="store_true",
                        help="per-operator torch.profiler table of one decode step of each side, then exit")
    parser.add_argument("--host-overhead", action="store_true",
                        help="host work per decode step outside the model forward (bench/host_overhead.py)")
    parser.add_argument("--host-batch-sizes", type=int, nargs="+", default=[1, 64],
                        help="--host-overhead: decode batch sizes")
    parser.add_argument("--baseline-tree", default=None,
                        help="--host-overhead: another source tree measured side by side (its runtime/)")
    args = parser.parse_args(argv)
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (args.device != "cpu" or torch.get_num_threads() != 1):
        raise SystemExit("--clock cpu measures one CPU thread: use it with --device cpu --threads 1")
    global _clock
    _clock = _CLOCKS[args.clock]
    if args.host_overhead:
        import host_overhead

        with tempfile.TemporaryDirectory() as tmp:
            host_overhead.run(args, make_checkpoint(Path(tmp) / "model", args))
        return
    if args.graphs:
        graphs(args)
        return
    if args.profile:
        profile_decode(args)
        return
    if args.kernel_paths:
        import kernel_paths

        kernel_paths.run(args, make_checkpoint, make_worker, prompts)
        return
    if args.decode_table or (args.device == "cuda" and not args.compare):
        import decode_table

        decode_table.run(args, make_checkpoint, make_worker, prompts)
        return
    results = compare(args)
    shape = f", {args.experts} experts, top {args.top_k}, expert size {args.moe_intermediate}" if args.arch != "llama" else ""
    print(f"\n{args.arch} {args.layers} layers x {args.hidden}{shape}, vocab {args.vocab}, {args.device} {args.dtype}, "
          f"{torch.get_num_threads()} threads, {args.clock} clock; prompt {args.prompt_len} tokens")
    print("| measurement | Shardline best (ms) | transformers best (ms) | ratio of best | ratio of medians |")
    print("|---|---:|---:|---:|---:|")
    labels = {"prefill": f"prefill, batch {args.prefill_batch} x {args.prompt_len} tokens",
              "decode": f"decode step, batch {args.batch_size}"}
    for name, e, h in results:
        median_ratio = statistics.median(e) / statistics.median(h)
        print(f"| {labels[name]} | {min(e) * 1e3:.2f} | {min(h) * 1e3:.2f} | {min(e) / min(h):.3f} | {median_ratio:.3f} |")


if __name__ == "__main__":
    main()

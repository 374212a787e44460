"""GPU decode table: tokens/s of the engine's attention backends and graph modes, and of
transformers, with each one's share of the HBM roofline. Called by ``bench/engine.py --device cuda``.

Columns, per (batch size, context) cell, all on one random model in one process:

- ``torch_native eager`` / ``torch_native graphs``: the torch backend (graphs gather the whole
  context bound per request, by design);
- ``triton eager`` / ``triton graphs``: the Triton backend (split-K decode over the real lengths);
- ``transformers``: ``LlamaForCausalLM`` with ``attn_implementation="sdpa"`` and a ``StaticCache``,
  one ``model(...)`` + argmax per step (eager).

One engine step is ``prepare_for_decode`` + ``forward_batch_generation`` (greedy sampling) +
``.tolist()`` of the tokens, i.e. what the scheduler pays. tokens/s = batch / mean step time over
``--decode-steps`` steps after 3 warm-up steps.

Roofline: the bytes a step must read, ``weights (all but the embedding table, plus bs of its
rows) + KV of the real context (bs x context x layers x 2 x kv_heads x head_dim x 2 bytes)``,
over the step time, as a share of the device's copy bandwidth measured first (a 2 GiB
device-to-device copy, read + write bytes, median of 10, CUDA events). The same useful bytes are
counted for every column, so the share is comparable (a column reading more than it needs, as
torch_native graphs do, shows a lower share).
"""

from __future__ import annotations

import statistics
import time

import torch

from shardline_runtime.managers.schedule_batch import Req, ScheduleBatch
from shardline_runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=None, ignore_eos=True)
PREFILL_TOKENS = 16384  # tokens per prefill forward while building the context


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (bytes read + bytes written), median over ``repeats``
    (CUDA events on a GPU; a host clock on CPU, for dry runs)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def step_bytes(model_config, weight_bytes: int, embed_bytes: int, bs: int, ctx: int) -> int:
    mc = model_config
    kv = bs * ctx * mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 2
    return weight_bytes - embed_bytes + bs * mc.hidden_size * 2 + kv


def build_context(worker, prompts):
    """Prefill ``prompts`` in forwards of <= PREFILL_TOKENS tokens; returns the running batch."""
    running = None
    per = max(1, PREFILL_TOKENS // len(prompts[0]))
    for start in range(0, len(prompts), per):
        reqs = [Req(f"r{start + i}", p, GREEDY) for i, p in enumerate(prompts[start:start + per])]
        batch = ScheduleBatch.init_new(reqs, worker)
        batch.prepare_for_extend()
        result = worker.forward_batch_generation(batch.get_model_worker_batch()).copy_to_cpu().wait()
        for req, token in zip(reqs, result.next_token_ids.tolist()):
            req.append_output(token)
        if running is None:
            running = batch
        else:
            running.merge_batch(batch)
    return running


def replay_only(worker, bs: int, repeats: int = 20) -> float | None:
    """GPU seconds of one replay of the captured decode graph for ``bs`` (CUDA events, mean of
    ``repeats``; its static buffers hold the last real step), i.e. the step without host work."""
    runner = worker.model_runner.graphs.decode
    if runner is None or not runner.graphs:
        return None
    graph = runner.graphs[runner.padded_batch_size(bs)]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def engine_steps(worker, batch, steps: int, use_graphs: bool) -> float | None:
    """Mean seconds per decode step. On CPU (dry runs) "graphs" is the same static-buffer path
    run eagerly (``CudaGraphRunner(capture=False)``)."""
    runner = worker.model_runner
    from shardline_runtime.model_executor.device_graphs import DeviceGraphs

    if use_graphs and runner.graphs.decode is None:
        from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner

        sizes = sorted({1, 8, 32, 64, len(batch.reqs)})
        runner.graphs = DeviceGraphs(runner, decode=CudaGraphRunner(runner, capture=False, batch_sizes=sizes))
    saved = runner.graphs
    if not use_graphs:
        runner.graphs = DeviceGraphs(runner)
    try:
        def step():
            batch.prepare_for_decode()
            result = worker.forward_batch_generation(batch.get_model_worker_batch()).copy_to_cpu().wait()
            for req, token in zip(batch.reqs, result.next_token_ids.tolist()):
                req.append_output(token)

        for _ in range(3):
            step()
        sync(worker.device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(worker.device)
        return (time.perf_counter() - start) / steps
    finally:
        runner.graphs = saved


@torch.inference_mode()
def hf_steps(model, prompts, steps: int, device) -> float:
    from transformers import StaticCache

    ids = torch.tensor(prompts, device=device)
    bs, ctx = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=ctx + steps + 8)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tokens = out.logits[:, -1].argmax(-1)
    del out

    def step(pos):
        nonlocal tokens
        position = torch.full((bs, 1), pos, device=device)
        logits = model(input_ids=tokens[:, None], past_key_values=cache, position_ids=position, use_cache=True).logits
        tokens = logits[:, -1].argmax(-1)
        tokens.tolist()

    for i in range(3):
        step(ctx + i)
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        step(ctx + 3 + i)
    sync(device)
    return (time.perf_counter() - start) / (steps)


def run(args, make_checkpoint, make_worker, prompts) -> None:
    import tempfile
    from pathlib import Path

    import transformers

    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, nbytes=(2 << 30) if device.type == "cuda" else (64 << 20))
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (dry run)"
    print(f"{name}: measured copy bandwidth {bandwidth / 1e12:.2f} TB/s "
          "(read + write bytes of a device-to-device copy)", flush=True)
    contexts, batches = args.contexts, args.graph_batch_sizes
    # the engine's context length: room for eager, then graph steps on one batch, or more when asked
    # (torch_native graphs gather this many KV columns per request whatever the real lengths)
    args.context_len = max(max(contexts) + 2 * (args.decode_steps + 3) + 16, args.table_context_len)
    args.batch_size = max(batches)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), args)
        workers = {}
        for backend in args.backends:
            t0 = time.perf_counter()
            workers[backend] = make_worker(path, args, disable_cuda_graph=False, attention_backend=backend,
                                           max_total_tokens=max(batches) * args.context_len)
            print(f"{backend}: worker ready in {time.perf_counter() - t0:.1f} s (load + KV pool + graph capture)",
                  flush=True)
        hf = None if args.no_transformers else transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, args.dtype), attn_implementation="sdpa").to(device).eval()
    mr = next(iter(workers.values())).model_runner
    weight_bytes = sum(p.numel() * p.element_size() for p in mr.model.parameters())
    embed = mr.model.model.embed_tokens.weight
    embed_bytes = embed.numel() * embed.element_size()
    print(f"model: {mr.model_config.num_hidden_layers} layers x {mr.model_config.hidden_size}, "
          f"{mr.model_config.num_attention_heads} heads / {mr.model_config.num_key_value_heads} KV heads, vocab "
          f"{mr.model_config.vocab_size}, {args.dtype}; {weight_bytes / 1e9:.2f} GB of weights", flush=True)
    columns = ["torch_native eager", "torch_native graphs", "triton eager", "triton graphs", "transformers",
               "triton graph replay"]
    rows = []
    for ctx in contexts:
        for bs in batches:
            batch_prompts = prompts(bs, ctx, args.vocab, seed=bs + ctx)
            useful = step_bytes(mr.model_config, weight_bytes, embed_bytes, bs, ctx)
            cells = {}
            for backend, worker in workers.items():
                try:
                    batch = build_context(worker, batch_prompts)
                    for graphs in (False, True):
                        t = engine_steps(worker, batch, args.decode_steps, graphs)
                        if t is not None:
                            cells[f"{backend} {'graphs' if graphs else 'eager'}"] = t
                    if backend == "triton" and device.type == "cuda":
                        cells["triton graph replay"] = replay_only(worker, bs)
                    for req in batch.reqs:
                        batch.release_kv(req)
                except Exception as exc:  # keep the table going; the cell says what failed
                    print(f"  {backend} bs {bs} ctx {ctx}: {type(exc).__name__}: {exc}", flush=True)
            try:
                if hf is not None:
                    cells["transformers"] = hf_steps(hf, batch_prompts, args.decode_steps, device)
            except Exception as exc:
                print(f"  transformers bs {bs} ctx {ctx}: {type(exc).__name__}: {exc}", flush=True)
            torch.cuda.empty_cache()
            rows.append((ctx, bs, useful, cells))
            line = ", ".join(f"{c} {bs / t:.0f} tok/s ({useful / t / bandwidth:.0%})" for c, t in cells.items() if t)
            print(f"ctx {ctx} bs {bs}: {line}", flush=True)
    print(f"\nDecode tokens/s (share of the HBM roofline: useful bytes per step / step time / copy bandwidth); "
          f"engine context length {args.context_len}. 'triton graph replay': the captured step alone (GPU time, "
          "no host work), as if the scheduler hid all host work")
    print("| context | batch | " + " | ".join(columns) + " |")
    print("|---:|---:|" + "---:|" * len(columns))
    for ctx, bs, useful, cells in rows:
        out = []
        for c in columns:
            t = cells.get(c)
            out.append("n/a" if not t else f"{bs / t:,.0f} ({useful / t / bandwidth:.0%})")
        print(f"| {ctx} | {bs} | " + " | ".join(out) + " |")
    print("\nRatios: graphs / eager (triton), triton / torch_native (graphs)")
    for ctx, bs, _, cells in rows:
        g, e, n = cells.get("triton graphs"), cells.get("triton eager"), cells.get("torch_native graphs")
        if g and e and n:
            print(f"  ctx {ctx} bs {bs}: graphs {e / g:.2f}x eager; triton {n / g:.2f}x torch_native")

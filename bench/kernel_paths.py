"""Decode tokens/s of the three kernel paths of one model, side by side in one process
(issue 24 item 3): ``eager`` (every op a PyTorch kernel: RMSNorm, residual add, SiLU-and-mul,
rotary and the KV store unfused), ``fused`` (the hand-written Triton kernels: fused residual add +
RMSNorm, SiLU-and-mul, rotary + KV store; the CUDA default) and ``compile``
(``--enable-torch-compile``: Inductor compiles what lies between two attentions).

On CUDA every column replays the decode CUDA graphs and the table gives each one's share of the
HBM roofline (``decode_table.py``: useful bytes per step / step time / measured copy bandwidth).
On the CPU there are no graphs and no Triton kernels: it compares ``eager`` with ``compile``
(Inductor's C++ backend) on the static-buffer path. One engine step is what the scheduler pays
(``prepare_for_decode`` + ``forward_batch_generation`` + ``.tolist()``), mean over
``--decode-steps`` after 3 warm-up steps (the compile happens in the warm-up).

Usage::

    python bench/engine.py --kernel-paths --threads 1 --graph-batch-sizes 1 8 --contexts 128
    python bench/engine.py --kernel-paths --device cuda --preset llama-1b --dtype bfloat16 \
        --graph-batch-sizes 1 --contexts 512
"""

from __future__ import annotations

import time

import decode_table
import torch


def _pin_kernels(worker, triton: bool) -> None:
    """Every RMSNorm / SiLU-and-mul / attention layer on (or off) its Triton kernel."""
    from shardline_runtime.layers.activation import SiluAndMul
    from shardline_runtime.layers.layernorm import RMSNorm
    from shardline_runtime.layers.radix_attention import RadixAttention

    for module in worker.model_runner.model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul)):
            module.use_triton = triton
        elif isinstance(module, RadixAttention):
            module.fuse_rope_kv = triton


def build_workers(path, args, make_worker) -> dict:
    """``{column: worker}``; on CUDA each captures its graphs with its kernels pinned."""
    cuda = args.device == "cuda"
    columns = ["eager", "fused", "compile"] if cuda else ["eager", "compile"]
    tokens = max(args.graph_batch_sizes) * args.context_len
    workers = {}
    for column in columns:
        t0 = time.perf_counter()
        worker = make_worker(path, args, disable_cuda_graph=not (cuda or column == "compile"),
                             max_total_tokens=tokens, enable_torch_compile=column == "compile",
                             torch_compile_max_bs=max(args.graph_batch_sizes))
        if column == "eager" and cuda:
            _pin_kernels(worker, triton=False)
            worker.model_runner.graphs.capture()  # the graphs record the pinned kernels
        workers[column] = worker
        print(f"{column}: worker ready in {time.perf_counter() - t0:.1f} s", flush=True)
    return workers


def run(args, make_checkpoint, make_worker, prompts) -> None:
    import tempfile
    from pathlib import Path

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    bandwidth = decode_table.copy_bandwidth(device, nbytes=(2 << 30) if cuda else (64 << 20))
    args.context_len = max(args.contexts) + 2 * (args.decode_steps + 3) + 16
    args.batch_size = max(args.graph_batch_sizes)
    with tempfile.TemporaryDirectory() as tmp:
        workers = build_workers(make_checkpoint(Path(tmp), args), args, make_worker)
    mr = workers["eager"].model_runner
    weight_bytes = sum(p.numel() * p.element_size() for p in mr.model.parameters())
    embed = mr.model.model.embed_tokens.weight
    embed_bytes = embed.numel() * embed.element_size()
    print(f"model: {mr.model_config.num_hidden_layers} layers x {mr.model_config.hidden_size}, {args.dtype}, "
          f"{args.device}, {torch.get_num_threads()} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    rows = []
    for ctx in args.contexts:
        for bs in args.graph_batch_sizes:
            batch_prompts = prompts(bs, ctx, args.vocab, seed=bs + ctx)
            useful = decode_table.step_bytes(mr.model_config, weight_bytes, embed_bytes, bs, ctx)
            cells = {}
            for column, worker in workers.items():
                batch = decode_table.build_context(worker, batch_prompts)
                use_graphs = cuda or column == "compile"  # CPU compile: the padded static path
                cells[column] = decode_table.engine_steps(worker, batch, args.decode_steps, use_graphs)
                for req in batch.reqs:
                    batch.release_kv(req)
            rows.append((ctx, bs, useful, cells))
    print("\nDecode tokens/s per kernel path" + (" (CUDA graphs; share of the HBM roofline)" if cuda else
                                                 " (CPU: no graphs, no Triton)"))
    columns = list(workers)
    print("| context | batch | " + " | ".join(columns) + " | " +
          " | ".join(f"{c} / eager" for c in columns[1:]) + " |")
    print("|---:|---:|" + "---:|" * (2 * len(columns) - 1))
    for ctx, bs, useful, cells in rows:
        share = (lambda t: f" ({useful / t / bandwidth:.0%})") if cuda else (lambda t: "")
        out = [f"{bs / cells[c]:,.1f}{share(cells[c])}" for c in columns]
        out += [f"{cells['eager'] / cells[c]:.2f}x" for c in columns[1:]]
        print(f"| {ctx} | {bs} | " + " | ".join(out) + " |", flush=True)

"""Graphs in every mode against eager: each engine with and without its graphs (issue 24, items 1, 5).

Rows, each printed as one JSON line and then as a table:
- ``prefill``: EXTEND tokens/s with piecewise CUDA graphs against eager (one batch of prompts);
- ``fp8-kv``: decode tokens/s with an fp8 (e4m3) KV cache against the model dtype, at a long
  context (default 4096), decode graphs on;
- ``lora``: decode tokens/s at batch 1 with a LoRA adapter, graphs against eager;
- ``recorder``: decode tokens/s at batch 1 of a MoE model while the expert-distribution
  recorder records, graphs against eager.

Every graph row also prints what the runner reported capturing (``DeviceGraphs.report``); on a
CUDA device a graph row that captured nothing fails the run (exit 1), so a mode that silently
fell back to eager cannot pass for a graph measurement. On CPU (``--device cpu``, the dry run of
``bench/gpu_check.sh``) nothing is captured, every row runs eagerly, and only the logic is
checked.

    python bench/graph_modes.py --device cuda --preset llama-1b --dtype bfloat16
    python bench/graph_modes.py --device cpu --layers 2 --hidden 64 --heads 4 --kv-heads 2 \\
        --intermediate 128 --vocab 512 --context 64 --prompt-len 16 --steps 2     # dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine  # noqa: E402  (bench/engine.py: checkpoint, prefill and decode loops)

from shardline_runtime.lora.tiny_adapter import write_tiny_adapter  # noqa: E402
from shardline_runtime.managers.req import Req  # noqa: E402
from shardline_runtime.managers.schedule_batch import ScheduleBatch  # noqa: E402
from shardline_runtime.managers.tp_worker import TpModelWorker  # noqa: E402
from shardline_runtime.model_executor.device_graphs import DeviceGraphs  # noqa: E402
from shardline_runtime.server_args import ServerArgs  # noqa: E402


def make_worker(path: Path, args, tokens: int, **flags) -> TpModelWorker:
    """An engine on ``path`` with room for ``tokens`` KV slots and decode graphs up to batch 32."""
    server_args = ServerArgs(
        model_path=str(path), device=args.device, dtype=args.dtype, max_total_tokens=tokens,
        max_running_requests=32, cuda_graph_max_bs=32, context_length=args.context + 64, **flags,
    )
    return TpModelWorker(server_args, 0)


@contextmanager
def eagerly(worker) -> Iterator[None]:
    """Run ``worker`` without its graphs for a while (the same engine, weights and KV pool)."""
    runner = worker.model_runner
    held, runner.graphs = runner.graphs, DeviceGraphs(runner)
    try:
        yield
    finally:
        runner.graphs = held


def report(worker) -> dict:
    return worker.captured_graphs().model_dump(mode="json")


def prefill_tokens_per_s(worker, args) -> float:
    batch_prompts = engine.prompts(args.prefill_batch, args.prompt_len, args.vocab, seed=1)
    best = float("inf")
    for _ in range(args.repeats):
        seconds, _, batch = engine.engine_prefill(worker, batch_prompts)
        engine.engine_decode(worker, batch, 1)  # frees the batch's KV
        best = min(best, seconds)
    return args.prefill_batch * args.prompt_len / best


def decode_tokens_per_s(worker, args, bs: int, context: int, lora_name: str | None = None) -> float:
    """Prefill ``bs`` prompts of ``context`` tokens, then time ``args.steps`` decode steps."""
    batch_prompts = engine.prompts(bs, context, args.vocab, seed=2)
    reqs = [Req(f"d{i}", p, engine.GREEDY, lora_name=lora_name) for i, p in enumerate(batch_prompts)]
    batch = ScheduleBatch.init_new(reqs, worker)
    batch.prepare_for_extend()
    first = worker.forward_batch_generation(batch.get_model_worker_batch()).copy_to_cpu().wait()
    for req, token in zip(reqs, first.next_token_ids.tolist()):
        req.append_output(token)
    seconds = engine.engine_decode(worker, batch, args.steps)[0]
    return bs / seconds


def row(name: str, mode_a: str, a: float, mode_b: str, b: float, captured: dict) -> dict:
    out = {"row": name, mode_a: round(a, 1), mode_b: round(b, 1), "ratio": round(a / b, 2) if b else None,
           "captured": captured}
    print(json.dumps(out), flush=True)
    return out


def run(args) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="graph-modes-"))
    shape = SimpleNamespace(**{**vars(args), "arch": "llama", "context_len": args.context + 64, "top_k": 2,
                               "moe_intermediate": args.intermediate // 4})
    dense = engine.make_checkpoint(root / "dense", shape)
    wide = 8 if args.device == "cuda" else 1  # the widest fp8 decode row
    tokens = (args.context + args.steps + 16) * (wide + 1) + args.prefill_batch * (args.prompt_len + 4)
    rows = []

    both = make_worker(dense, args, tokens, enable_piecewise_cuda_graph=True,
                       piecewise_cuda_graph_max_tokens=args.prefill_batch * args.prompt_len)
    with eagerly(both):
        eager_prefill = prefill_tokens_per_s(both, args)
    rows.append(row("prefill", "piecewise_tok_s", prefill_tokens_per_s(both, args),
                    "eager_tok_s", eager_prefill, report(both)))
    fp8 = make_worker(dense, args, tokens, kv_cache_dtype="fp8_e4m3")
    for bs in sorted({1, wide}):
        rows.append(row(f"fp8-kv bs{bs} ctx{args.context}", "fp8_tok_s",
                        decode_tokens_per_s(fp8, args, bs, args.context),
                        f"{args.dtype}_tok_s", decode_tokens_per_s(both, args, bs, args.context), report(fp8)))
    del fp8, both

    adapter = write_tiny_adapter(root / "adapter", dense, rank=16)
    lora = make_worker(dense, args, tokens, enable_lora=True, lora_paths=(f"a={adapter}",), max_lora_rank=16)
    with eagerly(lora):
        eager_lora = decode_tokens_per_s(lora, args, 1, args.prompt_len, "a")
    rows.append(row("lora bs1", "graphs_tok_s", decode_tokens_per_s(lora, args, 1, args.prompt_len, "a"),
                    "eager_tok_s", eager_lora, report(lora)))
    del lora

    moe = make_worker(engine.make_checkpoint(root / "moe", SimpleNamespace(**{**vars(shape), "arch": "qwen3_moe"})),
                      args, tokens)
    moe.model_runner.eplb_manager.recorder.start()
    with eagerly(moe):
        eager_moe = decode_tokens_per_s(moe, args, 1, args.prompt_len)
    rows.append(row("recorder bs1", "graphs_tok_s", decode_tokens_per_s(moe, args, 1, args.prompt_len),
                    "eager_tok_s", eager_moe, report(moe)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--preset", choices=sorted(engine.PRESETS), default=None)
    for name, default in (("layers", 2), ("hidden", 64), ("heads", 4), ("kv-heads", 2), ("intermediate", 128),
                          ("vocab", 512), ("experts", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--context", type=int, default=4096, help="context of the fp8-KV rows")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill rows: tokens per prompt")
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per row")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for key, value in engine.PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)
    torch.manual_seed(0)
    rows = run(args)
    print(f"\n{'row':<26} {'graphs/fp8':>12} {'eager/base':>12} {'ratio':>7}  captured")
    for r in rows:
        a, b = (v for k, v in r.items() if k.endswith("_tok_s"))
        captured = r["captured"]
        what = captured["decode_batch_sizes"] or captured["piecewise_token_buckets"] or captured["reason"]
        print(f"{r['row']:<26} {a:>12} {b:>12} {r['ratio']!s:>7}  {what}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    missing = [r["row"] for r in rows if args.device == "cuda" and not (
        r["captured"]["decode_batch_sizes"] or r["captured"]["piecewise_token_buckets"])]
    if missing:
        print(f"bench/graph_modes.py: no graph was captured for {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

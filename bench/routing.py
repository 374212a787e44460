"""Routing benchmark: the Shepherd Model Gateway (``smg``) in front of two runtime servers,
cache-aware policy vs round robin, and the client's own round robin as a baseline.

Two real ``shardline_runtime serve`` processes on one tiny llama checkpoint (CPU). The same
seeded trace of streamed chat requests (``--prefixes`` system prompts, each shared by
``--per-prefix`` requests, shuffled) is replayed at ``--concurrency`` through each route; the
servers are warmed up once, and their prefix caches flushed (``/flush_cache``) before each route. Reported per route:
TTFT p50/p99 (client-side, first content chunk) and the prefix-cache hit rate (sum of
``usage.prompt_tokens_details.cached_tokens`` over sum of ``prompt_tokens``), plus how the
servers' ``shardline:cached_tokens_total`` counters grew (a cross-check of the usage figures).

    python bench/routing.py            # needs `pip install 'shardline[gateway]'` (smg)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "tests" / "serving"))

from serving import percentile  # noqa: E402  (bench/serving.py)
from serving_server import ServerProcess, start_server  # noqa: E402
from smg_gateway import counter, prefix_trace, replay, smg_binary, start_smg  # noqa: E402

MODEL = "tiny-llama"


def run_route(name: str, send, servers: list[ServerProcess], args) -> dict:
    """Replay the trace through ``send`` (a list of base URLs: round robin over them; else a
    callable ``send(trace) -> outcomes``) after flushing the servers' prefix caches."""
    for s in servers:
        s.post("/flush_cache").raise_for_status()
    before = [counter(s, "cached_tokens") for s in servers]
    trace = prefix_trace(args.prefixes, args.per_prefix, args.seed, args.prefix_words)
    if isinstance(send, list):
        outcomes = asyncio.run(replay(send, MODEL, trace, args.concurrency, args.max_tokens))
    else:
        outcomes = send(trace)
    grew = [counter(s, "cached_tokens") - b for s, b in zip(servers, before)]
    ttfts = [o.ttft * 1000 for o in outcomes]
    return {"route": name, "requests": len(outcomes), "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p99_ms": percentile(ttfts, 99),
            "hit_rate": sum(o.cached_tokens for o in outcomes) / sum(o.prompt_tokens for o in outcomes),
            "metrics_cached": [int(g) for g in grew]}


def add_trace_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--per-prefix", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-words", type=int, default=160, help="words in each shared system prompt")


def print_table(rows: list[dict], args, workers: int = 2) -> None:
    print(f"trace: {args.prefixes} prefixes x {args.per_prefix} requests, seed {args.seed}, "
          f"{args.prefix_words}-word prefixes, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          f"{workers} workers")
    print("| route | requests | TTFT p50 (ms) | TTFT p99 (ms) | prefix-cache hit rate | cached tokens per worker (/metrics) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['route']} | {r['requests']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
              f"{r['hit_rate']:.1%} | {' / '.join(map(str, r['metrics_cached']))} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(ap)
    args = ap.parse_args(argv)
    if smg_binary() is None:
        print("smg is not installed: pip install 'shardline[gateway]'", file=sys.stderr)
        return 2
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="shardline-routing-"))
    make_tiny_checkpoint(work / "ckpt", arch="llama", seed=0, max_position_embeddings=4096)
    servers = [start_server(work / "ckpt", work, "--served-model-name", MODEL, "--max-total-tokens", "65536")
               for _ in range(2)]
    rows = []
    try:  # warm-up (first-call costs in both servers), on another seed's trace
        asyncio.run(replay([s.url for s in servers], MODEL, prefix_trace(4, 2, args.seed + 1000), args.concurrency))
        rows.append(run_route("client round robin (no gateway)", [s.url for s in servers], servers, args))
        for policy in ("round_robin", "cache_aware"):
            gateway = start_smg([s.url for s in servers], policy, work)
            try:
                rows.append(run_route(f"smg --policy {policy}", [gateway.url], servers, args))
            finally:
                gateway.stop()
    finally:
        for s in servers:
            s.stop()
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

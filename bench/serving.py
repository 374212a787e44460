"""Serving benchmark: an OpenAI-API load generator, and Shardline vs transformers static batching.

Workload (fixed seed): prompts of random token ids with random lengths, random output lengths
(``ignore_eos`` so every request produces exactly its length), sent to ``/v1/completions`` with
streaming. Closed loop at concurrency C (each of C clients sends its next request when the
previous one ends) or open loop at ``--request-rate`` (Poisson arrivals). Reported: output
tokens/s, TTFT and inter-token latency p50/p99, e2e latency p50/p99.

Baseline, same model, same requests, same process machine: ``transformers`` ``generate`` with
static batching, what a user would otherwise write: take C requests, left-pad, generate up to
the longest ``max_tokens`` of the batch, cut each output to its length, next batch. Its TTFT and
ITL come from per-step timestamps (a logits processor).

    python bench/serving.py --concurrency 1 4 16 64 --out docs/figures/serving_throughput.png

``--compare-overlap`` serves the same requests from a second server started with
``--disable-overlap-schedule`` (overlap scheduling off), right after the first at each level.

``--device cuda`` serves on the GPU (``--dtype``, default bfloat16 there) and ``--preset llama-1b``
uses a random-weight model of that shape (``bench/engine.py``'s presets; the tokenizer is the tiny
one, prompts are token ids); ``bench/gpu_check.sh`` runs it at concurrency 1, 16 and 64 with
``--compare-overlap``.

``--client guidellm`` (or ``both``) also drives the server with guidellm on the same requests
(``bench/guidellm_client.py``): its synchronous / concurrent profile at each level, then its
throughput profile beside our client with every request in flight at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "tests" / "serving"))

BENCH_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, max_position_embeddings=2048)


def preset_model(name: str) -> dict:
    """``make_tiny_checkpoint`` arguments for a ``bench/engine.py`` preset (random weights)."""
    sys.path.insert(0, str(REPO / "bench"))
    from engine import PRESETS

    s = PRESETS[name]
    return dict(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
                max_position_embeddings=8192, initializer_range=0.02)


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    prompt_text: str | None = None  # sent instead of the ids when set (the guidellm comparison)


@dataclass
class Result:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0


def make_workload(n: int, seed: int, prompt_len: tuple[int, int], output_len: tuple[int, int], long_fraction: float,
                  long_output: tuple[int, int], vocab: int = 500) -> list[Request]:
    """``n`` requests; a ``long_fraction`` of them get outputs in ``long_output`` (mixed lengths)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(*prompt_len)
        olen = rng.randint(*(long_output if rng.random() < long_fraction else output_len))
        out.append(Request([rng.randrange(5, vocab) for _ in range(plen)], olen))
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and all its descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)  # ppid, utime+stime
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _) in stats.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(stats[p][1] for p in tree if p in stats)


def summarize(name: str, concurrency: int, results: list[Result], wall: float, cpu: float | None = None,
              client_cpu: float | None = None) -> dict:
    tokens = sum(r.output_tokens for r in results)
    itls = [x for r in results for x in r.itls]
    ttfts = [r.ttft for r in results if r.ttft is not None]
    e2es = [r.e2e for r in results]
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "backend": name, "concurrency": concurrency, "requests": len(results), "output_tokens": tokens,
        "wall_s": round(wall, 3), "output_tok_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "itl_p50_ms": ms(percentile(itls, 50)), "itl_p99_ms": ms(percentile(itls, 99)),
        "e2e_p50_ms": ms(percentile(e2es, 50)), "e2e_p99_ms": ms(percentile(e2es, 99)),
        "mean_e2e_ms": ms(statistics.fmean(e2es)) if e2es else None,
        "cpu_s": None if cpu is None else round(cpu, 3),
        "output_tok_per_cpu_s": None if not cpu else round(tokens / cpu, 1),
        "client_cpu_s": None if client_cpu is None else round(client_cpu, 2),
    }


# ------------------------------------------------------------------ Shardline over HTTP

async def _one(client: httpx.AsyncClient, url: str, model: str, req: Request) -> Result:
    body = {"model": model, "prompt": req.prompt_text or req.prompt_ids, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    start = last = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            if event.get("usage"):
                res.output_tokens = event["usage"]["completion_tokens"]
            if any(c.get("text") for c in event["choices"]):
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
    res.e2e = time.perf_counter() - start
    return res


async def run_load(url: str, model: str, requests: list[Request], concurrency: int | None,
                   request_rate: float | None, seed: int) -> tuple[list[Result], float, float]:
    """Closed loop at ``concurrency``, or open loop with Poisson arrivals at ``request_rate``/s.
    Returns the results, the wall seconds, and the CPU seconds this client process used."""
    limits = httpx.Limits(max_connections=(concurrency or len(requests)) + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        start, client_cpu = time.perf_counter(), time.process_time()
        if request_rate:
            rng = random.Random(seed)
            tasks = []
            for req in requests:
                tasks.append(asyncio.create_task(_one(client, url, model, req)))
                await asyncio.sleep(rng.expovariate(request_rate))
            results = await asyncio.gather(*tasks)
        else:
            queue = list(enumerate(requests))[::-1]
            results: list = [None] * len(requests)

            async def worker():
                while queue:
                    i, req = queue.pop()
                    results[i] = await _one(client, url, model, req)

            await asyncio.gather(*[worker() for _ in range(concurrency)])
        return results, time.perf_counter() - start, time.process_time() - client_cpu


# ------------------------------------------------------------------ transformers static batching

def run_hf_static(model_path: str, requests: list[Request], batch_size: int, threads: int) -> tuple[list[Result], float, float]:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    class StepClock(transformers.LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    results = [Result() for _ in requests]
    start, cpu_start = time.perf_counter(), time.process_time()
    for b in range(0, len(requests), batch_size):
        idx = list(range(b, min(b + batch_size, len(requests))))
        width = max(len(requests[i].prompt_ids) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):  # left padding, as decoder-only batching needs
            p = requests[i].prompt_ids
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        longest = max(requests[i].max_tokens for i in idx)
        clock = StepClock()
        batch_start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           pad_token_id=0, logits_processor=transformers.LogitsProcessorList([clock]))
        steps = clock.times
        for i in idx:
            n = requests[i].max_tokens
            results[i].output_tokens = n
            results[i].ttft = steps[0] - batch_start
            results[i].itls = [steps[k] - steps[k - 1] for k in range(1, n)]
            results[i].e2e = steps[n - 1] - batch_start if n <= len(steps) else steps[-1] - batch_start
    return results, time.perf_counter() - start, time.process_time() - cpu_start


# ------------------------------------------------------------------ orchestration

def start_shardline(model_path: str, args, *flags: str) -> tuple[object, str]:
    from serving_server import start_server

    log_dir = Path(tempfile.mkdtemp(prefix="shardline-bench-"))
    extra = ["--max-total-tokens", str(args.max_total_tokens), "--served-model-name", "bench",
             "--max-running-requests", str(max(args.concurrency)), "--log-level", "warning",
             "--device", args.device, "--dtype", args.dtype, *flags]
    server = start_server(model_path, log_dir, *extra, timeout=300, env={"OMP_NUM_THREADS": str(args.threads)})
    return server, "bench"


def plot(rows: list[dict], path: Path, key: str = "output_tok_per_s") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for backend, style in (("shardline", "o-"), ("transformers-static", "s--")):
        pts = sorted((r["concurrency"], r[key]) for r in rows if r["backend"] == backend)
        if pts:
            ax.plot(*zip(*pts), style, label=backend)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / CPU second" if key == "output_tok_per_cpu_s" else "output tokens / s")
    ax.set_title("Throughput vs concurrency (CPU, mixed lengths)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_guidellm_level(args, url: str, model: str, model_path: str, requests: list[Request], concurrency: int | None,
                       server) -> list[dict]:
    """guidellm on ``requests`` (as text) at ``concurrency`` (None: its throughput profile), then,
    with ``--client both``, our client on the same text prompts right after it (same load)."""
    from guidellm_client import report_rows, run_guidellm, write_dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    for r in requests:
        r.prompt_text = r.prompt_text or tok.decode(r.prompt_ids)
    dataset = write_dataset([r.prompt_text for r in requests], [len(r.prompt_ids) for r in requests],
                            [r.max_tokens for r in requests], Path(tempfile.mkdtemp(prefix="guidellm-data-")) / "data.jsonl")
    profile = "throughput" if concurrency is None else "synchronous" if concurrency == 1 else "concurrent"
    level = concurrency or len(requests)
    cpu0 = process_tree_cpu_seconds(server.proc.pid) if server is not None else None
    report = run_guidellm(args.guidellm_bin, url, model or "default", model_path, dataset, profile, level, len(requests))
    rows = report_rows(report, level)
    if server is not None:  # the server's CPU seconds over the whole guidellm run (it adds a warm-up request or so)
        cpu = process_tree_cpu_seconds(server.proc.pid) - cpu0
        rows[-1].update(cpu_s=round(cpu, 3), output_tok_per_cpu_s=round(rows[-1]["output_tokens"] / cpu, 1))
    if args.client == "both":
        cpu0 = process_tree_cpu_seconds(server.proc.pid) if server is not None else None
        results, wall, client_cpu = asyncio.run(run_load(url, model, requests, level, None, args.seed))
        cpu = process_tree_cpu_seconds(server.proc.pid) - cpu0 if server is not None else None
        rows.append(summarize("shardline-text", level, results, wall, cpu, client_cpu))
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", help="checkpoint dir (default: build a 4-layer, 256-wide llama with a fixed seed)")
    p.add_argument("--url", help="benchmark an already running server instead of starting one")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument("--requests-per-level", type=int, default=0, help="default: max(16, 4 x concurrency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[8, 256])
    p.add_argument("--output-len", type=int, nargs=2, default=[4, 32])
    p.add_argument("--long-output", type=int, nargs=2, default=[128, 256])
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--baseline", choices=["hf", "none"], default="hf")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the server's scheduler and of the transformers baseline (same for both)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="throughput per wall second, or per CPU second of the serving processes (robust on a shared machine)")
    p.add_argument("--client", choices=["ours", "guidellm", "both"], default="ours",
                   help="load generator: this script's, guidellm on the same requests (text prompts), or both")
    p.add_argument("--guidellm-bin", default="guidellm", help="the guidellm executable")
    p.add_argument("--compare-overlap", action="store_true",
                   help="also serve with --disable-overlap-schedule (a second server, same requests, run right after)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the server runs the model")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="model dtype of the server (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--preset", choices=["llama-1b"], default=None,
                   help="random-weight model of this shape instead of the 4-layer default (bench/engine.py PRESETS)")
    p.add_argument("--json", type=Path, default=None, help="write the result rows here")
    p.add_argument("--out", type=Path, default=None, help="PNG plot of throughput vs concurrency")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and args.baseline == "hf":
        p.error("--baseline hf runs transformers on the CPU; use --baseline none with --device cuda")

    model_path = args.model_path
    if model_path is None:
        from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

        shape = preset_model(args.preset) if args.preset else BENCH_MODEL
        model_path = str(make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="bench-model-")), seed=args.seed, **shape))
    server = None
    url, model = args.url, None
    if url is None:
        server, model = start_shardline(model_path, args)
        url = server.url
    others = []  # (backend label, server) run on the same requests after the main one
    if args.compare_overlap:
        others.append(("shardline-no-overlap", start_shardline(model_path, args, "--disable-overlap-schedule")[0]))
    rows = []
    try:
        for c in args.concurrency:
            n = args.requests_per_level or max(16, 4 * c)
            requests = make_workload(n, args.seed + c, tuple(args.prompt_len), tuple(args.output_len),
                                     args.long_fraction, tuple(args.long_output))
            if args.client != "ours":
                rows += run_guidellm_level(args, url, model, model_path, requests, c, server)
                if args.client == "guidellm":
                    continue
            asyncio.run(run_load(url, model, requests[: min(4, n)], c, None, args.seed))  # warm-up
            cpu0 = process_tree_cpu_seconds(server.proc.pid) if server is not None else None
            results, wall, client_cpu = asyncio.run(run_load(url, model, requests, c, args.request_rate, args.seed))
            cpu = process_tree_cpu_seconds(server.proc.pid) - cpu0 if server is not None else None
            rows.append(summarize("shardline", c, results, wall, cpu, client_cpu))
            print(json.dumps(rows[-1]), flush=True)
            for label, other in others:
                asyncio.run(run_load(other.url, model, requests[: min(4, n)], c, None, args.seed))  # warm-up
                cpu0 = process_tree_cpu_seconds(other.proc.pid)
                results, wall, client_cpu = asyncio.run(run_load(other.url, model, requests, c, args.request_rate, args.seed))
                cpu = process_tree_cpu_seconds(other.proc.pid) - cpu0
                rows.append(summarize(label, c, results, wall, cpu, client_cpu))
                print(json.dumps(rows[-1]), flush=True)
            if args.baseline == "hf":
                results, wall, cpu = run_hf_static(model_path, requests, c, args.threads)
                rows.append(summarize("transformers-static", c, results, wall, cpu))
                print(json.dumps(rows[-1]), flush=True)
        if args.client != "ours":
            rows += run_guidellm_level(args, url, model, model_path, requests, None, server)
    finally:
        for other in [server] + [o for _, o in others]:
            if other is not None:
                other.stop()
    key = "output_tok_per_cpu_s" if args.clock == "cpu" else "output_tok_per_s"
    for c in args.concurrency:
        level = {r["backend"]: r for r in rows if r["concurrency"] == c}
        for other in ("transformers-static", "shardline-no-overlap"):
            if other in level and level["shardline"][key] and level[other][key]:
                ratio = level["shardline"][key] / level[other][key]
                print(f"concurrency {c}: shardline / {other} {key} = {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.out:
        plot(rows, args.out, key)
    return 0


if __name__ == "__main__":
    sys.exit(main())

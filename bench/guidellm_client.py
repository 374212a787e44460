"""guidellm (vLLM project's load generator) as a second benchmark client of ``bench/serving.py``.

It is driven on the same requests as our own client: the workload's prompts, decoded to text
(guidellm sends text), written as a JSON-lines dataset with ``prompt``, ``prompt_tokens_count``
and ``output_tokens_count`` columns; guidellm then asks for exactly that many output tokens
(``max_tokens`` + ``ignore_eos``, streamed ``/v1/completions``). Profiles: ``synchronous`` (one
request at a time: our concurrency 1), ``concurrent`` with ``streams=C`` (our closed loop at C)
and ``throughput`` (every request at once). Its JSON report is reduced to the same row format as
``bench/serving.py``'s own (output tokens/s over the benchmark's duration, TTFT, ITL and e2e
percentiles).

Install it apart from the dev tools (it pins click and pulls sanic): ``pip install
'shardline[bench]'`` or ``pip install 'guidellm>=0.8.1'`` into a virtual environment, and pass
its executable with ``--guidellm-bin``.
"""

from __future__ import annotations

import json
import resource
import subprocess
import tempfile
from pathlib import Path


def write_dataset(prompts: list[str], prompt_lens: list[int], output_lens: list[int], path: Path) -> Path:
    """One JSON line per request: ``prompt``, ``prompt_tokens_count``, ``output_tokens_count``."""
    with open(path, "w") as f:
        for text, n_in, n_out in zip(prompts, prompt_lens, output_lens):
            f.write(json.dumps({"prompt": text, "prompt_tokens_count": n_in, "output_tokens_count": n_out}) + "\n")
    return path


def profile_args(profile: str, concurrency: int | None) -> list[str]:
    """guidellm ``--profile`` for ``synchronous``, ``concurrent`` (``streams=concurrency``) or
``throughput`` (everything at once, at most ``concurrency`` in flight)."""
    if profile == "concurrent":
        return ["--profile", f"kind=concurrent,streams={concurrency}"]
    if profile == "throughput":
        return ["--profile", f"kind=throughput,max_concurrency={concurrency}"]
    return ["--profile", f"kind={profile}"]


def run_guidellm(bin_path: str, url: str, model: str, tokenizer: str, dataset: Path, profile: str,
                 concurrency: int | None, requests: int, timeout: float = 3600) -> dict:
    """Run one guidellm benchmark; return its JSON report, plus ``client_cpu_s``: the CPU seconds
    guidellm's own processes used (on a shared machine they compete with the server).

    Raises:
        RuntimeError: guidellm failed (the end of its output is in the message).
    """
    out = Path(tempfile.mkdtemp(prefix="guidellm-")) / "report.json"
    cmd = [bin_path, "run",
           "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
           *profile_args(profile, concurrency),
           "--constraint", f"kind=max_requests,count={requests}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer}",
           "--data", f"kind=json_file,path={dataset}",
           "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
    report = json.loads(out.read_text())
    report["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return report


def _stat(metrics: dict, name: str, key: str, scale: float = 1.0) -> float | None:
    successful = metrics[name]["successful"]
    value = successful["percentiles"].get(key) if key.startswith("p") else successful.get(key)
    return None if value is None or not successful.get("count") else round(value * scale, 2)


def report_rows(report: dict, concurrency: int) -> list[dict]:
    """``bench/serving.py`` rows from a guidellm report (one per benchmark in it).

    Throughput is completed output tokens over the benchmark's duration (as ours: tokens over
    wall time); guidellm's ITL is per request ``(e2e - TTFT) / (output tokens - 1)``, ours is the
    gap between stream chunks, so their p99s are not the same statistic (docs/benchmarks.md).
    """
    rows = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]
        tokens = m["output_token_count"]["successful"]["total_sum"]
        duration = bench["duration"]
        rows.append({
            "backend": f"guidellm-{bench['config']['strategy']['type_']}", "concurrency": concurrency,
            "requests": m["request_totals"]["successful"], "errored": m["request_totals"]["errored"],
            "output_tokens": int(tokens), "wall_s": round(duration, 3),
            "output_tok_per_s": round(tokens / duration, 1) if duration else None,
            "ttft_p50_ms": _stat(m, "time_to_first_token_ms", "p50"), "ttft_p99_ms": _stat(m, "time_to_first_token_ms", "p99"),
            "itl_p50_ms": _stat(m, "inter_token_latency_ms", "p50"), "itl_p99_ms": _stat(m, "inter_token_latency_ms", "p99"),
            "e2e_p50_ms": _stat(m, "request_latency", "p50", 1000), "e2e_p99_ms": _stat(m, "request_latency", "p99", 1000),
            "mean_e2e_ms": _stat(m, "request_latency", "mean", 1000),
            "mean_prompt_tokens": _stat(m, "prompt_token_count", "mean"),
            "client_cpu_s": round(report.get("client_cpu_s", 0.0), 2),
        })
    return rows

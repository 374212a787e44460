"""Failed requests during in-place weight updates: refusing (the old behaviour) vs holding.

One server per mode, same checkpoints, same load, in one run:

- ``refuse``: ``--weight-update-hold-timeout 0``: a request that arrives during an update gets
  503 at once (what the runtime did before issue 9);
- ``hold``: the default: it waits for the update and runs on the new weights.

Load: open loop at a fixed rate (a fresh connection per request, as the issue's measurement),
``/v1/completions`` with ``max_tokens`` 8, while ``--updates`` updates alternate rev-b / rev-a
back to back. Reported per mode and rate: requests sent, failed (any non-200 or transport error),
the update durations, and p50/p99 latency of the requests sent during updates.

    python bench/weight_update_hold.py --rates 3 10 --updates 4
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "tests" / "serving"))

from serving_server import start_server  # noqa: E402


def make_checkpoints(root: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    overrides = dict(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    paths = []
    for name, seed in (("rev-a", 0), ("rev-b", 1)):
        path = root / name
        if not (path / "config.json").exists():
            make_tiny_checkpoint(path, arch="llama", seed=seed, **overrides)
        paths.append(path)
    return paths[0], paths[1]


def one_request(url: str) -> tuple[bool, float]:
    started = time.monotonic()
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 8,
                                                     "ignore_eos": True}, timeout=120)
        ok = r.status_code == 200
    except httpx.HTTPError:
        ok = False
    return ok, time.monotonic() - started


def run_load(url: str, rate: float, rev_a: Path, rev_b: Path, updates: int) -> dict:
    """Open-loop load at ``rate`` req/s from 1 s before the first update to 1 s after the last."""
    results, durations = [], []
    with cf.ThreadPoolExecutor(64) as pool:
        stop = [False]

        def updater():
            time.sleep(1.0)
            for i in range(updates):
                path, revision = (rev_b, "rev-b") if i % 2 == 0 else (rev_a, "rev-a")
                started = time.monotonic()
                r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(path),
                                                                        "revision": revision}, timeout=600)
                assert r.json()["success"], r.text
                durations.append(time.monotonic() - started)
            time.sleep(1.0)
            stop[0] = True

        update_future = pool.submit(updater)
        next_at = time.monotonic()
        while not stop[0]:
            results.append(pool.submit(one_request, url))
            next_at += 1.0 / rate
            time.sleep(max(0.0, next_at - time.monotonic()))
        update_future.result()
        done = [f.result() for f in results]
    latencies = sorted(t for _, t in done)
    return {"sent": len(done), "failed": sum(1 for ok, _ in done if not ok),
            "update_s": statistics.mean(durations), "p50_s": latencies[len(latencies) // 2],
            "p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[3.0, 10.0], help="requests per second")
    parser.add_argument("--updates", type=int, default=4, help="updates per rate (alternating rev-b / rev-a)")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shardline-hold-bench-"))
    rev_a, rev_b = make_checkpoints(root, args.hidden_size, args.layers)
    size_mb = sum(p.stat().st_size for p in rev_a.glob("*.safetensors")) / 2**20
    print(f"checkpoint: {size_mb:.0f} MiB of safetensors; {args.updates} updates per rate")
    print(f"{'mode':<8}{'rate/s':>8}{'sent':>6}{'failed':>8}{'update s':>10}{'p50 s':>8}{'p99 s':>8}")
    for mode, timeout in (("refuse", "0"), ("hold", "60")):
        server = start_server(rev_a, root, "--revision", "rev-a", "--max-total-tokens", "4096",
                              "--weight-update-hold-timeout", timeout)
        try:
            for rate in args.rates:
                row = run_load(server.url, rate, rev_a, rev_b, args.updates)
                print(f"{mode:<8}{rate:>8g}{row['sent']:>6}{row['failed']:>8}{row['update_s']:>10.2f}"
                      f"{row['p50_s']:>8.2f}{row['p99_s']:>8.2f}", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()

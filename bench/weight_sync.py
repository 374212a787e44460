"""Full-model weight sync into a running server: trainer broadcast vs tensors vs disk, side by side.

One real server (``shardline-runtime serve``) on the CPU bench model of ``bench/engine.py``
(Llama, 12 layers, hidden 768, 12 heads, vocab 32000: ~134 M parameters, 537 MB in float32).
Each round replaces every weight, alternating between two checkpoints (seeds 0 and 1), by:

- ``distributed``: ``POST /update_weights_from_distributed``; this process is the trainer
  (rank 0 of a gloo weight-sync group) and broadcasts every tensor from memory meanwhile;
- ``tensor``: ``POST /update_weights_from_tensor`` with the checkpoint's safetensors bytes as the
  body (``application/octet-stream``; with ``--tensor-json``, base64 in SGLang's JSON body, encoded
  before the clock starts);
- ``disk``: ``POST /update_weights_from_disk`` of the same checkpoint (page cache warm).

The time is from sending the request to the reply (weights live on every rank). After each
update, ``/get_weights_by_name`` is checked against the checkpoint, so every method did the work.
Rounds are interleaved (distributed, tensor, disk, ...); the table gives min and median.

Usage::

    python bench/weight_sync.py                    # TP=1, 3 rounds, a few minutes on 2 cores
    python bench/weight_sync.py --tp-size 2 --repeats 2
"""

from __future__ import annotations

import argparse
import base64
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "runtime"))

from safetensors.torch import load_file  # noqa: E402

from shardline_runtime.distributed.weight_sync_group import broadcast, init_weights_update_group  # noqa: E402
from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(out: Path, seed: int, args) -> Path:
    return make_tiny_checkpoint(
        out, arch="llama", seed=seed, vocab_size=args.vocab, hidden_size=args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        intermediate_size=args.intermediate, max_position_embeddings=2048, initializer_range=0.02,
    )


def start_server(path: Path, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO / "runtime"), GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "shardline_runtime", "serve", "--model-path", str(path), "--port", str(port),
           "--tp-size", str(args.tp_size), "--max-total-tokens", "4096", "--log-level", "warning"]
    if args.tp_size > 1:
        cmd += ["--dist-init-addr", f"127.0.0.1:{free_port()}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not ready after 600 s")


def post(url: str, path: str, body: dict) -> dict | list:
    reply = httpx.post(url + path, json=body, timeout=1800)
    if reply.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {reply.status_code}: {reply.text[:300]}")
    return reply.json()


def post_bytes(url: str, path: str, data: bytes) -> dict:
    reply = httpx.post(url + path, content=data, headers={"content-type": "application/octet-stream"}, timeout=1800)
    if reply.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {reply.status_code}: {reply.text[:300]}")
    return reply.json()


def sync_distributed(url: str, group, weights: dict[str, torch.Tensor]) -> float:
    names = list(weights)
    body = {"names": names, "dtypes": ["float32"] * len(names), "shapes": [list(weights[n].shape) for n in names],
            "group_name": "bench"}
    result: dict = {}
    started = time.perf_counter()
    caller = threading.Thread(target=lambda: result.update(reply=post(url, "/update_weights_from_distributed", body)))
    caller.start()
    for name in names:
        broadcast(group, weights[name])
    caller.join()
    return time.perf_counter() - started


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def check(url: str, weights: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    got = post(url, "/get_weights_by_name", {"name": name, "truncate_size": 2})
    if got != weights[name][:2].tolist():
        raise AssertionError(f"{name} does not match the checkpoint after the update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tensor-json", action="store_true", help="send tensors as base64 in JSON (SGLang's form)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    paths = [make_checkpoint(root / f"seed{s}", s, args) for s in (0, 1)]
    weights = [load_file(str(p / "model.safetensors")) for p in paths]
    payloads = [(p / "model.safetensors").read_bytes() for p in paths]
    if args.tensor_json:
        payloads = [base64.b64encode(data).decode() for data in payloads]
    total = sum(t.numel() * t.element_size() for t in weights[0].values())
    proc, url = start_server(paths[0], args)
    started = time.perf_counter()
    post(url, "/update_weights_from_disk", {"model_path": str(paths[0])})  # warm-up (page cache, allocator)
    print(f"warm-up disk update {time.perf_counter() - started:.2f} s", flush=True)
    times: dict[str, list[float]] = {"distributed": [], "tensor": [], "disk": []}
    try:
        port = free_port()
        caller = threading.Thread(target=post, args=(url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 1 + args.tp_size, "group_name": "bench", "backend": "gloo", "timeout_s": 600}))
        caller.start()
        group = init_weights_update_group("127.0.0.1", port, 0, 1 + args.tp_size, "bench", "gloo", 600)
        caller.join()
        for r in range(args.repeats):
            for method in times:
                target = (r + list(times).index(method) + 1) % 2  # every call changes the weights
                if method == "distributed":
                    seconds = sync_distributed(url, group, weights[target])
                elif method == "tensor" and args.tensor_json:
                    seconds = timed(lambda: post(url, "/update_weights_from_tensor",
                                                 {"serialized_named_tensors": payloads[target]}))
                elif method == "tensor":
                    seconds = timed(lambda: post_bytes(url, "/update_weights_from_tensor", payloads[target]))
                else:
                    seconds = timed(lambda: post(url, "/update_weights_from_disk", {"model_path": str(paths[target])}))
                check(url, weights[target])
                times[method].append(seconds)
                print(f"round {r} {method:12s} {seconds:7.2f} s", flush=True)
        post(url, "/destroy_weights_update_group", {"group_name": "bench"})
    finally:
        proc.terminate()
        proc.wait(60)
    disk = statistics.median(times["disk"])
    print(f"\nfull-model sync, {total / 1e6:.0f} MB float32, TP={args.tp_size}, {args.repeats} rounds (CPU)")
    print(f"{'method':12s} {'min s':>8s} {'median s':>9s} {'MB/s':>8s} {'vs disk':>8s}")
    for method, values in times.items():
        med = statistics.median(values)
        print(f"{method:12s} {min(values):8.2f} {med:9.2f} {total / 1e6 / med:8.0f} {med / disk:7.2f}x")


if __name__ == "__main__":
    main()

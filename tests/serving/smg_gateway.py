"""The Shepherd Model Gateway (``smg`` on PyPI) in front of real runtime servers, and a
prefix-sharing chat trace to replay through it (shared by ``bench/routing.py`` and
``tests/serving/test_smg_gateway.py``).

``smg launch --worker-urls URL... --policy POLICY`` registers each worker after its ``/health``
answers 200 (it retries while a server loads), detects the engine from ``/v1/models`` and
``/server_info``, and proxies the OpenAI routes (``/v1/chat/completions``, ``/v1/completions``)
and SGLang's ``/generate`` to the worker its policy picks.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from serving_server import ServerProcess, free_port

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def smg_binary() -> str | None:
    """Path of the ``smg`` console script, or None when the ``gateway`` extra is not installed."""
    return shutil.which("smg")


def start_smg(worker_urls: list[str], policy: str, log_dir: Path, timeout: float = 120) -> ServerProcess:
    """Start ``smg launch`` over ``worker_urls`` with ``--policy policy``; return once every worker is
    registered healthy (``GET /workers``). Raises RuntimeError (with the log tail) otherwise."""
    port = free_port()
    args = ["launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--log-level", "warn", "--prometheus-port", str(free_port())]
    log = log_dir / f"smg-{policy}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([smg_binary() or "smg", *args], stdout=out, stderr=subprocess.STDOUT)
    gateway = ServerProcess(f"http://127.0.0.1:{port}", proc, log, args)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited {proc.returncode}:\n{gateway.log_tail()}")
        try:
            workers = httpx.get(gateway.url + "/workers", timeout=5).json()["workers"]
            if sum(w["is_healthy"] for w in workers) == len(worker_urls):
                return gateway
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    gateway.stop()
    raise RuntimeError(f"smg did not register {worker_urls} in {timeout}s:\n{gateway.log_tail()}")


def start_smg_discovery(selector: list[str], namespace: str, port: int, kubeconfig: Path, log_dir: Path,
                        policy: str = "cache_aware") -> ServerProcess:
    """Start ``smg launch --service-discovery`` watching pods that match ``selector``
    (``key=value`` strings) in ``namespace`` through ``kubeconfig``; workers are
    ``http://<podIP>:<port>``. Returns once it answers ``GET /workers``."""
    gw_port = free_port()
    args = ["launch", "--host", "127.0.0.1", "--port", str(gw_port), "--service-discovery",
            "--selector", *selector, "--service-discovery-port", str(port),
            "--service-discovery-namespace", namespace, "--policy", policy, "--log-level", "info",
            "--prometheus-port", str(free_port())]
    log = log_dir / f"smg-discovery-{gw_port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([smg_binary() or "smg", *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "KUBECONFIG": str(kubeconfig)})
    gateway = ServerProcess(f"http://127.0.0.1:{gw_port}", proc, log, args)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited {proc.returncode}:\n{gateway.log_tail()}")
        try:
            httpx.get(gateway.url + "/workers", timeout=5).raise_for_status()
            return gateway
        except httpx.HTTPError:
            time.sleep(0.5)
    gateway.stop()
    raise RuntimeError(f"smg did not answer /workers in 60s:\n{gateway.log_tail()}")


@dataclass
class TraceRequest:
    prefix: int  # which shared prefix (system prompt) the request carries
    messages: list[dict]


def prefix_trace(n_prefixes: int, per_prefix: int, seed: int, prefix_words: int = 160,
                 suffix_words: int = 12) -> list[TraceRequest]:
    """``n_prefixes * per_prefix`` chat requests, shuffled with ``seed``: each prefix is a system
    prompt of ``prefix_words`` random words shared by ``per_prefix`` requests whose user turns
    (``suffix_words`` words) differ."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(prefix_words)) for _ in range(n_prefixes)]
    trace = [TraceRequest(p, [{"role": "system", "content": systems[p]},
                              {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(suffix_words))}])
             for p in range(n_prefixes) for _ in range(per_prefix)]
    rng.shuffle(trace)
    return trace


@dataclass
class Outcome:
    prefix: int
    ttft: float  # seconds from sending to the first content chunk
    prompt_tokens: int
    cached_tokens: int
    url: str = ""  # where it was sent


# A router maps (request index, request body) to the base URL to send it to, and an optional
# ``finish(status, response bytes)`` coroutine to call once the response has been read (an
# endpoint picker's bookkeeping; see hack/gie/ext_proc.py).
Finish = Callable[[int, bytes], Awaitable[None]]
Router = Callable[[int, dict], Awaitable[tuple[str, "Finish | None"]]]


def round_robin(urls: list[str]) -> Router:
    """Request i goes to ``urls[i % len(urls)]`` (one URL: a gateway; several: the client's own
    round robin)."""

    async def route(i: int, body: dict) -> tuple[str, Finish | None]:
        return urls[i % len(urls)], None

    return route


async def _one(client: httpx.AsyncClient, route: Router, i: int, model: str, req: TraceRequest,
               max_tokens: int) -> Outcome:
    body = {"model": model, "messages": req.messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    url, finish = await route(i, body)
    ttft, usage = None, None
    raw: list[str] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            raw.append(line)
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None and '"content"' in line:
                ttft = time.perf_counter() - start
            if '"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or usage
    if finish is not None:
        await finish(resp.status_code, "\n".join(raw).encode())
    assert usage is not None, "the stream ended without a usage chunk"
    return Outcome(req.prefix, ttft if ttft is not None else time.perf_counter() - start, usage["prompt_tokens"],
                   (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), url)


async def replay(urls: list[str] | Router, model: str, trace: list[TraceRequest], concurrency: int,
                 max_tokens: int = 8) -> list[Outcome]:
    """Send ``trace`` with ``concurrency`` requests in flight, routed by ``urls``: a list is
    :func:`round_robin` over it, a :data:`Router` picks per request (TTFT includes its pick)."""
    route = round_robin(urls) if isinstance(urls, list) else urls
    queue = list(enumerate(trace))
    outcomes: list[Outcome] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i, req = queue.pop(0)
            outcomes.append(await _one(client, route, i, model, req, max_tokens))

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return outcomes


def counter(server: ServerProcess, name: str) -> float:
    """The value of the server's Prometheus counter ``shardline:<name>_total`` (0 when absent):
    ``prompt_tokens`` (prompt tokens admitted) or ``cached_tokens`` (served from the prefix cache)."""
    text = server.get("/metrics").text
    match = re.search(rf"^shardline:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0

"""The Shepherd Model Gateway (``smg`` from PyPI) in front of two real runtime servers: the OpenAI
API passes through it unchanged (``openai`` client, plain and streamed), and its cache-aware
policy keeps each shared prefix on one worker where round robin spreads it. Which worker served a
request is read from the servers' own ``shardline:prompt_tokens_total`` counters."""

from __future__ import annotations

import time

import httpx
import pytest
from serving_server import ServerProcess, start_server
from smg_gateway import counter, prefix_trace, smg_binary, start_smg

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smg_binary() is None, reason="smg is not installed (the gateway extra)")]

MODEL = "tiny-llama"
PREFIXES = 4
PER_PREFIX = 3


@pytest.fixture(scope="module")
def workers(serving_checkpoint, checkpoint_dir):
    servers = [start_server(serving_checkpoint, checkpoint_dir, "--served-model-name", MODEL,
                            "--max-total-tokens", "8192") for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def cache_aware(workers, checkpoint_dir):
    gateway = start_smg([s.url for s in workers], "cache_aware", checkpoint_dir)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def round_robin(workers, checkpoint_dir):
    gateway = start_smg([s.url for s in workers], "round_robin", checkpoint_dir)
    yield gateway
    gateway.stop()


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Say something about gateways."}]


def test_smg_recognises_the_runtime_as_an_sglang_worker(cache_aware):
    # smg probes /v1/models' owned_by, then /server_info (SGLang) and /version (vLLM).
    workers = httpx.get(cache_aware.url + "/workers", timeout=10).json()["workers"]
    assert [w["runtime_type"] for w in workers] == ["sglang", "sglang"]


def test_chat_completion_through_smg_is_the_workers_answer(cache_aware, workers):
    via_gateway = _client(cache_aware.url).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                                   max_tokens=8, temperature=0)
    direct = _client(workers[0].url).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                             max_tokens=8, temperature=0)
    assert via_gateway.choices[0].message.content == direct.choices[0].message.content


def test_chat_completion_through_smg_keeps_its_usage(cache_aware):
    reply = _client(cache_aware.url).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                             max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens == 8


def test_streamed_chat_through_smg_is_the_plain_answer(cache_aware):
    client = _client(cache_aware.url)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content


def test_streamed_chat_through_smg_ends_with_usage(cache_aware):
    chunks = list(_client(cache_aware.url).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 8


def _worker_of_each_prefix(gateway: ServerProcess, workers: list[ServerProcess]) -> dict[int, set[int]]:
    """Send a prefix-sharing trace one request at a time; map prefix -> indices of the workers
    whose ``prompt_tokens`` counter grew for its requests."""
    client = _client(gateway.url)
    placed: dict[int, set[int]] = {}
    for req in sorted(prefix_trace(PREFIXES, PER_PREFIX, seed=7), key=lambda r: r.prefix):
        before = [counter(s, "prompt_tokens") for s in workers]
        client.chat.completions.create(model=MODEL, messages=req.messages, max_tokens=2, temperature=0)
        deadline = time.monotonic() + 10
        grew: list[int] = []
        while not grew and time.monotonic() < deadline:
            grew = [i for i, s in enumerate(workers) if counter(s, "prompt_tokens") > before[i]]
        placed.setdefault(req.prefix, set()).update(grew)
    return placed


def test_cache_aware_keeps_each_prefix_on_one_worker(cache_aware, workers):
    placed = _worker_of_each_prefix(cache_aware, workers)
    assert all(len(w) == 1 for w in placed.values()), placed


def test_cache_aware_reuses_the_prefix_cache(cache_aware, workers):
    for s in workers:
        s.post("/flush_cache").raise_for_status()
    before = sum(counter(s, "cached_tokens") for s in workers)
    _worker_of_each_prefix(cache_aware, workers)
    # Every request after a prefix's first finds its system prompt cached on its worker.
    assert sum(counter(s, "cached_tokens") for s in workers) - before >= PREFIXES * (PER_PREFIX - 1) * 100


def test_round_robin_spreads_each_prefix_over_both_workers(round_robin, workers):
    placed = _worker_of_each_prefix(round_robin, workers)
    assert all(w == {0, 1} for w in placed.values()), placed

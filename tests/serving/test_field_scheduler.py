"""Load and memory against a real server: 64 concurrent mixed requests, S1-S3 (S4 is in
test_scheduler.py), with metrics and KV usage back to baseline."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import threading
import time

import httpx
import pytest
from serving_server import wait_for_baseline


def _metric(server, name: str) -> float:
    text = server.get("/metrics").text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _abort_count(server) -> float:
    match = re.search(r'^shardline:request_success_total\{finished_reason="abort"[^}]*\} ([0-9.e+-]+)$',
                      server.get("/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


def _mixed_requests(tokenizer, count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = "the model serves tokens over a tensor parallel group of pods each rank holds a shard".split()
    out = []
    for i in range(count):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 120)))
        out.append({"prompt": prompt, "max_tokens": rng.randint(1, 48), "temperature": 0, "ignore_eos": True,
                    "stream": i % 3 == 0})
    return out


async def _complete_async(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, dict]:
    if not body.get("stream"):
        r = await client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        out = r.json()
        return out["choices"][0]["text"], out["usage"]
    text, usage = "", None
    async with client.stream("POST", url + "/v1/completions", json=dict(body, stream_options={"include_usage": True})) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                text += "".join(c["text"] for c in event["choices"])
                usage = event.get("usage") or usage
    return text, usage


@pytest.mark.slow
def test_64_concurrent_mixed_requests_equal_alone(server, tokenizer):
    requests = _mixed_requests(tokenizer, 64)
    base_gen = _metric(server, "shardline:generation_tokens_total")

    async def run_all():
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*[_complete_async(client, server.url, b) for b in requests])

    together = asyncio.run(run_all())
    for body, (text, usage) in zip(requests, together):
        alone = server.post("/v1/completions", dict(body, stream=False)).json()
        assert text == alone["choices"][0]["text"]
        assert usage["completion_tokens"] == body["max_tokens"]
    info = wait_for_baseline(server)
    assert info["kv_used_tokens"] == 0
    assert _metric(server, "shardline:num_requests_running") == 0
    assert _metric(server, "shardline:num_requests_waiting") == 0
    assert _metric(server, "shardline:kv_cache_used_tokens") == 0
    assert _metric(server, "shardline:generation_tokens_total") - base_gen == 2 * sum(b["max_tokens"] for b in requests)


@pytest.mark.slow
def test_s1_request_larger_than_pool_is_clipped_others_complete(server, tokenizer):
    """A request that fits the context but not the KV pool is clipped to the pool (finish
    "length"), and small requests sent while it decodes complete before it does: they ran
    beside it. Sent at its first token, their 8 steps against its ~500 remaining make the
    overlap certain on any machine; a server that ran them one at a time fails here."""
    wait_for_baseline(server)
    info = server.get("/get_server_info").json()
    prompt = (list(range(10, 510)) * 3)[:1500]
    assert len(prompt) + 2500 <= info["context_length"]  # fits the context, not the KV pool
    big_body = {"prompt": prompt, "max_tokens": 2500, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

    async def big(client, decoding: asyncio.Event):
        reason, usage = None, None
        async with client.stream("POST", server.url + "/v1/completions", json=big_body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    decoding.set()
                    reason = next((c["finish_reason"] for c in event["choices"] if c["finish_reason"]), reason)
                    usage = event.get("usage") or usage
        return reason, usage, time.monotonic()

    async def small(client, i):
        r = await client.post(server.url + "/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 8,
                                                                    "ignore_eos": True})
        r.raise_for_status()
        return r.json(), time.monotonic()

    async def run():
        async with httpx.AsyncClient(timeout=900) as client:
            decoding = asyncio.Event()
            big_task = asyncio.create_task(big(client, decoding))
            await asyncio.wait_for(decoding.wait(), 600)
            smalls = await asyncio.gather(*[small(client, i) for i in range(4)])
            return await big_task, smalls

    (reason, usage, big_end), smalls = asyncio.run(run())
    assert [s["usage"]["completion_tokens"] for s, _ in smalls] == [8] * 4
    assert all(end < big_end for _, end in smalls), "the small requests did not complete while the big one ran"
    assert reason == "length"
    assert usage["completion_tokens"] == info["max_req_len"] - len(prompt)
    wait_for_baseline(server)


def test_s2_prompt_larger_than_pool_rejected_at_once(server):
    info = server.get("/get_server_info").json()
    prompt = [11] * (info["max_total_num_tokens"] + 50)
    started = time.monotonic()
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and time.monotonic() - started < 5
    assert f"{len(prompt)} tokens" in r.json()["error"]["message"]
    assert str(info["max_req_input_len"]) in r.json()["error"]["message"]
    assert server.get("/get_server_info").json()["num_queued_reqs"] == 0


def _wait_running(server, at_least: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while server.get("/get_server_info").json()["num_running_reqs"] < at_least:
        assert time.monotonic() < deadline, "requests did not start"
        time.sleep(0.05)


def test_s3_client_disconnect_aborts_and_frees_kv(server):
    """A client that goes away mid-request (streamed or not) aborts it: the request is counted
    as aborted and its KV is freed. Each client leaves once the server reports its request
    running, and each request asks for all the pool holds, so none can finish first."""
    wait_for_baseline(server)
    aborted = _abort_count(server)
    body = {"prompt": "one two three", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True)) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 5:
                    break
    wait_for_baseline(server, timeout=30)
    # a non-streamed request whose client gives up: a raw connection closed once it runs
    payload = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
                          "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        _wait_running(server, 1)
    info = wait_for_baseline(server, timeout=30)
    assert info["num_running_reqs"] == 0 and _metric(server, "shardline:num_requests_running") == 0
    assert _abort_count(server) == aborted + 2


def test_abort_request_endpoint(server):
    rid = "abort-me-1"
    result = {}

    def run():
        result["r"] = server.post("/generate", {"text": "hello", "rid": rid,
                                                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}).json()

    thread = threading.Thread(target=run)
    thread.start()
    _wait_running(server, 1)
    assert server.post("/abort_request", {"rid": rid}).json()["success"] is True
    thread.join(30)
    assert result["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.post("/abort_request", {}).status_code == 400
    wait_for_baseline(server)

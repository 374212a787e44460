"""Field cases W4 (update while requests run) and W5 (no stale prefix cache) on a real server."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from scheduler_harness import greedy, make_scheduler, run_to_completion
from serving_server import start_server, wait_for_baseline


@pytest.fixture(scope="module")
def weights_server(serving_checkpoint, checkpoint_dir):
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "2048", "--revision", "rev-a")
    yield srv
    srv.stop()


def _stream_generation(server, results: dict, key: str, max_tokens: int) -> None:
    body = {"prompt": f"one two three {key}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    text, reason = "", None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
                    reason = c["finish_reason"] or reason
    results[key] = (text, reason)


def _start_streams(server, count: int, max_tokens: int) -> tuple[list[threading.Thread], dict]:
    results: dict = {}
    threads = [threading.Thread(target=_stream_generation, args=(server, results, str(i), max_tokens)) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while server.get("/get_server_info").json()["num_running_reqs"] < count:
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.05)
    return threads, results


def _update(server, path, revision, **extra) -> dict:
    r = server.post("/update_weights_from_disk", {"model_path": str(path), "revision": revision, **extra}, timeout=600)
    return r.json()


@pytest.mark.slow
def test_w4_update_waits_for_running_requests(weights_server, serving_checkpoint, serving_checkpoint_b):
    server = weights_server
    threads, results = _start_streams(server, 8, 200)
    out = _update(server, serving_checkpoint_b, "rev-b")
    assert out["success"] is True, out
    for t in threads:
        t.join(600)
    assert len(results) == 8 and all(reason == "length" for _, reason in results.values())
    info = server.get("/get_server_info").json()
    assert info["weights_revision"] == "rev-b" and info["weights_phase"] == "serving"
    assert info["model_path"] == str(serving_checkpoint_b)
    assert server.post("/v1/completions", {"prompt": "hello", "max_tokens": 3}).status_code == 200
    assert _update(server, serving_checkpoint, "rev-a")["success"] is True
    wait_for_baseline(server)


@pytest.mark.slow
def test_w4_update_aborts_running_requests_when_asked(weights_server, serving_checkpoint, serving_checkpoint_b):
    server = weights_server
    threads, results = _start_streams(server, 8, 3000)
    out = _update(server, serving_checkpoint_b, "rev-b", abort_all_requests=True)
    assert out["success"] is True, out
    for t in threads:
        t.join(120)
    assert len(results) == 8 and all(reason == "abort" for _, reason in results.values())
    assert server.get("/health").status_code == 200
    assert server.post("/v1/completions", {"prompt": "hello", "max_tokens": 3}).status_code == 200
    assert 'revision="rev-b"' in server.get("/metrics").text
    assert _update(server, serving_checkpoint, "rev-a")["success"] is True
    wait_for_baseline(server)


def test_failed_update_keeps_serving(weights_server, tmp_path):
    server = weights_server
    before = server.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    out = _update(server, tmp_path / "missing", "rev-x")
    assert out["success"] is False and out["message"]
    info = server.get("/get_server_info").json()
    assert info["weights_revision"] == "rev-a" and server.get("/ready").status_code == 200
    after = server.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert after["output_ids"] == before["output_ids"]


def test_w5_no_stale_prefix_cache(weights_server, serving_checkpoint, serving_checkpoint_b):
    server = weights_server
    prompt = (list(range(10, 410)) * 2)[:600]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    server.post("/generate", body)
    again = server.post("/generate", body).json()
    assert again["meta_info"]["cached_tokens"] >= 590  # the prefix cache holds the prompt
    assert _update(server, serving_checkpoint_b, "rev-b")["success"] is True
    after = server.post("/generate", body).json()
    assert after["meta_info"]["cached_tokens"] == 0
    cold_b = make_scheduler(serving_checkpoint_b, max_total_tokens=2048)
    cold_b.process_input_requests([greedy("b", prompt, 12)])
    assert after["output_ids"] == run_to_completion(cold_b)["b"]["ids"]
    usage = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # now cached again, with B's KV
    assert _update(server, serving_checkpoint, "rev-a")["success"] is True
    wait_for_baseline(server)

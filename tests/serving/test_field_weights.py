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
    # A small pool: W4's running streams fill it with ~110 tokens each, which keeps the test
    # within its timeout on a starved machine (hack/stress_tests.sh) and still retracts.
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "1024", "--revision", "rev-a")
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


def _stream_ids(server, prompt: list[int], max_new_tokens: int, progress: dict, key) -> None:
    """Greedy ``/generate`` stream; ``progress[key]`` holds the output ids so far, then
    ``(status, ids, finish_reason type)`` when it ends (a refusal has no ids). A stream that
    ends in an error event records ``("error event", ids, error)``; a cut connection
    ``("cut", ids, exception)``: both are outcomes the test then rejects by name."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    ids, reason = [], None
    try:
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=600) as r:
            if r.status_code != 200:
                r.read()
                progress[key] = (r.status_code, [], None)
                return
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        progress[key] = ("error event", ids, event["error"])
                        return
                    ids = event["output_ids"]
                    progress[key] = list(ids)
                    reason = (event["meta_info"]["finish_reason"] or {}).get("type") or reason
    except httpx.TransportError as exc:
        progress[key] = ("cut", ids, repr(exc))
        return
    progress[key] = (200, ids, reason)


def _cold_runs(path, prompts: dict, max_new_tokens: int) -> dict:
    """Greedy output ids of each prompt on a fresh in-process scheduler loaded from ``path``."""
    cold = make_scheduler(path, max_total_tokens=4096)
    cold.process_input_requests([greedy(key, p, max_new_tokens) for key, p in prompts.items()])
    return {key: r["ids"] for key, r in run_to_completion(cold).items()}


@pytest.mark.slow
def test_w4_streams_running_during_an_update_keep_one_revision(weights_server, serving_checkpoint,
                                                              serving_checkpoint_b):
    """Streams running when an update arrives finish on the old weights (docs/api.md, W4): each
    one's tokens equal a cold run on revision A. Streams sent after the update was posted run
    whole on one revision (A if they overtook it, else B) or are refused before any token (a 503,
    or, when the hold bound ran out after the headers, a 503 error event); no stream ever mixes
    revisions or is cut."""
    server = weights_server
    wait_for_baseline(server)
    n_running, n_late = 8, 4
    info = server.get("/get_server_info").json()
    max_new = info["max_total_num_tokens"] // n_running - 16  # the running streams fill the KV pool
    prompts = {f"run{i}": [10 + i, 20, 30, 40 + i] for i in range(n_running)}
    prompts.update({f"late{i}": [50 + i, 60, 70, 80 + i] for i in range(n_late)})
    progress: dict = {}

    def start(keys) -> list[threading.Thread]:
        threads = [threading.Thread(target=_stream_ids, args=(server, prompts[k], max_new, progress, k)) for k in keys]
        for t in threads:
            t.start()
        return threads

    threads = start([k for k in prompts if k.startswith("run")])
    deadline = time.monotonic() + 60
    while not all(isinstance(progress.get(f"run{i}"), list) and progress[f"run{i}"] for i in range(n_running)):
        assert time.monotonic() < deadline, f"streams did not start: {progress}"
        time.sleep(0.02)
    update: dict = {}
    updater = threading.Thread(target=lambda: update.update(_update(server, serving_checkpoint_b, "rev-b")))
    in_flight_at_update = {k: len(v) for k, v in progress.items() if isinstance(v, list)}
    updater.start()
    threads += start([k for k in prompts if k.startswith("late")])
    updater.join(600)
    for t in threads:
        t.join(600)
    assert update.get("success") is True, update
    assert len(in_flight_at_update) == n_running and max(in_flight_at_update.values()) < max_new, (
        f"a stream finished before the update was sent, so the update did not overlap it: {in_flight_at_update}")
    cold_a = _cold_runs(serving_checkpoint, prompts, max_new)
    cold_b = _cold_runs(serving_checkpoint_b, prompts, max_new)
    for key in prompts:
        status, ids, reason = progress[key]
        if key.startswith("run"):
            assert (status, reason) == (200, "length"), (key, progress[key])
            assert ids == cold_a[key], f"{key} (running when the update came) left revision A's tokens"
        elif status == 200:
            assert ids in (cold_a[key], cold_b[key]), f"{key} is neither revision A's nor B's tokens: mixed"
        elif status == "error event":  # admitted, then its hold bound ran out in the scheduler's queue
            assert ids == [] and reason["code"] == 503 and "--weight-update-hold-timeout" in reason["message"], (
                key, progress[key])
        else:
            assert status == 503 and ids == [], (key, progress[key])
    info = server.get("/get_server_info").json()
    assert info["weights_revision"] == "rev-b" and info["weights_phase"] == "serving"
    assert info["model_path"] == str(serving_checkpoint_b)
    after = server.post("/generate", {"input_ids": prompts["run0"], "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}).json()
    assert after["output_ids"] == cold_b["run0"]
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

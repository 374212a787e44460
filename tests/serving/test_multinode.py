"""TP=2 across two "pods": two launcher processes with --nnodes 2 on distinct loopback IPs.

Also the pod lifecycle: node rank 1 serves /health and /ready; a dead peer takes node 0 down
with an error (never a hang) and the first error line in its termination log; SIGTERM drains
(readiness first, the listener open while requests are in flight) and exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from scheduler_harness import greedy, make_scheduler, run_to_completion
from serving_server import free_port, start_server, wait_until_ready

PROMPTS = [[5, 6, 7], list(range(20, 80)), [300, 200, 100, 50, 25, 12]]


@pytest.fixture(scope="module")
def tp2_pods(serving_checkpoint, checkpoint_dir):
    dist = f"127.0.0.1:{free_port()}"
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", dist, "--max-total-tokens", "2048",
              "--dist-timeout", "60", "--watchdog-timeout", "60"]
    logs = {n: checkpoint_dir / f"termination-node{n}.log" for n in (0, 1)}
    node1 = start_server(serving_checkpoint, checkpoint_dir, *common, "--node-rank", "1", host="127.0.0.2",
                         wait_ready=False, env={"SHARDLINE_TERMINATION_LOG": str(logs[1])})
    node0 = start_server(serving_checkpoint, checkpoint_dir, *common, "--node-rank", "0", host="127.0.0.1",
                         wait_ready=False, env={"SHARDLINE_TERMINATION_LOG": str(logs[0])})
    wait_until_ready(node0, 240)
    wait_until_ready(node1, 60)
    yield node0, node1, logs
    node0.stop()
    node1.stop()


@pytest.mark.slow
def test_tp2_two_pods_match_tp1(tp2_pods, serving_checkpoint):
    node0, node1, _ = tp2_pods
    assert node1.get("/health").status_code == 200 and node1.get("/ready").status_code == 200
    assert node1.get("/v1/models").status_code == 503  # rank>0 pods serve no API
    reference = make_scheduler(serving_checkpoint, max_total_tokens=2048)
    reference.process_input_requests([greedy(f"p{i}", p, 16) for i, p in enumerate(PROMPTS)])
    expected = run_to_completion(reference)
    results: dict = {}

    def run(i: int, prompt: list[int]) -> None:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
        results[i] = node0.post("/generate", body).json()["output_ids"]

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results[i] for i in range(len(PROMPTS))] == [expected[f"p{i}"]["ids"] for i in range(len(PROMPTS))]
    info = node0.get("/get_server_info").json()
    assert info["tp_size"] == 2 and info["nnodes"] == 2


@pytest.mark.slow
def test_dead_peer_fails_node0_with_termination_message(tp2_pods):
    node0, node1, logs = tp2_pods
    node1.proc.kill()  # the whole pod of rank 1 dies (its scheduler exits with its launcher)
    node1.proc.wait(30)
    started = time.monotonic()
    body = {"prompt": "hello", "max_tokens": 50, "ignore_eos": True}
    try:
        r = node0.post("/v1/completions", body, timeout=120)
        assert r.status_code in (200, 503)
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] == "abort"
    except httpx.HTTPError:
        pass  # the server went down while answering: also an error, not a hang
    assert node0.proc.wait(120) == 1
    assert time.monotonic() - started < 120
    assert "tp" in logs[0].read_text()


@pytest.mark.slow
def test_sigterm_drains_and_exits_zero(serving_checkpoint, checkpoint_dir):
    server = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "1024", "--drain-timeout", "30")
    result = {}

    def stream():
        text = ""
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    text += "".join(c["text"] for c in event["choices"])
                    result["reason"] = event["choices"][0]["finish_reason"] if event["choices"] else None
        result["done"] = True

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # Readiness drops first; the listener stays open while a request is in flight, and a client
    # that has not noticed yet is still served, not refused (issue 9).
    assert httpx.get(server.url + "/ready", timeout=5).status_code == 503
    assert httpx.get(server.url + "/get_server_info", timeout=5).json()["draining"] is True
    late = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert late.status_code == 200, late.text
    thread.join(60)
    assert result.get("done") and result.get("reason") == "length"
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.HTTPError):  # the listener closed once nothing was in flight
        httpx.get(server.url + "/health", timeout=2)


@pytest.mark.slow
def test_startup_failure_writes_termination_log(checkpoint_dir, tmp_path):
    log = tmp_path / "termination-log"
    server = start_server(tmp_path / "no-such-model", checkpoint_dir, wait_ready=False,
                          env={"SHARDLINE_TERMINATION_LOG": str(log)})
    assert server.proc.wait(120) == 1
    assert "no-such-model" in log.read_text()

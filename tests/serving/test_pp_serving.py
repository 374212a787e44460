"""pp=2 across two "pods": two launcher processes with --pp-size 2 --nnodes 2 on distinct loopback
IPs, so each pod runs one pipeline stage (node rank 1 -> world rank 1 -> pp rank 1). The API on
node 0 answers with the tokens of a pp=1 scheduler, reports pp_size, and rolls new weights in
place across both stages."""

from __future__ import annotations

import threading

import pytest
from scheduler_harness import greedy, make_scheduler, run_to_completion
from serving_server import free_port, start_server, wait_until_ready

PROMPTS = [[5, 6, 7], list(range(20, 80)), [300, 200, 100, 50, 25, 12]]


def _generate_all(server, n: int) -> list[list[int]]:
    results: dict = {}

    def run(i: int, prompt: list[int]) -> None:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        results[i] = server.post("/generate", body).json()["output_ids"]

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return [results[i] for i in range(len(PROMPTS))]


def _reference(path, n: int) -> list[list[int]]:
    reference = make_scheduler(path, max_total_tokens=2048)
    reference.process_input_requests([greedy(f"p{i}", p, n) for i, p in enumerate(PROMPTS)])
    expected = run_to_completion(reference)
    return [expected[f"p{i}"]["ids"] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def pp2_pods(serving_checkpoint, checkpoint_dir):
    dist = f"127.0.0.1:{free_port()}"
    common = ["--pp-size", "2", "--nnodes", "2", "--dist-init-addr", dist, "--max-total-tokens", "2048",
              "--dist-timeout", "180", "--chunked-prefill-size", "16"]
    node0 = start_server(serving_checkpoint, checkpoint_dir, *common, "--node-rank", "0", host="127.0.0.1", wait_ready=False)
    node1 = start_server(serving_checkpoint, checkpoint_dir, *common, "--node-rank", "1", host="127.0.0.2", wait_ready=False)
    try:
        wait_until_ready(node0, 300)
        wait_until_ready(node1, 60)
        yield node0, node1
    finally:
        node0.stop()
        node1.stop()


@pytest.mark.slow
def test_pp2_two_pods_match_pp1_and_report_pp_size(pp2_pods, serving_checkpoint):
    node0, node1 = pp2_pods
    assert _generate_all(node0, 16) == _reference(serving_checkpoint, 16)
    info = node0.get("/get_server_info").json()
    assert (info["pp_size"], info["tp_size"], info["nnodes"]) == (2, 1, 2)
    assert info["overlap_schedule"] is False  # the micro-batch loop runs instead
    assert node1.get("/ready").status_code == 200
    assert node1.get("/v1/models").status_code == 503  # the second stage's pod serves no API


@pytest.mark.slow
def test_pp2_weight_update_in_place_over_http(pp2_pods, serving_checkpoint_b):
    node0, _ = pp2_pods
    reply = node0.post("/update_weights_from_disk", {"model_path": str(serving_checkpoint_b), "revision": "b"}).json()
    assert reply["success"] is True, reply
    assert node0.get("/get_server_info").json()["weights_revision"] == "b"
    assert _generate_all(node0, 8) == _reference(serving_checkpoint_b, 8)


@pytest.mark.slow
def test_pp2_weight_sync_group_counts_every_stage_rank(pp2_pods):
    """world_size 2 with rank_offset 1 leaves no rank for stage 1 (engine ranks are tp x pp = 2):
    a 400 naming world_size at once, not a rendezvous that cannot complete."""
    node0, _ = pp2_pods
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "too-small", "backend": "gloo", "timeout_s": 5}
    reply = node0.post("/init_weights_update_group", body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "world_size" and "tp_size x pp_size (1 x 2)" in error["message"], error

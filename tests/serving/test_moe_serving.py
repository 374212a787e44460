"""A real two-rank server of a tiny Qwen3-MoE (expert parallel 2, two redundant slots): the
recorder endpoints, ``POST /rebalance_experts`` with unchanged greedy text afterwards, and the
400s for a bad mode, a rebalance with nothing recorded and a file dump without a directory."""

from __future__ import annotations

import pytest
from serving_server import start_server

PROMPTS = ["the model serves tokens", "hello world how are you", "one two three four five"]


def start_moe_server(checkpoint_dir, *args: str):
    """A CPU server of the tiny Qwen3-MoE (8 experts, top-2, two layers) with ``args``."""
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    path = checkpoint_dir / "qwen3-moe"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, arch="qwen3_moe", seed=0)
    return start_server(path, checkpoint_dir, *args, "--device", "cpu", "--max-total-tokens", "1024", timeout=300)


@pytest.fixture(scope="module")
def moe_server(checkpoint_dir):
    srv = start_moe_server(checkpoint_dir, "--tp-size", "2", "--ep-size", "2", "--ep-num-redundant-experts", "2")
    yield srv
    srv.stop()


def greedy_texts(server) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        out = server.post("/generate", {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                                            "ignore_eos": True}})
        assert out.status_code == 200, out.text
        texts.append(out.json()["text"])
    return texts


@pytest.mark.slow
def test_record_dump_and_rebalance_over_http(moe_server):
    out = moe_server.post("/rebalance_experts")
    assert out.status_code == 400
    assert "no expert load recorded" in out.json()["message"]
    assert moe_server.post("/start_expert_distribution_record", {"mode": "stat"}).status_code == 200
    before = greedy_texts(moe_server)
    assert moe_server.post("/stop_expert_distribution_record").status_code == 200
    record = moe_server.post("/dump_expert_distribution_record").json()
    assert record["mode"] == "stat"
    assert len(record["physical_to_logical_map"][0]) == 10  # 8 experts + 2 redundant slots
    assert all(sum(layer) > 0 for layer in record["logical_count"])
    out = moe_server.post("/rebalance_experts")
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["success"] is True
    assert body["imbalance_after_expected"] <= body["imbalance_before"]
    assert greedy_texts(moe_server) == before


@pytest.mark.slow
def test_recorder_requests_the_server_cannot_satisfy_are_400(moe_server):
    out = moe_server.post("/start_expert_distribution_record", {"mode": "hourly"})
    assert out.status_code == 400
    out = moe_server.post("/dump_expert_distribution_record", {"to_file": True})
    assert out.status_code == 400
    assert "--expert-distribution-recorder-dir" in out.json()["message"]


@pytest.fixture(scope="module")
def moe_pp2_server(checkpoint_dir):
    """Two pipeline stages of the tiny Qwen3-MoE (two MoE layers: one per stage)."""
    srv = start_moe_server(checkpoint_dir, "--pp-size", "2")
    yield srv
    srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stat", "per_pass"])
def test_expert_record_under_pp_covers_every_stage_layers(moe_pp2_server, mode):
    assert moe_pp2_server.post("/start_expert_distribution_record", {"mode": mode}).status_code == 200
    greedy_texts(moe_pp2_server)
    assert moe_pp2_server.post("/stop_expert_distribution_record").status_code == 200
    record = moe_pp2_server.post("/dump_expert_distribution_record").json()
    per_layer = [sum(layer) for layer in record["logical_count"]]
    assert len(per_layer) == 2
    assert per_layer[0] > 0
    assert per_layer[1] == per_layer[0], f"tokens x top_k per layer differ between stages: {per_layer}"
    assert per_layer[0] % 2 == 0  # top_k 2: every token counts twice
    assert record["physical_to_logical_map"] == [list(range(8)), list(range(8))]  # the default placement
    if mode == "per_pass":
        assert all(len(entry) == 2 for entry in record["physical_count"])
        totals = [sum(sum(entry[layer]) for entry in record["physical_count"]) for layer in (0, 1)]
        assert totals == per_layer

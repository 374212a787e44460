"""TP=2 (two gloo processes on CPU) gives the logits and greedy tokens of TP=1 for every
architecture, with a vocabulary not divisible by TP (L3), replicated KV heads and tied
embeddings (L1); TP=4 replicates 2 KV heads (L4); impossible head/TP layouts are refused
before any weight is read (L4)."""

import json
import re

import pytest
import torch

import harness
from shardline_runtime.configs.model_config import ModelConfigError

PROMPTS = [[5, 17, 200, 33, 9, 41, 77, 300], [12, 8, 101, 4, 60]]
STEPS = 4
TOL = 1e-4


def scenario_paths(tiny_checkpoint):
    return {
        "llama": tiny_checkpoint("llama"),
        "qwen2": tiny_checkpoint("qwen2"),
        "qwen3": tiny_checkpoint("qwen3"),
        "mistral": tiny_checkpoint("mistral"),
        "vocab32001": tiny_checkpoint("llama", vocab_size=32001),
        "kv_replicated": tiny_checkpoint("qwen2", num_key_value_heads=1),
        "tied": tiny_checkpoint("llama", tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def tp2_results(tiny_checkpoint, tmp_path_factory):
    paths = scenario_paths(tiny_checkpoint)
    scenarios = [{"name": n, "path": str(p), "prompts": PROMPTS, "steps": STEPS} for n, p in paths.items()]
    ranks = harness.run_tp(2, scenarios, tmp_path_factory.mktemp("tp2"))
    tp1 = {n: harness.run_scenario(harness.make_runner(p), PROMPTS, STEPS) for n, p in paths.items()}
    return ranks, tp1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "vocab32001", "kv_replicated", "tied"])
def test_tp2_matches_tp1(tp2_results, name):
    ranks, tp1 = tp2_results
    for rank in ranks:
        got = rank[name]
        assert got["tokens"] == tp1[name]["tokens"]
        for a, b in zip(got["logits"], tp1[name]["logits"]):
            assert a.shape == b.shape
            assert (a - b).abs().max() <= TOL


@pytest.mark.slow
def test_tp2_vocab_not_divisible_pads_and_hides_padding(tp2_results):
    ranks, _ = tp2_results
    assert [r["vocab32001"]["vocab_range"] for r in ranks] == [(0, 16001), (16001, 32002)]
    # rank 1 holds one padded row; it is zero and never reaches the logits (width = real vocab)
    assert ranks[1]["vocab32001"]["embed_shard"][-1].abs().sum() == 0
    assert all(l.shape[-1] == 32001 for l in ranks[0]["vocab32001"]["logits"])


@pytest.mark.slow
def test_tp2_kv_heads_replicated_and_tied_head_is_embedding_slice(tp2_results, tiny_checkpoint):
    from safetensors.torch import load_file

    ranks, _ = tp2_results
    assert [r["kv_replicated"]["kv_heads_per_rank"] for r in ranks] == [1, 1]
    embed = load_file(str(tiny_checkpoint("llama", tie_word_embeddings=True) / "model.safetensors"))["model.embed_tokens.weight"]
    for r in ranks:
        start, end = r["tied"]["vocab_range"]
        assert torch.equal(r["tied"]["lm_head_shard"], embed[start:end])


@pytest.mark.slow
def test_tp4_replicates_two_kv_heads(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama", hidden_size=64, num_attention_heads=16, num_key_value_heads=2)
    scenarios = [{"name": "l4", "path": str(path), "prompts": PROMPTS, "steps": 2}]
    ranks = harness.run_tp(4, scenarios, tmp_path)
    tp1 = harness.run_scenario(harness.make_runner(path), PROMPTS, 2)
    for rank in ranks:
        assert rank["l4"]["kv_heads_per_rank"] == 1
        assert rank["l4"]["tokens"] == tp1["tokens"]
        assert all((a - b).abs().max() <= TOL for a, b in zip(rank["l4"]["logits"], tp1["logits"]))


@pytest.mark.parametrize("heads, kv_heads, tp, valid", [
    (12, 3, 2, "[1, 3, 6, 12]"),
    (28, 4, 8, "[1, 2, 4, 28]"),
])
def test_impossible_head_tp_layout_refused_before_loading(tiny_checkpoint, tmp_path, heads, kv_heads, tp, valid):
    cfg = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=heads * 16,
               intermediate_size=heads * 16 * 2, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights: refusal must come first
    with pytest.raises(ModelConfigError, match=rf"cannot run at tp_size {tp}: .*valid tp sizes: {re.escape(valid)}"):
        harness.make_runner(tmp_path, tp_rank=0, tp_size=tp, dist_init_addr="127.0.0.1:1")

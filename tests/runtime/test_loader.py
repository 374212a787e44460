"""Checkpoint loading: field cases L1 (tied embeddings) and L2 (missing/short shards, stray
files, parameters never written), plus validate_checkpoint (used by in-place weight updates)."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import harness
from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.model_loader.checkpoint_files import INDEX_FILE, discover_checkpoint
from shardline_runtime.model_loader.errors import CheckpointError
from shardline_runtime.model_loader.validate import validate_checkpoint

PROMPT = [5, 17, 200, 33, 9, 41]


def copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def transformers_logits(path, tokens=PROMPT):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0, -1]


def runner_logits(path, tokens=PROMPT):
    runner = harness.make_runner(path)
    return harness.extend(runner, harness.new_seqs(runner, 1), [tokens]).next_token_logits[0]


@pytest.fixture
def sharded(tiny_checkpoint, tmp_path):
    path = copy(tiny_checkpoint("llama", seed=1, max_shard_size="40KB"), tmp_path)
    shards = sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))
    assert len(shards) >= 3
    return path, shards


def test_sharded_checkpoint_matches_transformers(sharded):
    path, _ = sharded
    assert (runner_logits(path) - transformers_logits(path)).abs().max() <= 1e-4


def test_missing_listed_shard_fails_fast_naming_the_file(sharded):
    path, shards = sharded
    (path / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=f"{shards[1]} is missing"):
        harness.make_runner(path)


def test_truncated_shard_fails_fast_naming_the_file(sharded):
    path, shards = sharded
    data = (path / shards[0]).read_bytes()
    (path / shards[0]).write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=f"{shards[0]} is truncated"):
        harness.make_runner(path)


def test_stray_unlisted_file_is_ignored_with_a_warning(sharded, caplog):
    path, shards = sharded
    save_file({"garbage": torch.zeros(3)}, str(path / "stray.safetensors"))
    with caplog.at_level(logging.WARNING):
        logits = runner_logits(path)
    assert any("stray.safetensors" in r.getMessage() for r in caplog.records)
    assert (logits - transformers_logits(path)).abs().max() <= 1e-4


def test_parameter_never_written_is_a_load_error(sharded):
    path, _ = sharded
    index = json.loads((path / INDEX_FILE).read_text())
    victim = "model.layers.1.mlp.up_proj.weight"
    shard = index["weight_map"].pop(victim)
    tensors = load_file(str(path / shard))
    tensors.pop(victim)
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.gate_up_proj.weight \(shards \['1'\]\) was never written"):
        harness.make_runner(path)


def test_unexpected_and_duplicate_parameters_are_named(tiny_checkpoint, tmp_path):
    path = copy(tiny_checkpoint("llama"), tmp_path)
    save_file({"model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected parameter 'model.layers.0.mlp.extra.weight'"):
        harness.make_runner(path)
    save_file({"model.norm.weight": torch.ones(64)}, str(path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is stored in both"):
        discover_checkpoint(path)


@pytest.mark.parametrize("stored_lm_head", ["absent", "same", "different"])
def test_tied_embeddings_with_and_without_stored_lm_head(tiny_checkpoint, tmp_path, stored_lm_head):
    path = copy(tiny_checkpoint("qwen2", tie_word_embeddings=True), tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    embed = tensors["model.embed_tokens.weight"]
    if stored_lm_head != "absent":
        # transformers 5 ties an identical copy and keeps a different one untied (with a warning)
        tensors["lm_head.weight"] = embed.clone() if stored_lm_head == "same" else torch.randn_like(embed)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    runner = harness.make_runner(path)
    tied = runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    assert tied == (stored_lm_head != "different")
    out = harness.extend(runner, harness.new_seqs(runner, 1), [PROMPT]).next_token_logits[0]
    assert (out - transformers_logits(path)).abs().max() <= 1e-4


def test_validate_checkpoint_accepts_same_layout_other_weights(tiny_checkpoint):
    running = ModelConfig.from_pretrained(tiny_checkpoint("llama", seed=0))
    tensors = validate_checkpoint(tiny_checkpoint("llama", seed=1), running)
    assert "model.embed_tokens.weight" in tensors


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_size": 128, "intermediate_size": 256},
     r"parameter model.embed_tokens.weight: shape \(512, 64\) in the running model, \(512, 128\) in "),
    ({"num_hidden_layers": 3}, r"unexpected parameter model.layers.2\."),
    ({"num_hidden_layers": 1}, r"parameter model.layers.1.self_attn.q_proj.weight: shape \(64, 64\) in the running model, absent in "),
    ({"vocab_size": 600}, r"model.embed_tokens.weight: shape \(512, 64\) in the running model, \(600, 64\)"),
    ({"rope_theta": 500.0}, r"config field rope_parameters"),
])
def test_validate_checkpoint_names_first_mismatch(tiny_checkpoint, overrides, message):
    running_path = tiny_checkpoint("llama", seed=0)
    running = ModelConfig.from_pretrained(running_path)
    runner = harness.make_runner(running_path)
    before = {n: p.clone() for n, p in runner.model.named_parameters()}
    with pytest.raises(CheckpointError, match=message):
        validate_checkpoint(tiny_checkpoint("llama", seed=2, **overrides), running, runner.model)
    assert all(torch.equal(p, before[n]) for n, p in runner.model.named_parameters())


def test_validate_checkpoint_rejects_other_architecture_and_missing_shard(tiny_checkpoint, sharded):
    running = ModelConfig.from_pretrained(tiny_checkpoint("llama"))
    with pytest.raises(CheckpointError, match="architectures\\[0\\]: running 'LlamaForCausalLM', new checkpoint 'Qwen2ForCausalLM'"):
        validate_checkpoint(tiny_checkpoint("qwen2"), running)
    path, shards = sharded
    (path / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=f"{shards[-1]} is missing"):
        validate_checkpoint(path, running)

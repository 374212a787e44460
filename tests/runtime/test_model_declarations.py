"""What each model file declares, and the checkpoint layout read from the built module (no
hand-written table): every tiny checkpoint's tensors and shapes equal what the model expects."""

from __future__ import annotations

import pytest
import torch

from shardline_runtime.configs.model_config import MUST_MATCH_FIELDS, ModelConfig
from shardline_runtime.model_loader.checkpoint_files import discover_checkpoint
from shardline_runtime.model_loader.loader import build_model
from shardline_runtime.models.weight_loading import checkpoint_shapes
from shardline_runtime.tiny_checkpoint import ARCHITECTURES


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_expected_checkpoint_shapes_come_from_the_built_module(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    config = ModelConfig.from_pretrained(path)
    model = build_model(config, torch.device("meta"))
    stored = {name: info.shape for name, info in discover_checkpoint(path).items()}
    ignored = model.ignored_checkpoint_names()
    stored = {name: shape for name, shape in stored.items() if not name.endswith(ignored)}
    assert checkpoint_shapes(model) == stored


@pytest.mark.parametrize("arch, qkv_bias, o_proj_bias, qk_norm", [
    ("llama", False, False, False),
    ("qwen2", True, False, False),
    ("qwen3", False, False, True),
    ("qwen2_moe", True, False, False),
    ("qwen3_moe", False, False, True),
])
def test_model_file_declares_biases_and_qk_norm(tiny_checkpoint, arch, qkv_bias, o_proj_bias, qk_norm):
    model = build_model(ModelConfig.from_pretrained(tiny_checkpoint(arch)), torch.device("meta"))
    attn = model.model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == qkv_bias
    assert (attn.o_proj.bias is not None) == o_proj_bias
    assert (attn.q_norm is not None) == qk_norm


def test_llama_attention_bias_follows_config_json(tiny_checkpoint):
    config = ModelConfig.from_pretrained(tiny_checkpoint("llama", attention_bias=True))
    attn = build_model(config, torch.device("meta")).model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None
    assert attn.o_proj.bias is not None


def test_config_parser_no_longer_decides_per_architecture_layers():
    assert not {"qkv_bias", "o_proj_bias", "qk_norm"} & set(ModelConfig.__dataclass_fields__)
    assert set(MUST_MATCH_FIELDS) <= set(ModelConfig.__dataclass_fields__)

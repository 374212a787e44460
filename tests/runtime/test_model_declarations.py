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


# ---- each model class declares its architecture and its config.json rules -------------------

from shardline_runtime.models.registry import MODEL_REGISTRY, MODELS  # noqa: E402


@pytest.mark.parametrize("model_cls", MODELS, ids=lambda m: m.__name__)
def test_each_registered_class_declares_its_own_architecture(model_cls):
    assert "architecture" in vars(model_cls)


def test_the_registry_is_keyed_by_the_declared_names():
    assert list(MODEL_REGISTRY) == [m.architecture for m in MODELS]


def _config(arch: str, **extra) -> dict:
    return dict(architectures=[arch], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=100, **extra)


@pytest.mark.parametrize("arch, extra, windows", [
    ("LlamaForCausalLM", {"sliding_window": 8}, (None,) * 4),
    ("MistralForCausalLM", {"sliding_window": 8}, (8,) * 4),
    ("Qwen2ForCausalLM", {"sliding_window": 8}, (None,) * 4),
    ("Qwen2ForCausalLM", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2}, (None, None, 8, 8)),
    ("Qwen3ForCausalLM", {"sliding_window": 8, "use_sliding_window": True,
                          "layer_types": ["sliding_attention", "full_attention"] * 2}, (8, None, 8, None)),
])
def test_sliding_windows_follow_the_model_class_rule(arch, extra, windows):
    assert ModelConfig.from_dict(_config(arch, **extra)).sliding_windows == windows


def test_mixtral_declares_its_moe_spelling():
    cfg = ModelConfig.from_dict(_config("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2))
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (4, 128, True)


def test_qwen2_moe_declares_its_shared_expert():
    cfg = ModelConfig.from_dict(_config("Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, shared_expert_intermediate_size=64))
    assert cfg.shared_expert_intermediate_size == 64


def test_qwen3_moe_has_no_shared_expert():
    cfg = ModelConfig.from_dict(_config("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, shared_expert_intermediate_size=64))
    assert cfg.shared_expert_intermediate_size == 0


def test_a_dense_model_has_no_experts():
    assert ModelConfig.from_dict(_config("Qwen3ForCausalLM", num_experts=4)).num_experts == 0


def test_an_unknown_architecture_lists_the_registered_ones():
    from shardline_runtime.configs.model_config import ModelConfigError

    with pytest.raises(ModelConfigError, match="supported: LlamaForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_dict(_config("GPT2LMHeadModel"))

"""Qwen2-MoE (Qwen1.5-MoE): the Qwen2 attention (q/k/v biases as ``config.json``'s ``qkv_bias``
says, default on; none on o_proj) and a sparse MoE block with a *shared expert* of
``shared_expert_intermediate_size`` that every token passes through, scaled by
``sigmoid(shared_expert_gate(x))`` (see ``SparseMoeBlock``)."""

from __future__ import annotations

from typing import Any

from shardline_runtime.configs.model_config import ModelConfig, qwen_sliding_windows
from shardline_runtime.configs.moe_config import qwen_moe_fields
from shardline_runtime.models.qwen2 import Qwen2Attention
from shardline_runtime.models.sparse_moe_block import MoeDecoderLayer, MoeForCausalLM


class Qwen2MoeAttention(Qwen2Attention):
    @classmethod
    def qkv_bias(cls, config: ModelConfig) -> bool:
        return bool(config.hf_config.get("qkv_bias", True))


class Qwen2MoeDecoderLayer(MoeDecoderLayer):
    attention_cls = Qwen2MoeAttention


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE causal LM (same interface as :class:`LlamaForCausalLM`)."""

    layer_cls = Qwen2MoeDecoderLayer
    architecture = "Qwen2MoeForCausalLM"
    sliding_windows = staticmethod(qwen_sliding_windows)

    @staticmethod
    def moe_fields(cfg: dict, layers: int) -> dict[str, Any]:
        return qwen_moe_fields(cfg, layers, shared_expert=True)

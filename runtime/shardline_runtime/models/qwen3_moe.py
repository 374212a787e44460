"""Qwen3-MoE: the Qwen3 attention (q/k RMSNorm per head) and a sparse MoE block (top-k of
``num_experts`` experts of size ``moe_intermediate_size``, ``norm_topk_prob`` as configured,
no shared expert) on the layers ``decoder_sparse_step`` / ``mlp_only_layers`` select."""

from __future__ import annotations

from typing import Any

from shardline_runtime.configs.model_config import qwen_sliding_windows
from shardline_runtime.configs.moe_config import qwen_moe_fields
from shardline_runtime.models.qwen3 import Qwen3Attention
from shardline_runtime.models.sparse_moe_block import MoeDecoderLayer, MoeForCausalLM


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE causal LM (same interface as :class:`LlamaForCausalLM`)."""

    layer_cls = Qwen3MoeDecoderLayer
    architecture = "Qwen3MoeForCausalLM"
    sliding_windows = staticmethod(qwen_sliding_windows)

    @staticmethod
    def moe_fields(cfg: dict, layers: int) -> dict[str, Any]:
        return qwen_moe_fields(cfg, layers, shared_expert=False)

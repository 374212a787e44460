"""Qwen3-MoE: the Qwen3 attention (q/k RMSNorm per head) and a sparse MoE block (top-k of
``num_experts`` experts of size ``moe_intermediate_size``, ``norm_topk_prob`` as configured,
no shared expert) on the layers ``decoder_sparse_step`` / ``mlp_only_layers`` select."""

from __future__ import annotations

from shardline_runtime.models.qwen3 import Qwen3Attention
from shardline_runtime.models.sparse_moe_block import MoeDecoderLayer, MoeForCausalLM


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE causal LM (same interface as :class:`LlamaForCausalLM`)."""

    layer_cls = Qwen3MoeDecoderLayer

"""Qwen2-MoE (Qwen1.5-MoE): the Qwen2 attention (q/k/v biases) and a sparse MoE block with a
*shared expert* of ``shared_expert_intermediate_size`` that every token passes through, scaled
by ``sigmoid(shared_expert_gate(x))`` (see ``SparseMoeBlock``)."""

from __future__ import annotations

from shardline_runtime.models.sparse_moe_block import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE causal LM (same interface as :class:`LlamaForCausalLM`)."""

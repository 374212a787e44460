"""Mixtral (Jiang et al. 2024): the Mistral block (optional sliding window) with every MLP a
sparse MoE block, top-2 of 8 by default, weights always renormalised over the chosen experts.
Checkpoints name the block ``block_sparse_moe`` and the expert projections ``w1`` (gate),
``w3`` (up), ``w2`` (down); they load into the same ``mlp.experts`` parameters as Qwen-MoE."""

from __future__ import annotations

from shardline_runtime.configs.model_config import every_layer_sliding_window
from shardline_runtime.configs.moe_config import mixtral_moe_fields
from shardline_runtime.models.sparse_moe_block import MoeDecoderLayer, MoeForCausalLM


class MixtralDecoderLayer(MoeDecoderLayer):
    moe_block_name = "block_sparse_moe"
    expert_names = {"w1": "w1", "w2": "w2", "w3": "w3"}


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral causal LM (same interface as :class:`LlamaForCausalLM`)."""

    layer_cls = MixtralDecoderLayer
    moe_block_name = MixtralDecoderLayer.moe_block_name
    expert_names = MixtralDecoderLayer.expert_names
    architecture = "MixtralForCausalLM"
    sliding_windows = staticmethod(every_layer_sliding_window)
    moe_fields = staticmethod(mixtral_moe_fields)

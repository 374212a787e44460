"""Qwen3: the Llama block plus RMSNorm over each head of q and k (``q_norm``/``k_norm``, weight
of size ``head_dim``) before RoPE, and an explicit ``head_dim`` that may differ from
``hidden_size / num_attention_heads``."""

from __future__ import annotations

import torch

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.layers.layernorm import RMSNorm
from shardline_runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # per head: (T, H, head_dim)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM (same interface as :class:`LlamaForCausalLM`)."""

    layer_cls = Qwen3DecoderLayer

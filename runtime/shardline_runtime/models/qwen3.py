"""Qwen3: the Llama block plus RMSNorm over each head of q and k (``q_norm``/``k_norm``, weight
of size ``head_dim``) before RoPE, and an explicit ``head_dim`` that may differ from
``hidden_size / num_attention_heads``. Biases follow ``config.json``'s ``attention_bias``."""

from __future__ import annotations

from shardline_runtime.configs.model_config import qwen_sliding_windows
from shardline_runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM (same interface as :class:`LlamaForCausalLM`)."""

    layer_cls = Qwen3DecoderLayer
    architecture = "Qwen3ForCausalLM"
    sliding_windows = staticmethod(qwen_sliding_windows)

"""Qwen2: the Llama block with biases on the q/k/v projections and none on o_proj (whatever
``config.json`` says about ``attention_bias``), and optional per-layer sliding windows
(``use_sliding_window`` + ``max_window_layers``/``layer_types``, read into
``ModelConfig.sliding_windows``)."""

from __future__ import annotations

from shardline_runtime.configs.model_config import ModelConfig, qwen_sliding_windows
from shardline_runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @classmethod
    def qkv_bias(cls, config: ModelConfig) -> bool:
        return True

    @classmethod
    def o_proj_bias(cls, config: ModelConfig) -> bool:
        return False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM (same interface as :class:`LlamaForCausalLM`)."""

    layer_cls = Qwen2DecoderLayer
    architecture = "Qwen2ForCausalLM"
    sliding_windows = staticmethod(qwen_sliding_windows)

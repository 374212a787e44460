"""Qwen2: the Llama block with biases on the q/k/v projections (none on o_proj) and optional
per-layer sliding windows (``use_sliding_window`` + ``max_window_layers``/``layer_types``).
Both differences are read from ``ModelConfig`` (``qkv_bias``, ``sliding_windows``)."""

from __future__ import annotations

from shardline_runtime.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM (same interface as :class:`LlamaForCausalLM`)."""

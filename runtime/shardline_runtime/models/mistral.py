"""Mistral: the Llama block with an optional sliding attention window on every layer
(``sliding_window``; None means full attention) and an explicit ``head_dim``. Both are read
from ``ModelConfig``."""

from __future__ import annotations

from shardline_runtime.configs.model_config import every_layer_sliding_window
from shardline_runtime.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral causal LM (same interface as :class:`LlamaForCausalLM`)."""

    architecture = "MistralForCausalLM"
    sliding_windows = staticmethod(every_layer_sliding_window)

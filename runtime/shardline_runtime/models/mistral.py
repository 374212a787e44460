"""Mistral: the Llama block with an optional sliding attention window on every layer
(``sliding_window``; None means full attention) and an explicit ``head_dim``. Both are read
from ``ModelConfig``."""

from __future__ import annotations

from shardline_runtime.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral causal LM (same interface as :class:`LlamaForCausalLM`)."""

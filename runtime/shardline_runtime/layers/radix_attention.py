"""RadixAttention: the attention layer models call; the math lives in the attention backend
(``forward_batch.attn_backend``), which also writes this layer's K/V into the KV pool."""

from __future__ import annotations

import torch
from torch import nn


class RadixAttention(nn.Module):
    """Per-layer attention settings; ``forward`` delegates to the backend.

    Args:
        num_heads: query heads on this rank.
        head_dim: per-head size.
        scaling: softmax scale (``head_dim ** -0.5``).
        num_kv_heads: KV heads on this rank.
        layer_id: index into the KV pool.
        sliding_window: attend to the last ``sliding_window`` positions only (None: all).

    Attributes:
        k_scale, v_scale: float dequantisation scales of this layer's stored K / V (an fp8 KV
            cache stores ``k / k_scale``); 1.0 unless the checkpoint carries them
            (``model_executor/kv_cache_dtype.py``).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window = sliding_window
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch
    ) -> torch.Tensor:
        """q (T, num_heads * head_dim), k/v (T, num_kv_heads * head_dim) -> (T, num_heads * head_dim)."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)

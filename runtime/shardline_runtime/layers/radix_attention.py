"""RadixAttention: the attention layer models call; the math lives in the attention backend
(``forward_batch.attn_backend``), which also writes this layer's K/V into the KV pool.

Rotary embedding is applied here too when the model hands over its ``rotary_emb`` and the
``positions``: on CUDA one Triton kernel rotates q and k and stores k and v in the pool
(``layers/triton_rope_kv.py``, after SGLang's fused ``apply_rope_with_cos_sin_cache`` +
``set_kv_buffer``), and the backend is told not to store them again. Elsewhere (the CPU, a
``dynamic`` RoPE whose table depends on the step, the piecewise EXTEND graphs' attention split)
the unfused path runs: ``RotaryEmbedding`` then the backend's own store.

Under ``torch.compile`` (``--enable-torch-compile``) the whole call is opaque to Dynamo (a graph
break, as SGLang keeps attention out of the compiled graph): Inductor compiles the parts of the
layer around it, and the backend's Python metadata handling is never traced.
"""

from __future__ import annotations

import torch
from torch import nn

from shardline_runtime.attention.base import AttentionBackend


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
        fuse_rope_kv: whether rotary and the KV store run as one Triton kernel; None (default):
            on CUDA. True on the CPU needs Triton's interpreter (``TRITON_INTERPRET=1``).
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
        self.fuse_rope_kv: bool | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch,
        positions: torch.Tensor | None = None,
        rotary_emb: nn.Module | None = None,
    ) -> torch.Tensor:
        """q (T, num_heads * head_dim), k/v (T, num_kv_heads * head_dim) -> (T, num_heads * head_dim).

        With ``rotary_emb`` (a ``RotaryEmbedding``) and ``positions`` ((T,) int64), q and k are
        the unrotated projections and the rotation happens here (see the module doc).
        """
        if torch.compiler.is_compiling():
            return _opaque_forward(self, q, k, v, forward_batch, positions, rotary_emb)
        return self._forward(q, k, v, forward_batch, positions, rotary_emb)

    def _forward(self, q, k, v, forward_batch, positions, rotary_emb) -> torch.Tensor:
        backend = forward_batch.attn_backend
        if rotary_emb is None or positions is None:
            return backend.forward(q, k, v, self, forward_batch)
        if q.dim() != 3 or k.dim() != 3:  # models that split the heads skip two ops per layer
            q = q.reshape(-1, self.tp_q_head_num, self.head_dim)  # (T, Hq, D)
            k = k.reshape(-1, self.tp_k_head_num, self.head_dim)  # (T, Hkv, D)
        v = v.reshape(-1, self.tp_k_head_num, self.head_dim)
        stored = self._fused_rope_and_store(q, k, v, forward_batch, positions, rotary_emb)
        if stored is not None:
            q, k = stored
        else:
            q, k = rotary_emb(positions, q, k)
        # the backend takes (T, H, D) as well as (T, H * D)
        if stored is None:  # any backend, the piecewise graphs' attention split included
            return backend.forward(q, k, v, self, forward_batch)
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache=False)

    def _fused_rope_and_store(
        self, q, k, v, forward_batch, positions, rotary_emb
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotated (q, k) after one fused kernel stored k and v, or None where the unfused
        path must run (not on CUDA, a step-dependent ``dynamic`` table, an empty step, or a
        backend that is not a real one, such as the piecewise graphs' attention split)."""
        fuse = q.is_cuda if self.fuse_rope_kv is None else self.fuse_rope_kv
        backend = forward_batch.attn_backend
        if (
            not fuse
            or rotary_emb.rope_type == "dynamic"
            or q.shape[0] == 0
            or not isinstance(backend, AttentionBackend)
        ):
            return None
        from shardline_runtime.layers.triton_rope_kv import rope_and_store_kv

        pool = forward_batch.token_to_kv_pool or backend.token_to_kv_pool
        k_cache, v_cache = pool.get_kv_buffer(self.layer_id)
        return rope_and_store_kv(
            positions,
            q,
            k,
            v,
            rotary_emb.cos_cached,
            rotary_emb.sin_cached,
            k_cache,
            v_cache,
            forward_batch.out_cache_loc,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )


@torch.compiler.disable
def _opaque_forward(layer: RadixAttention, q, k, v, forward_batch, positions, rotary_emb):
    """``RadixAttention._forward`` outside Dynamo's graph (``--enable-torch-compile``)."""
    return layer._forward(q, k, v, forward_batch, positions, rotary_emb)

"""Rotary embedding applied together with the KV-cache store, as one Triton kernel (GPU path;
after SGLang's fused ``apply_rope_with_cos_sin_cache`` + ``set_kv_buffer`` and vLLM's
``rotary_embedding`` with the cache write of ``reshape_and_cache``).

One program per (token, head) of q and of k: it reads the token's position, the cos/sin row of
the shared table (``RotaryEmbedding.cos_cached`` / ``sin_cached``, (max_positions, head_dim)
float32, both halves equal), rotates the head as ``x * cos + rotate_half(x) * sin`` (NeoX
layout, cos/sin cast to the model dtype first, as ``RotaryEmbedding.forward``) and stores it; a
k program also stores the rotated key, and the value, in the KV pool at the token's slot
``loc[t]``. The eager path launches about 16 kernels for the rotation and 2 for the store.
Only the unscaled store (``k_scale == v_scale == 1``, cache dtype == model dtype) is fused; the
caller keeps the eager path otherwise. Tested on the CPU under ``TRITON_INTERPRET=1`` against
the unfused path (``tests/runtime/test_triton_rope_kv.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kv_kernel(
    positions_ptr,
    loc_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_cos,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    num_q_heads,
    half,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    pos = tl.load(positions_ptr + t)
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=mask, other=0.0)
    if h < num_q_heads:
        base = q_ptr + t * stride_q_t + h * stride_q_h
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + half + offs, mask=mask, other=0.0)
        c = cos.to(x1.dtype)
        s = sin.to(x1.dtype)
        out = q_out_ptr + t * stride_q_t + h * stride_q_h
        tl.store(out + offs, (x1 * c - x2 * s).to(x1.dtype), mask=mask)
        tl.store(out + half + offs, (x2 * c + x1 * s).to(x1.dtype), mask=mask)
    else:
        kh = h - num_q_heads
        base = k_ptr + t * stride_k_t + kh * stride_k_h
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + half + offs, mask=mask, other=0.0)
        c = cos.to(x1.dtype)
        s = sin.to(x1.dtype)
        r1 = (x1 * c - x2 * s).to(x1.dtype)
        r2 = (x2 * c + x1 * s).to(x1.dtype)
        out = k_out_ptr + t * stride_k_t + kh * stride_k_h
        tl.store(out + offs, r1, mask=mask)
        tl.store(out + half + offs, r2, mask=mask)
        slot = tl.load(loc_ptr + t)
        kc = k_cache_ptr + slot * stride_kc_s + kh * stride_kc_h
        tl.store(kc + offs, r1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(kc + half + offs, r2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        vbase = v_ptr + t * stride_v_t + kh * stride_v_h
        vc = v_cache_ptr + slot * stride_vc_s + kh * stride_vc_h
        v1 = tl.load(vbase + offs, mask=mask, other=0.0)
        v2 = tl.load(vbase + half + offs, mask=mask, other=0.0)
        tl.store(vc + offs, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + half + offs, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rope_and_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cached: torch.Tensor,
    sin_cached: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at ``positions`` and write the rotated k, and v, to the KV pool at ``loc``,
    in one launch; returns the rotated (q, k) (new tensors; the inputs are not modified).

    Args:
        positions: (T,) int64 absolute positions.
        q: (T, Hq, head_dim); k, v: (T, Hkv, head_dim); the model dtype, last dim contiguous.
        cos_cached / sin_cached: (max_positions, head_dim) float32 tables (both halves equal).
        k_cache / v_cache: one layer's pool, (slots, Hkv, head_dim) views (any strides with a
            contiguous last dim), e.g. ``TokenToKVPool.get_kv_buffer(layer_id)``.
        loc: (T,) int64 slots.

    Raises:
        ValueError: an odd ``head_dim``, or shapes that disagree (the message names them).
    """
    tokens, q_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    if k.shape != v.shape or k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (T={tokens}, Hkv, {head_dim})"
        )
    if positions.shape != (tokens,) or loc.shape != (tokens,):
        raise ValueError(
            f"positions {tuple(positions.shape)} and loc {tuple(loc.shape)} must be ({tokens},)"
        )
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rope_kv_kernel[(tokens, q_heads + k.shape[1])](
        positions, loc, q, k, v, q_out, k_out, cos_cached, sin_cached, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_cached.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), q_heads, half, BLOCK=triton.next_power_of_2(half),
    )  # fmt: skip
    return q_out, k_out

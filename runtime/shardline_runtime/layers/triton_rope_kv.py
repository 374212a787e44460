"""Rotary embedding applied together with the KV-cache store, as one Triton kernel (GPU path;
after SGLang's fused ``apply_rope_with_cos_sin_cache`` + ``set_kv_buffer`` and vLLM's
``rotary_embedding`` with the cache write of ``reshape_and_cache``).

One program per (token, head) of q and of k: it reads the token's position, the cos/sin row of
the shared table (``RotaryEmbedding.cos_cached`` / ``sin_cached``, (max_positions, head_dim)
float32, both halves equal), rotates the head as ``x * cos + rotate_half(x) * sin`` (NeoX
layout, cos/sin cast to the model dtype first, as ``RotaryEmbedding.forward``) and stores it; a
k program also stores the rotated key, and the value, in the KV pool at the token's slot
``loc[t]``. The eager path launches about 16 kernels for the rotation and 2 for the store.
The store quantises as ``TokenToKVPool.set_kv_buffer`` does: ``x / scale`` in the model dtype,
then, for a one-byte (fp8) cache, clamped to the type's finite range before the cast.
``RadixAttention`` calls it on CUDA (``layers/radix_attention.py``). Tested on the CPU under
``TRITON_INTERPRET=1`` against the unfused path (``tests/runtime/test_triton_rope_kv.py``,
``tests/runtime/test_rope_kv_wiring.py``).
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
    stride_qo_t,
    stride_qo_h,
    stride_ko_t,
    stride_ko_h,
    stride_cos,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    num_q_heads,
    half,
    k_scale,
    v_scale,
    limit,
    BLOCK: tl.constexpr,
    SCALED: tl.constexpr,
    CLAMP: tl.constexpr,
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
        out = q_out_ptr + t * stride_qo_t + h * stride_qo_h
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
        out = k_out_ptr + t * stride_ko_t + kh * stride_ko_h
        tl.store(out + offs, r1, mask=mask)
        tl.store(out + half + offs, r2, mask=mask)
        slot = tl.load(loc_ptr + t)
        kc = k_cache_ptr + slot * stride_kc_s + kh * stride_kc_h
        tl.store(kc + offs, _quantize(r1, k_scale, limit, k_cache_ptr, SCALED, CLAMP), mask=mask)
        tl.store(
            kc + half + offs, _quantize(r2, k_scale, limit, k_cache_ptr, SCALED, CLAMP), mask=mask
        )
        vbase = v_ptr + t * stride_v_t + kh * stride_v_h
        vc = v_cache_ptr + slot * stride_vc_s + kh * stride_vc_h
        v1 = tl.load(vbase + offs, mask=mask, other=0.0)
        v2 = tl.load(vbase + half + offs, mask=mask, other=0.0)
        tl.store(vc + offs, _quantize(v1, v_scale, limit, v_cache_ptr, SCALED, CLAMP), mask=mask)
        tl.store(
            vc + half + offs, _quantize(v2, v_scale, limit, v_cache_ptr, SCALED, CLAMP), mask=mask
        )


@triton.jit
def _quantize(x, scale, limit, cache_ptr, SCALED: tl.constexpr, CLAMP: tl.constexpr):
    """``set_kv_buffer``'s steps: ``x / scale`` rounded to x's dtype, clamp for fp8, cast."""
    if SCALED:
        x = (x / scale).to(x.dtype)
    if CLAMP:
        x = tl.minimum(tl.maximum(x, -limit), limit).to(x.dtype)
    return x.to(cache_ptr.dtype.element_ty)


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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at ``positions`` and write the rotated k, and v, to the KV pool at ``loc``,
    in one launch; returns the rotated (q, k) (new contiguous tensors; the inputs are not
    modified).

    Args:
        positions: (T,) int64 absolute positions.
        q: (T, Hq, head_dim); k, v: (T, Hkv, head_dim); the model dtype, last dim contiguous
            (strided views, e.g. of the fused QKV projection's output, are fine).
        cos_cached / sin_cached: (max_positions, head_dim) float32 tables (both halves equal).
        k_cache / v_cache: one layer's pool, (slots, Hkv, head_dim) views (any strides with a
            contiguous last dim), e.g. ``TokenToKVPool.get_kv_buffer(layer_id)``.
        loc: (T,) int64 slots.
        k_scale / v_scale: the layer's dequantisation scales; the cache stores ``k / k_scale``
            (``v / v_scale``), clamped to the finite range of a one-byte float cache dtype.

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
    # contiguous outputs: q and k are often strided views of the fused QKV projection
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    one_byte_float = k_cache.dtype.is_floating_point and k_cache.dtype.itemsize == 1
    limit = float(torch.finfo(k_cache.dtype).max) if one_byte_float else 0.0
    _rope_kv_kernel[(tokens, q_heads + k.shape[1])](
        positions, loc, q, k, v, q_out, k_out, cos_cached, sin_cached, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_cached.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), q_heads, half, float(k_scale), float(v_scale), limit,
        BLOCK=triton.next_power_of_2(half), SCALED=k_scale != 1.0 or v_scale != 1.0,
        CLAMP=one_byte_float,
    )  # fmt: skip
    return q_out, k_out

"""Extend (prefill) attention over the paged pool, after a cached prefix.

Program ``(request b, query head h, block m)`` takes ``BLOCK_M`` new tokens of request ``b`` and
attends them, with an online softmax (FlashAttention: Dao et al. 2022), over the request's keys
``0 .. prefix + i`` read through ``req_to_token`` (the new tokens' K/V were written into the pool
first, so the cached prefix and the new part are one loop). Causal inside the new part; with a
sliding window, query position ``p`` sees keys ``p - window < k <= p`` (transformers' convention,
as the torch_native backend). Grouped-query attention: query head ``h`` reads KV head
``h // (Hq / Hkv)``. fp8 pools are multiplied by ``k_scale`` / ``v_scale`` after loading.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG: tl.constexpr = tl.constexpr(-1.0e30)  # a finite "minus infinity": no inf - inf = NaN


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    O,
    req_to_token,
    req_pool_indices,
    prefix_lens,
    extend_lens,
    q_start_loc,
    sm_scale,
    k_scale,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kh,
    stride_kt,
    stride_vh,
    stride_vt,
    stride_ot,
    stride_oh,
    stride_row,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    ext = tl.load(extend_lens + b)
    if mblk * BLOCK_M < ext:
        prefix = tl.load(prefix_lens + b)
        row = tl.load(req_pool_indices + b)
        q0 = tl.load(q_start_loc + b)
        kvh = h // GROUP
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            Q + (q0 + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        q_pos = prefix + offs_m  # absolute positions of these queries
        hi = tl.minimum(prefix + (mblk + 1) * BLOCK_M, prefix + ext)  # causal: keys < hi
        lo = tl.where(window > 0, tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0), 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slots = tl.load(req_to_token + row * stride_row + offs_n, mask=mask_n, other=0)
            k = tl.load(
                K + kvh * stride_kh + slots[None, :] * stride_kt + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            if IEEE:
                qk = tl.dot(q, k, input_precision="ieee")
            else:
                qk = tl.dot(q, k)
            allowed = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            allowed = allowed & ((window <= 0) | (offs_n[None, :] > q_pos[:, None] - window))
            qk = tl.where(allowed, qk * sm_scale, _NEG)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            p = tl.where(allowed, p, 0.0)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(
                V + kvh * stride_vh + slots[:, None] * stride_vt + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
            if IEEE:
                pv = tl.dot(p.to(q.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(q.dtype), v)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(
            O + (q0 + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(O.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    *,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole sequence in the pool.

    Args:
        q: (T, Hq, D) new tokens, packed request after request. out: (T, Hq, D), written.
        k_buffer, v_buffer: (Hkv, slots, D) head-major pool of one layer (the new K/V already in it).
        req_to_token: (rows, max_context_len) int64. req_pool_indices, prefix_lens,
        extend_lens, q_start_loc: (bs,) int64 (``q_start_loc``: exclusive prefix sum of
        ``extend_lens``). max_extend_len: the largest ``extend_lens`` (sizes the grid).
        sm_scale: softmax scale. window: sliding window (None: all). k_scale, v_scale: fp8 scales.

    Returns:
        ``out``; float32 softmax and accumulation (IEEE dot products for float32 inputs).
    """
    t, hq, d = q.shape
    bs = req_pool_indices.shape[0]
    if t == 0 or bs == 0:
        return out
    hkv = k_buffer.shape[0]
    block_m = 32 if max_extend_len <= 32 else 64
    block_n = 32 if q.dtype == torch.float32 else 64
    grid = (bs, hq, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        q_start_loc,
        sm_scale,
        k_scale,
        v_scale,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=hq // hkv,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(d),
        IEEE=q.dtype == torch.float32,
        num_warps=4,
    )
    return out

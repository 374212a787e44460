"""Split-K decode attention (flash-decoding: Dao et al. 2023, "Flash-Decoding for long-context
inference"; the two-stage layout follows SGLang's ``decode_attention.py``).

Stage 1: program ``(request b, KV head h, split s)`` attends the group of query heads sharing KV
head ``h`` over split ``s`` of the request's keys, with an online softmax (Milakov & Gimelshein
2018), and writes the split's normalised output and log-sum-exp. Stage 2: one program per
(request, query head) merges the splits: ``out = sum_s exp(lse_s - M) * o_s / sum_s exp(lse_s - M)``.

Keys of request ``b`` are ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`` (slots of the paged
pool), so the work follows the real ``seq_lens``: a split past the end of a short request does
nothing. Sliding window: only the last ``window`` keys are read. The pool may be stored in fp8;
each loaded K/V block is multiplied by its ``k_scale`` / ``v_scale``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG: tl.constexpr = tl.constexpr(-1.0e30)  # a finite "minus infinity": no inf - inf = NaN


@triton.jit
def _decode_stage1(
    Q,
    K,
    V,
    kv_indptr,
    kv_indices,
    Out,
    Lse,
    sm_scale,
    k_scale,
    v_scale,
    window,
    stride_qb,
    stride_qh,
    stride_kh,
    stride_kt,
    stride_vh,
    stride_vt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(kv_indptr + b)
    seq_len = tl.load(kv_indptr + b + 1) - start
    lo = tl.where(
        window > 0, tl.maximum(seq_len - window, 0), 0
    )  # sliding window: the last keys only
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    offs_h = kvh * GROUP + offs_g
    mask_h = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < s_hi
        slots = tl.load(kv_indices + start + offs_n, mask=mask_n, other=0)
        k = tl.load(
            K + kvh * stride_kh + slots[None, :] * stride_kt + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        k = (k.to(tl.float32) * k_scale).to(q.dtype)  # (BLOCK_D, BLOCK_N)
        if IEEE:
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        qk = tl.where(mask_h[:, None] & mask_n[None, :], qk * sm_scale, _NEG)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            V + kvh * stride_vh + slots[:, None] * stride_vt + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        v = (v.to(tl.float32) * v_scale).to(q.dtype)  # (BLOCK_N, BLOCK_D)
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    has = s_hi > s_lo
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(has, m_i + tl.log(l_safe), _NEG)
    tl.store(
        Out + b * stride_ob + offs_h[:, None] * stride_oh + split * stride_os + offs_d[None, :],
        acc / l_safe[:, None],
        mask=mask_h[:, None] & mask_d[None, :],
    )
    tl.store(Lse + b * stride_lb + offs_h * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    Mid,
    Lse,
    O,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + offs_s)
    m = tl.max(lse, 0)
    w = tl.where(lse > -1.0e29, tl.exp(lse - m), 0.0)
    o = tl.load(
        Mid + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
        mask=mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_kv_splits: int = 16,
    block_n: int = 64,
) -> torch.Tensor:
    """One query per request over its paged keys; grouped-query attention.

    Args:
        q: (bs, Hq, D) in the model dtype. out: (bs, Hq, D), written in place.
        k_buffer, v_buffer: (Hkv, slots, D) head-major pool of one layer (model dtype or fp8).
        kv_indptr: (>= bs + 1,) int64; kv_indices: int64 slots (see module doc).
        sm_scale: softmax scale. window: attend the last ``window`` keys only (None: all).
        k_scale, v_scale: dequantisation scales of the stored K / V.
        num_kv_splits: splits per (request, KV head); a power of two.

    Returns:
        ``out``. Scores, softmax and accumulation are float32; float32 inputs use IEEE dot products.
    """
    bs, hq, d = q.shape
    hkv = k_buffer.shape[0]
    if bs == 0:
        return out
    group = hq // hkv
    block_d = triton.next_power_of_2(d)
    mid = torch.empty((bs, hq, num_kv_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((bs, hq, num_kv_splits), dtype=torch.float32, device=q.device)
    _decode_stage1[(bs, hkv, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        mid,
        lse,
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
        mid.stride(0),
        mid.stride(1),
        mid.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_kv_splits,
        IEEE=q.dtype == torch.float32,
    )
    _decode_stage2[(bs, hq)](
        mid,
        lse,
        out,
        mid.stride(0),
        mid.stride(1),
        mid.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        NUM_SPLITS=num_kv_splits,
    )
    return out

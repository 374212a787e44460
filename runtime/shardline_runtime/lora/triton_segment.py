"""Triton segment GEMM for LoRA on GPU (tested on CPU under ``TRITON_INTERPRET=1``).

The batch's tokens are packed; each request is a contiguous segment with one adapter slot
(``LoRABatchInfo.seg_*``; base-model requests have no segment). One kernel launch computes, for
every segment ``s`` at once, ``out[rows_s] (+)= x[rows_s] @ w[slot_s]^T`` -- the SGMV idea of
Punica (Chen et al. 2023) and SGLang's ``sgemm_lora_a`` / ``sgemm_lora_b`` kernels. LoRA runs it
twice: shrink (``x A^T``, w = ``lora_a``) then expand (``(.) B^T`` added into the base
output, w = ``lora_b``, once per fused sub-module).

Grid: (segments, row blocks of the longest segment x column blocks); a program whose row block
starts past its segment's end returns at once. Accumulation is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _segment_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    seg_starts,
    seg_lens,
    seg_slots,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    IEEE: tl.constexpr,
):
    seg = tl.program_id(0)
    pid = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    start = tl.load(seg_starts + seg)
    length = tl.load(seg_lens + seg)
    slot = tl.load(seg_slots + seg)
    if pid_m * BLOCK_M < length:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < length
        mask_n = offs_n < N
        rows = start + offs_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < K
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + kk[None, :] * stride_xk,
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            b = tl.load(
                w_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + kk[:, None] * stride_wk,
                mask=mask_n[None, :] & mask_k[:, None],
                other=0.0,
            )
            # float32 models get IEEE products (Triton's default for float32 is TF32, about 1e-3
            # off); half precision runs on the tensor cores, accumulating in float32.
            if IEEE:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b.to(a.dtype))
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        mask = mask_m[:, None] & mask_n[None, :]
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def segment_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    accumulate: bool,
) -> None:
    """``out[rows_s] (+)= x[rows_s] @ w[slot_s]^T`` for every segment, in place.

    Args:
        x: (T, K); w: (num_slots, N, K); out: (T, N) (views with any strides).
        seg_starts / seg_lens / seg_slots: (num_segments,) int32 on x's device.
        max_seg_len: the longest segment (sizes the grid).
        accumulate: add into ``out`` (else overwrite the segments' rows).
    """
    num_segments = seg_starts.shape[0]
    if num_segments == 0 or max_seg_len == 0:
        return
    N, K = w.shape[1], w.shape[2]
    grid = (num_segments, triton.cdiv(max_seg_len, BLOCK_M) * triton.cdiv(N, BLOCK_N))
    _segment_gemm_kernel[grid](
        x,
        w,
        out,
        seg_starts,
        seg_lens,
        seg_slots,
        N,
        K,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        ACCUMULATE=accumulate,
        IEEE=x.dtype == torch.float32 and w.dtype == torch.float32,
    )


def segment_lora_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    sub_ranges: list[tuple[int, int]],
    max_rank: int,
    seg: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    max_seg_len: int,
) -> None:
    """``y[rows_s] += B_s (A_s x[rows_s])`` per segment, in place (the GPU path of the wrappers).

    Args:
        x: (T, in); y: (T, out); lora_a: (slots, n_subs * R, in); lora_b: (slots, out, R).
        sub_ranges: ``(offset, size)`` of each sub-module's output columns (sub ``i`` reads
            shrink columns ``[i*R, (i+1)*R)``); one entry for unfused layers.
        seg: (starts, lens, slots) int32 tensors; max_seg_len: the longest segment.
    """
    starts, lens, slots = seg
    xa = torch.zeros(x.shape[0], lora_a.shape[1], dtype=x.dtype, device=x.device)
    segment_gemm(x, lora_a, xa, starts, lens, slots, max_seg_len, accumulate=False)
    for i, (offset, size) in enumerate(sub_ranges):
        segment_gemm(
            xa[:, i * max_rank : (i + 1) * max_rank],
            lora_b[:, offset : offset + size, :],
            y[:, offset : offset + size],
            starts,
            lens,
            slots,
            max_seg_len,
            accumulate=True,
        )

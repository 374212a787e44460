"""Triton GEMM of block-quantized FP8 operands (after DeepSeek-V3's and SGLang's
``w8a8_block_fp8_matmul``): ``out[m, n] = sum_kb (x_q[m, kb] . w_q[n, kb]) * x_scale[m, kb] *
w_scale[n // block_n, kb]``, where ``kb`` runs over blocks of ``block_k`` input features.

Each program computes one (BLOCK_M, BLOCK_N) tile, with ``BLOCK_N`` dividing ``block_n`` and
the K loop stepping one scale block at a time, so each step reads one activation scale per row
and one weight scale per tile. Checked against the dequantized reference on CPU under
``TRITON_INTERPRET=1`` (``tests/runtime/test_quant_kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_block_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    x_scale_ptr,
    w_scale_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_xs_m,
    stride_ws_n,
    BLOCK_SIZE_N_SCALE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_scale_row = (pid_n * BLOCK_N) // BLOCK_SIZE_N_SCALE
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + k[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        ).to(tl.float32)
        xs = tl.load(x_scale_ptr + offs_m * stride_xs_m + kb, mask=mask_m, other=0.0)
        ws = tl.load(w_scale_ptr + w_scale_row * stride_ws_n + kb)
        acc += tl.dot(x, w) * xs[:, None] * ws
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_block_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x_q (M, K)`` fp8 with ``x_scale (M, K / block_k)`` float32, times ``weight (N, K)`` fp8
    with ``w_scale (N / block_n, K / block_k)`` float32, transposed -> (M, N) ``out_dtype``.

    Raises:
        ValueError: ``K`` is not a multiple of ``block_k`` (activations are quantized per
            whole group).
    """
    m, k = x_q.shape
    n = weight.shape[0]
    block_n, block_k = block
    if k % block_k:
        raise ValueError(f"input features {k} are not a multiple of block_k {block_k}")
    block_m = 16 if m <= 16 else 64
    block_n_tile = min(64, block_n)
    while block_n % block_n_tile:
        block_n_tile //= 2
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n_tile))
    _fp8_block_matmul_kernel[grid](
        x_q,
        weight,
        out,
        x_scale,
        w_scale,
        m,
        n,
        k,
        x_q.stride(0),
        weight.stride(0),
        out.stride(0),
        x_scale.stride(0),
        w_scale.stride(0),
        BLOCK_SIZE_N_SCALE=block_n,
        BLOCK_K=block_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n_tile,
    )
    return out

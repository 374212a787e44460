"""Triton W4A16 GEMM: ``out = x (dequantized W)^T`` with ``W`` unpacked from int32 words and
scaled per group inside the K loop (the weight never exists in full precision in memory).

Each program computes one (BLOCK_M, BLOCK_N) tile; ``BLOCK_K`` divides the group size, so one
K step reads one scale per output row. Checked against :func:`dequantize_w4` on CPU under
``TRITON_INTERPRET=1`` (``tests/runtime/test_quant_kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=mask_m[:, None] & (k[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        words = tl.load(
            packed_ptr + offs_n[None, :] * stride_pn + (k[:, None] // 8),
            mask=mask_n[None, :] & (k[:, None] < K),
            other=0,
        )  # (BLOCK_K, BLOCK_N) int32
        q = (words >> ((k[:, None] % 8) * 4)) & 0xF
        scale = tl.load(
            scale_ptr + offs_n * stride_sn + k0 // GROUP_SIZE, mask=mask_n, other=0.0
        ).to(tl.float32)
        w = (q - 8).to(tl.float32) * scale[None, :]
        acc += tl.dot(x, w)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w4a16_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x (M, K)`` times the dequantized ``packed (N, K / 8)`` int32 with ``scale
    (N, K / group_size)``, transposed -> (M, N) in ``x.dtype``.

    Raises:
        ValueError: ``group_size`` is not a multiple of 16 (the smallest K step of a dot).
    """
    m, k = x.shape
    n = packed.shape[0]
    if group_size % 16:
        raise ValueError(f"group_size {group_size} is not a multiple of 16")
    block_k = min(group_size, 64)
    while group_size % block_k:
        block_k //= 2
    block_m = 16 if m <= 16 else 64
    block_n = 64
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        x,
        packed,
        scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        packed.stride(0),
        scale.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out

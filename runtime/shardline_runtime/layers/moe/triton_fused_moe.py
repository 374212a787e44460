"""Triton fused-MoE kernel (CUDA; tested on CPU under ``TRITON_INTERPRET=1``).

The design of the fused-MoE kernel SGLang and vLLM use (after the block-sparse grouped GEMM of
Megablocks, Gale et al. 2022): the (token, expert) pairs are sorted by expert and each expert's
run is padded to a multiple of ``BLOCK_M`` (:func:`align_pairs_to_blocks`), so every row block
of the GEMM belongs to one expert. One program computes a ``BLOCK_M x BLOCK_N`` tile: it loads
the block's rows of the activations through the sorted pair ids (a gather, no copy of the
input) and the expert's weight tile, accumulates over K in float32, optionally scales each row
by its routing weight, and stores the rows back at their pair positions. Two launches make one
MoE layer: ``[gate | up] = x W13^T`` per pair, SiLU-and-multiply in PyTorch, then
``y = act W2^T * routing weight``; the k pairs of a token are summed at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_valid_pairs,
    N,
    K,
    rows_per_pair,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ids_ptr + pid_m)
    if expert >= 0:
        offs_pair = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # (BM,)
        pair_mask = offs_pair < num_valid_pairs
        offs_a_row = (
            offs_pair // rows_per_pair
        )  # row of A: the token (first GEMM) or the pair (second)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + offs_k) < K
            a = tl.load(
                a_ptr + offs_a_row[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                mask=pair_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr
                + expert * stride_be
                + (k0 + offs_k)[:, None] * stride_bk
                + offs_n[None, :] * stride_bn,
                mask=k_mask[:, None] & (offs_n[None, :] < N),
                other=0.0,
            )
            # float32 models get IEEE products (Triton's default for float32 is TF32, about 1e-3
            # off); half precision runs on the tensor cores, accumulating in float32.
            if IEEE:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b.to(a.dtype))
        if MUL_ROUTED_WEIGHT:
            w = tl.load(weights_ptr + offs_pair, mask=pair_mask, other=0.0)
            acc = acc * w[:, None]
        c = c_ptr + offs_pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & (offs_n[None, :] < N))


def align_pairs_to_blocks(
    local_ids: torch.Tensor, num_local_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the pairs by expert and pad each expert's run to a multiple of ``block_m``, on the
    device and without a host sync (so a decode step that runs it can be captured in a CUDA
    graph): the output has the fixed size ``ceil(T * k / block_m) + num_local_experts`` blocks.

    Args:
        local_ids: (T, k) int64 local expert of each pair, -1 for pairs of other ranks.

    Returns:
        ``(sorted_pair_ids (num_blocks * block_m,) int32, padded with T * k,
        block_expert_ids (num_blocks,) int32, -1 for unused blocks)``; pair id ``p`` is token
        ``p // k``, choice ``p % k``.
    """
    flat = local_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    num_blocks = -(-num_pairs // block_m) + num_local_experts
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat + 1, torch.ones_like(flat))
    counts = counts[1:]  # (E,) pairs per local expert
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    sorted_start = (
        torch.cumsum(counts, 0) - counts
    )  # where each expert's run begins among local pairs
    order = torch.argsort(
        torch.where(flat < 0, num_local_experts, flat), stable=True
    )  # local pairs first
    expert_of = flat[order]
    local = expert_of >= 0
    safe = expert_of.clamp(min=0)
    rank_in_run = torch.arange(num_pairs, device=device) - sorted_start[safe]
    target = torch.where(local, padded_end[safe] - padded[safe] + rank_in_run, num_blocks * block_m)
    sorted_ids = torch.full(
        (num_blocks * block_m + 1,), num_pairs, dtype=torch.int64, device=device
    )
    sorted_ids.scatter_(0, target, order)  # other ranks' pairs land in the extra last slot
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_start, right=True)
    block_experts = torch.where(block_start < padded_end[-1], block_experts, -1)
    return sorted_ids[:-1].to(torch.int32), block_experts.to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_experts: torch.Tensor,
    num_pairs: int,
    rows_per_pair: int,
    weights: torch.Tensor | None,
) -> None:
    n, k = b.shape[1], b.shape[2]
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _fused_moe_kernel[grid](
        a,
        b,
        c,
        weights if weights is not None else c,
        sorted_ids,
        block_experts,
        num_pairs,
        n,
        k,
        rows_per_pair,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        MUL_ROUTED_WEIGHT=weights is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        IEEE=a.dtype == torch.float32,
    )


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    local_ids: torch.Tensor,
) -> torch.Tensor:
    """Same contract as ``moe_compute.grouped_experts_forward``: (T, H) partial sum of this
    rank's experts, weights (E_local, 2I, H) and (E_local, H, I), ids -1 for other ranks' pairs."""
    num_tokens, top_k = local_ids.shape
    num_pairs = num_tokens * top_k
    inter = w2.shape[-1]
    sorted_ids, block_experts = align_pairs_to_blocks(local_ids, w13.shape[0])
    gate_up = torch.zeros(
        num_pairs, 2 * inter, dtype=hidden_states.dtype, device=hidden_states.device
    )  # (T*k, 2I)
    _grouped_gemm(hidden_states, w13, gate_up, sorted_ids, block_experts, num_pairs, top_k, None)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # (T*k, I)
    out = torch.zeros(
        num_pairs, w2.shape[1], dtype=hidden_states.dtype, device=hidden_states.device
    )  # (T*k, H)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, w2, out, sorted_ids, block_experts, num_pairs, 1, weights)
    return out.view(num_tokens, top_k, -1).sum(dim=1)

"""Expert computation of one MoE layer on this rank's experts.

``grouped_experts_forward`` (CPU, and GPU without Triton): the (token, expert) pairs are sorted
by expert and each active expert runs one gate/up matmul and one down matmul over its tokens
(the grouped GEMM of Megablocks, Gale et al. 2022, done as a loop of dense matmuls), then the
weighted rows are scattered back with ``index_add_``. On CUDA the Triton kernel in
``triton_fused_moe.py`` runs the same computation in one launch per projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_experts_forward(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            topk_weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts: ``sum_k w_k * W2[e_k] (silu(G[e_k] x) * U[e_k] x)`` over local experts.

    Args:
        hidden_states: (T, H).
        w13: (E_local, 2 * I, H): ``[gate | up]`` of each local expert.
        w2: (E_local, H, I).
        topk_weights: (T, k) routing weights.
        local_ids: (T, k) int64 local expert slot, or -1 for pairs another rank computes.

    Returns:
        (T, H) in ``hidden_states.dtype``: this rank's partial sum (zeros where no local pair).
    """
    num_tokens, top_k = local_ids.shape
    out = torch.zeros_like(hidden_states)
    flat = local_ids.reshape(-1)  # (T * k,)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat + 1, minlength=w13.shape[0] + 1).tolist()  # slot -1 counted first
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order]
    start = counts[0]
    inter = w2.shape[-1]
    for expert, n in enumerate(counts[1:]):
        if n == 0:
            continue
        rows = token_of[start:start + n]
        x = hidden_states[rows]  # (n, H)
        gate_up = F.linear(x, w13[expert])  # (n, 2I)
        y = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[expert])  # (n, H)
        out.index_add_(0, rows, y * weight_of[start:start + n, None].to(y.dtype))
        start += n
    return out


def experts_forward(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """Dispatch to the Triton kernel on CUDA (when Triton imports), else the grouped loop;
    same arguments and result as :func:`grouped_experts_forward`."""
    if hidden_states.is_cuda:
        try:
            from shardline_runtime.layers.moe.triton_fused_moe import fused_experts
        except ImportError:
            return grouped_experts_forward(hidden_states, w13, w2, topk_weights, local_ids)
        return fused_experts(hidden_states, w13, w2, topk_weights, local_ids)
    return grouped_experts_forward(hidden_states, w13, w2, topk_weights, local_ids)

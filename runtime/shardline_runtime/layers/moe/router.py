"""The MoE router: a replicated linear gate, softmax, top-k (Shazeer et al. 2017; Fedus et al.
2021), computed as transformers' ``Qwen3MoeTopKRouter`` / ``MixtralTopKRouter``: softmax in
float32 over all experts, top-k of the probabilities, and with ``norm_topk_prob`` the k weights
renormalised to sum to 1 (Mixtral always renormalises; Qwen-MoE as its config says)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardline_runtime.layers.parameter import set_weight_attrs


class ReplicatedLinear(nn.Module):
    """``y = x W^T`` with the full weight (out, in) on every rank (no communication)."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        set_weight_attrs(self.weight, self.weight_loader, {None: (output_size, input_size)})

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        from shardline_runtime.layers.linear import _check_shape

        _check_shape(loaded, tuple(param.shape), type(self).__name__)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each token.

    Args:
        router_logits: (T, num_experts) gate outputs.
        top_k: experts per token, in [1, num_experts].
        renormalize: divide the k probabilities by their sum (``norm_topk_prob``).
        out_dtype: dtype of the returned weights (default: ``router_logits.dtype``).

    Returns:
        ``(topk_weights (T, top_k) out_dtype, topk_ids (T, top_k) int64)``, ids are logical
        expert indices in descending probability order.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (T, E)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # (T, k)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(out_dtype or router_logits.dtype), topk_ids


class TopKRouter(nn.Module):
    """Gate of ``num_experts`` over ``hidden_size``; ``forward(x (T, hidden))`` returns
    ``(router_logits (T, E), topk_weights (T, k), topk_ids (T, k) int64)``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        set_weight_attrs(
            self.weight,
            ReplicatedLinear.weight_loader.__get__(self),
            {None: (num_experts, hidden_size)},
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits = F.linear(x, self.weight)  # (T, E)
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.norm_topk_prob)
        return router_logits, topk_weights, topk_ids

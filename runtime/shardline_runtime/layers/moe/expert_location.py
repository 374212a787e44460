"""Where each expert lives: the physical-to-logical map of one MoE layer (after SGLang's
``ExpertLocationMetadata``).

A *logical* expert is an expert of the checkpoint (``num_experts`` of them). A *physical*
expert is a weight slot on a rank: ``num_physical = num_experts + ep_num_redundant_experts``
slots, ``num_physical / ep_size`` consecutive ones per expert-parallel rank. With redundant
slots some logical experts have several replicas; a token routed to such an expert goes to
replica ``token_index % replica_count`` (deterministic, so every rank picks the same one and
the load of a hot expert is split evenly among its replicas).

The maps are buffers whose storage never moves, so an EPLB rebalance updates them in place
(and captured CUDA graphs keep reading the right ones).
"""

from __future__ import annotations

import torch


def default_physical_to_logical(num_experts: int, num_physical: int) -> torch.Tensor:
    """Physical slot ``p`` holds logical expert ``p % num_experts``: (num_physical,) int64 on the
    CPU (also while a model is built under another default device, e.g. ``meta``)."""
    return torch.arange(num_physical, dtype=torch.int64, device="cpu") % num_experts


def logical_maps(
    physical_to_logical: torch.Tensor, num_experts: int, max_replicas: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert a placement.

    Args:
        physical_to_logical: (num_physical,) int64, values in [0, num_experts).
        num_experts: logical experts.
        max_replicas: width of the returned map (``ep_num_redundant_experts + 1``).

    Returns:
        ``(logical_to_physical (num_experts, max_replicas) int64 padded with -1,
        replica_count (num_experts,) int64)``.

    Raises:
        ValueError: a logical expert has no replica or more than ``max_replicas``.
    """
    p2l = physical_to_logical.cpu().tolist()
    table: list[list[int]] = [[] for _ in range(num_experts)]
    for p, e in enumerate(p2l):
        if not 0 <= e < num_experts:
            raise ValueError(
                f"physical expert {p} maps to logical expert {e}, outside [0, {num_experts})"
            )
        table[e].append(p)
    for e, replicas in enumerate(table):
        if not 1 <= len(replicas) <= max_replicas:
            raise ValueError(
                f"logical expert {e} has {len(replicas)} replicas; allowed 1 to {max_replicas}"
            )
    l2p = torch.full((num_experts, max_replicas), -1, dtype=torch.int64)
    for e, replicas in enumerate(table):
        l2p[e, : len(replicas)] = torch.tensor(replicas)
    count = torch.tensor([len(r) for r in table], dtype=torch.int64)
    return l2p, count


def route_to_physical(
    topk_ids: torch.Tensor, logical_to_physical: torch.Tensor, replica_count: torch.Tensor
) -> torch.Tensor:
    """Logical top-k ids (T, k) -> physical ids (T, k): replica ``token_index % replica_count``."""
    tokens = torch.arange(topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)  # (T, 1)
    replica = tokens % replica_count[topk_ids]  # (T, k)
    return logical_to_physical[topk_ids, replica]


def moe_layers(model: torch.nn.Module) -> list:
    """The model's ``FusedMoE`` modules in layer order."""
    from shardline_runtime.layers.moe.fused_moe import FusedMoE

    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@torch.no_grad()
def copy_expert_placement(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Give ``target``'s MoE layers the placement of ``source``'s (before loading weights into
    ``target``, so an in-place weight update fills the slots the live model uses)."""
    for src, dst in zip(moe_layers(source), moe_layers(target)):
        dst.set_placement(src.physical_to_logical_map.cpu())

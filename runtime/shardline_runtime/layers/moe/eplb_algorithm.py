"""Expert placement that balances load over expert-parallel ranks: DeepSeek's EPLB algorithm.

Source: DeepSeek, "Expert Parallelism Load Balancer (EPLB)", https://github.com/deepseek-ai/EPLB
(``eplb.py``: ``replicate_experts``, ``balanced_packing``, ``rebalance_experts``), used by
DeepSeek-V3 (DeepSeek-AI 2024, section 3.4) and by SGLang's EPLB. This is its *global* policy
(the hierarchical policy with one expert group and one node, which DeepSeek uses when groups do
not divide the nodes): first give the heaviest experts redundant replicas, one at a time to the
expert with the highest load per replica; then pack the physical experts onto ranks, heaviest
first, each to the least loaded rank that still has a free slot, so every rank holds exactly
``num_physical / num_ranks`` experts. Written from the published description; no code copied.
"""

from __future__ import annotations

import torch


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give ``num_physical - num_logical`` redundant replicas to the most loaded experts.

    Args:
        weight: (num_layers, num_logical) load (tokens) per logical expert.
        num_physical: total slots per layer, >= num_logical.

    Returns:
        ``(physical_to_logical (num_layers, num_physical) int64, replica_count
        (num_layers, num_logical) int64)``; slots ``[0, num_logical)`` hold expert ``i``.
    """
    layers, logical = weight.shape
    if num_physical < logical:
        raise ValueError(f"num_physical {num_physical} must be >= num_logical {logical}")
    weight = weight.double()
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(layers, 1)
    count = torch.ones(layers, logical, dtype=torch.int64)
    rows = torch.arange(layers)
    for slot in range(logical, num_physical):
        hottest = (weight / count).argmax(dim=-1)  # (num_layers,)
        phy2log[:, slot] = hottest
        count[rows, hottest] += 1
    return phy2log, count


def balanced_packing(weight: torch.Tensor, num_packs: int) -> torch.Tensor:
    """Pack ``n`` weighted items into ``num_packs`` packs of ``n / num_packs`` items each,
    heaviest first into the lightest pack with room (greedy number partitioning).

    Args:
        weight: (num_layers, n) item weights; ``n % num_packs == 0``.

    Returns:
        (num_layers, n) int64 pack index of each item.
    """
    layers, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items cannot fill {num_packs} packs evenly")
    per_pack = n // num_packs
    pack_of = torch.empty(layers, n, dtype=torch.int64)
    for layer in range(layers):
        loads, sizes = [0.0] * num_packs, [0] * num_packs
        for item in torch.argsort(weight[layer].double(), descending=True, stable=True).tolist():
            pack = min((p for p in range(num_packs) if sizes[p] < per_pack), key=lambda p: loads[p])
            pack_of[layer, item] = pack
            loads[pack] += float(weight[layer, item])
            sizes[pack] += 1
    return pack_of


def rebalance_experts(weight: torch.Tensor, num_physical: int, num_ranks: int) -> torch.Tensor:
    """A balanced placement for each layer.

    Args:
        weight: (num_layers, num_logical) measured load per logical expert (any non-negative
            numbers; token counts from the expert-distribution recorder).
        num_physical: slots per layer (``num_logical + ep_num_redundant_experts``).
        num_ranks: expert-parallel ranks (``ep_size``); ``num_physical % num_ranks == 0``.

    Returns:
        (num_layers, num_physical) int64 ``physical_to_logical``: rank ``r`` holds slots
        ``[r * num_physical / num_ranks, (r + 1) * num_physical / num_ranks)``.

    Raises:
        ValueError: the slots cannot be split over the ranks or are fewer than the experts.
    """
    if num_physical % num_ranks:
        raise ValueError(f"num_physical {num_physical} is not divisible by num_ranks {num_ranks}")
    phy2log, count = replicate_experts(weight, num_physical)
    per_replica = weight.double().gather(1, phy2log) / count.gather(1, phy2log)  # (L, P)
    pack_of = balanced_packing(per_replica, num_ranks)
    per_rank = num_physical // num_ranks
    placement = torch.empty_like(phy2log)
    for layer in range(weight.shape[0]):
        filled = [0] * num_ranks
        for item in range(num_physical):
            rank = int(pack_of[layer, item])
            placement[layer, rank * per_rank + filled[rank]] = phy2log[layer, item]
            filled[rank] += 1
    return placement


def rank_imbalance(physical_counts: torch.Tensor, num_ranks: int) -> float:
    """Mean over layers with load of ``max(rank load) / mean(rank load)`` (1.0 = balanced).

    Args:
        physical_counts: (num_layers, num_physical) tokens per physical slot.
    """
    per_rank = (
        physical_counts.double().reshape(physical_counts.shape[0], num_ranks, -1).sum(-1)
    )  # (L, R)
    mean = per_rank.mean(-1)
    busy = mean > 0
    if not bool(busy.any()):
        return 1.0
    return float((per_rank.max(-1).values[busy] / mean[busy]).mean())


def expected_physical_counts(logical_load: torch.Tensor, placement: torch.Tensor) -> torch.Tensor:
    """The load each slot of ``placement`` (L, P) receives when each logical expert's load
    (L, E) is split evenly over its replicas (as ``token_index % replica_count`` does)."""
    count = torch.zeros_like(logical_load, dtype=torch.float64).scatter_add_(
        1, placement, torch.ones_like(placement, dtype=torch.float64)
    )
    return logical_load.double().gather(1, placement) / count.gather(1, placement)

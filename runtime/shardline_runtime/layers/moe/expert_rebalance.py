"""Apply a new expert placement in place: move expert weights between ranks and rewrite the
maps, all-or-nothing (DESIGN 2.4: a failed re-placement leaves the old placement serving).

Steps, every rank, every MoE layer (all ranks run the same steps in the same order, because
the placement and the old maps are the same everywhere):
  1. Validate the placement (shape, every logical expert 1..max_replicas replicas) and agree
     on it (``all_reduce_min_int``).
  2. Stage the new weights in buffers beside the live ones: a slot whose expert this rank
     already holds is copied locally; every (expert, moe_tp_rank) some rank lacks is broadcast
     by the lowest rank with that tensor-parallel slice that holds it.
  3. Agree again; any failure on any rank drops the staging buffers and keeps the old weights.
  4. Commit: copy staged weights into the live parameters (same storage, so captured CUDA
     graphs stay valid) and write the new maps into their buffers.

Peak extra memory: one copy of this rank's expert weights (the staging buffers). Quantized
experts move with their scales (every stacked ``w13_*`` / ``w2_*`` parameter).
"""

from __future__ import annotations

import logging

import torch

from shardline_runtime.distributed import (
    all_reduce_min_int,
    broadcast_tensor,
    get_expert_parallel_layout,
)
from shardline_runtime.layers.moe.expert_location import logical_maps, moe_layers
from shardline_runtime.layers.moe.expert_params import expert_param_names

logger = logging.getLogger(__name__)


class RebalanceError(ValueError):
    """The placement cannot be applied (the message names the layer and the reason)."""


def _check(layers: list, placement: torch.Tensor) -> None:
    if placement.dim() != 2 or placement.shape[0] != len(layers):
        raise RebalanceError(
            f"placement must be (num_moe_layers={len(layers)}, num_physical), got {tuple(placement.shape)}"
        )
    for i, layer in enumerate(layers):
        if placement.shape[1] != layer.num_physical_experts:
            raise RebalanceError(
                f"MoE layer {i}: placement has {placement.shape[1]} slots, the layer {layer.num_physical_experts}"
            )
        try:
            logical_maps(placement[i], layer.num_experts, layer.max_replicas)
        except ValueError as e:
            raise RebalanceError(f"MoE layer {i}: {e}") from None


def _stage_layer(layer, new: list[int], layout) -> list[torch.Tensor]:
    """Staged copies of ``layer``'s stacked expert parameters (``expert_param_names`` order:
    weights and, for quantized experts, their scales) under placement ``new``."""
    n, tp = layer.num_local_experts, layout.moe_tp_size
    old = layer.physical_to_logical_map.tolist()
    held = [
        set(old[r * n : (r + 1) * n]) for r in range(layout.ep_size)
    ]  # logical experts per EP slot
    mine = old[layer.local_start : layer.local_start + n]
    live = [getattr(layer, name) for name in expert_param_names(layer)]
    staged = [torch.empty_like(p) for p in live]
    wanted = new[layer.local_start : layer.local_start + n]
    for slot, e in enumerate(wanted):
        if e in mine:
            for dest, src in zip(staged, live):
                dest[slot].copy_(src[mine.index(e)])
    missing = sorted(
        {e for r in range(layout.ep_size) for e in new[r * n : (r + 1) * n] if e not in held[r]}
    )
    # one expert's tensors travel as one byte buffer (FP8 and packed ints included)
    sizes = [p[0].numel() * p.element_size() for p in live]
    for e in missing:
        src_ep = min(r for r in range(layout.ep_size) if e in held[r])
        for t in range(tp):  # one broadcast per tensor-parallel slice of the expert
            buf = torch.empty(sum(sizes), dtype=torch.uint8, device=live[0].device)
            if layout.ep_rank == src_ep and layout.moe_tp_rank == t:
                k = mine.index(e)
                buf.copy_(torch.cat([p[k].reshape(-1).view(torch.uint8) for p in live]))
            broadcast_tensor(buf, src=src_ep * tp + t)
            if layout.moe_tp_rank != t:
                continue
            pieces = buf.split(sizes)
            for slot, want in enumerate(wanted):
                if want == e and e not in mine:
                    for dest, piece in zip(staged, pieces):
                        dest[slot].copy_(piece.clone().view(dest.dtype).view_as(dest[slot]))
    return staged


@torch.no_grad()
def rebalance_in_place(model: torch.nn.Module, placement: torch.Tensor) -> int:
    """Move ``model``'s experts to ``placement`` on every rank (every rank must call this).

    Args:
        placement: (num_moe_layers, num_physical) int64 physical-to-logical map per MoE layer
            (e.g. from ``eplb_algorithm.rebalance_experts``); identical on every rank.

    Returns:
        Number of expert weights this rank received or copied (slots whose expert changed).

    Raises:
        RebalanceError: the placement is invalid, or staging failed on some rank; in both cases
            every rank keeps its old weights and maps.
    """
    layers = moe_layers(model)
    layout = get_expert_parallel_layout()
    reason = ""
    try:
        _check(layers, placement)
    except RebalanceError as e:
        reason = str(e)
    if all_reduce_min_int(0 if reason else 1) != 1:
        raise RebalanceError(reason or "the placement was rejected on another rank (see its log)")
    staged, reason = [], ""
    try:
        for layer, new in zip(layers, placement.tolist()):
            staged.append(_stage_layer(layer, new, layout))
    except Exception as e:  # a failed transfer must leave the live weights alone
        reason = f"{type(e).__name__}: {e}"
        logger.warning("expert rebalance staging failed: %s", reason)
    if all_reduce_min_int(0 if reason else 1) != 1:
        raise RebalanceError(
            f"staging failed; old placement kept. {reason or 'failed on another rank (see its log)'}"
        )
    moved = 0
    for layer, new, tensors in zip(layers, placement, staged):
        before = layer.local_logical_experts()
        for name, tensor in zip(expert_param_names(layer), tensors):
            getattr(layer, name).data.copy_(tensor)
        layer.set_placement(new)
        moved += sum(a != b for a, b in zip(before, layer.local_logical_experts()))
    return moved

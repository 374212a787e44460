"""Expert parallelism inside the TP group (SGLang's ``moe_ep_size`` / ``moe_tp_size`` layout).

The ``tp_size`` ranks of a group are split into ``ep_size`` expert-parallel slots of
``moe_tp_size = tp_size / ep_size`` consecutive ranks: rank ``r`` holds the experts of slot
``r // moe_tp_size`` and, of each of them, the intermediate slice ``r % moe_tp_size``.
Attention stays tensor-parallel over all ranks, so after its all-reduce every rank holds the
hidden states of every token. That makes *dispatch* local (each rank picks the (token, expert)
pairs whose expert it holds) and *combine* one sum over the whole group: each (token, expert)
pair is computed by exactly one slot, and within the slot each rank adds a partial sum over its
intermediate slice. The sum is the same all-reduce dense TP uses, so it runs on gloo and NCCL
alike (SGLang's non-DeepEP ``EPMoE`` combines the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardline_runtime.distributed.parallel_state import get_tp_group


@dataclass(frozen=True)
class ExpertParallelLayout:
    """This rank's place in the expert layout (``ep_rank`` in [0, ep_size), ``moe_tp_rank`` in
    [0, moe_tp_size)) and the number of redundant physical expert slots per MoE layer."""

    ep_size: int = 1
    ep_rank: int = 0
    moe_tp_size: int = 1
    moe_tp_rank: int = 0
    num_redundant_experts: int = 0


_EP = ExpertParallelLayout()


def init_expert_parallel(ep_size: int, num_redundant_experts: int = 0) -> ExpertParallelLayout:
    """Lay out ``ep_size`` expert slots over the TP group (call after the TP group exists).

    Raises:
        ValueError: ``ep_size`` < 1 or not a divisor of ``tp_size``, or a negative
            ``num_redundant_experts``.
    """
    global _EP
    tp = get_tp_group()
    if ep_size < 1 or tp.size % ep_size:
        raise ValueError(f"ep_size must be a divisor of tp_size {tp.size}, got {ep_size}")
    if num_redundant_experts < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant_experts}")
    moe_tp = tp.size // ep_size
    _EP = ExpertParallelLayout(
        ep_size=ep_size,
        ep_rank=tp.rank // moe_tp,
        moe_tp_size=moe_tp,
        moe_tp_rank=tp.rank % moe_tp,
        num_redundant_experts=num_redundant_experts,
    )
    return _EP


def get_expert_parallel_layout() -> ExpertParallelLayout:
    return _EP


def expert_parallel_combine(x: torch.Tensor) -> torch.Tensor:
    """Sum each rank's partial MoE output (T, hidden) over the TP group, in place; no-op at
    ``tp_size == 1``. See the module docstring for why one all-reduce combines EP and TP."""
    group = get_tp_group()
    if group.size == 1:
        return x
    dist.all_reduce(x, group=group.device_group)
    return x


def broadcast_tensor(x: torch.Tensor, src: int) -> torch.Tensor:
    """Send ``x`` from TP rank ``src`` to every rank (in place: others pass a buffer of the same
    shape and dtype). Used to move expert weights between ranks (EPLB)."""
    group = get_tp_group()
    if group.size > 1:
        dist.broadcast(x, src=group.world_rank_of(src), group=group.device_group)
    return x

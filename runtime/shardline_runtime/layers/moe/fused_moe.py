"""``FusedMoE``: the experts of one MoE layer, stacked, split by tensor and expert parallelism.

Parameters (this rank): ``w13_weight`` (E_local, 2 * I_rank, H) holds ``[gate | up]`` of each
local physical expert and ``w2_weight`` (E_local, H, I_rank) its down projection (quantized
experts: the scheme's parameters, ``expert_params.py``), with
``E_local = (num_experts + ep_num_redundant_experts) / ep_size`` and
``I_rank = moe_intermediate_size / moe_tp_size`` (layout in ``distributed/expert_parallel.py``).
Checkpoints store one tensor per expert and projection; ``weight_loader(param, loaded,
expert_id, shard_id)`` takes one (shard ``w1`` gate, ``w3`` up, ``w2`` down, SGLang's names)
and copies this rank's intermediate slice into every local slot holding that logical expert.

``forward`` maps logical top-k ids to physical slots (``expert_location.py``), reports them to
the expert-distribution recorder when one records, computes the local pairs
(``moe_compute.py``) and, unless ``reduce_results`` is False, combines over the group.
"""

from __future__ import annotations

import torch
from torch import nn

from shardline_runtime.distributed import expert_parallel_combine, get_expert_parallel_layout
from shardline_runtime.layers.linear import ShardShapeError
from shardline_runtime.layers.moe.expert_location import (
    default_physical_to_logical,
    logical_maps,
    route_to_physical,
)
from shardline_runtime.layers.moe.expert_params import (
    DEFAULT_EXPERT_NAMES,
    active_slots,
    create_expert_params,
    dequantized_experts,
    expert_methods,
    load_expert_shard,
)
from shardline_runtime.layers.moe.moe_compute import experts_forward
from shardline_runtime.layers.parameter import checkpoint_shapes_of
from shardline_runtime.layers.quantization.base import (
    QuantizationConfig,
    UnquantizedLinearMethod,
)

SHARD_IDS = ("w1", "w2", "w3")


class FusedMoE(nn.Module):
    """Experts of layer ``layer_id``.

    Args:
        num_experts: logical experts in the checkpoint.
        hidden_size, intermediate_size: H and the full per-expert I.
        layer_id: model layer index (the recorder's row).
        num_redundant_experts: extra physical slots for EPLB replicas (default: the layout's).
        reduce_results: combine over the group in ``forward`` (False: the caller does it,
            e.g. after adding a shared expert's partial sum).
        quant_config, prefix: the checkpoint's quantization and the experts' checkpoint module
            (``model.layers.3.mlp.experts``); quantized experts store the method's parameters
            (``w13_weight_scale``...) beside the weights (``expert_params.py``).
        expert_names: the checkpoint's names of one expert's gate (w1), up (w3) and down (w2)
            projections under ``<prefix>.<expert_id>``.

    Raises:
        ValueError: experts or intermediate size cannot be split over the layout.
        QuantizationError: the split would cut a quantization block or pack.
    """

    w13_weight: nn.Parameter  # unquantized and FP8 schemes (W4A16 stores w13_weight_packed)
    physical_to_logical_map: torch.Tensor
    logical_to_physical_map: torch.Tensor
    logical_replica_count: torch.Tensor

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        layer_id: int,
        num_redundant_experts: int | None = None,
        reduce_results: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        expert_names: dict[str, str] = DEFAULT_EXPERT_NAMES,
    ):
        super().__init__()
        layout = get_expert_parallel_layout()
        redundant = (
            layout.num_redundant_experts if num_redundant_experts is None else num_redundant_experts
        )
        self.num_experts, self.layer_id, self.reduce_results = num_experts, layer_id, reduce_results
        self.num_physical_experts = num_experts + redundant
        if self.num_physical_experts % layout.ep_size or intermediate_size % layout.moe_tp_size:
            raise ValueError(
                f"{self.num_physical_experts} physical experts / intermediate size {intermediate_size} "
                f"cannot be split over ep_size {layout.ep_size}, moe_tp_size {layout.moe_tp_size}"
            )
        self.max_replicas = redundant + 1
        self.num_local_experts = self.num_physical_experts // layout.ep_size
        self.local_start = layout.ep_rank * self.num_local_experts
        self.moe_tp_rank = layout.moe_tp_rank
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.intermediate_per_rank = intermediate_size // layout.moe_tp_size
        self.quant_methods = expert_methods(quant_config, prefix, num_experts, expert_names)
        create_expert_params(
            self,
            self.quant_methods,
            num_experts,
            self.num_local_experts,
            hidden_size,
            intermediate_size,
            layout.moe_tp_size,
            self.weight_loader,
        )
        self.quantized = not all(isinstance(m, UnquantizedLinearMethod) for m in self.quant_methods)
        self.register_buffer(
            "physical_to_logical_map",
            torch.zeros(self.num_physical_experts, dtype=torch.int64),
            persistent=False,
        )
        self.register_buffer(
            "logical_to_physical_map",
            torch.zeros(num_experts, self.max_replicas, dtype=torch.int64),
            persistent=False,
        )
        self.register_buffer(
            "logical_replica_count", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )
        # One rank, no redundant slots: the placement can never change the load (EPLBManager does
        # not rebalance then), so routing skips the map lookup; fixed at build time, so a
        # captured CUDA graph never takes a path that a later placement invalidates.
        self.identity_placement = layout.ep_size == 1 and redundant == 0
        self.set_placement(default_physical_to_logical(num_experts, self.num_physical_experts))
        self.recorder = None  # ExpertDistributionRecorder, attached by the ModelRunner

    @torch.no_grad()
    def set_placement(self, physical_to_logical: torch.Tensor) -> None:
        """Write a new placement (num_physical,) into the map buffers, in place (weights are
        not moved here; see ``expert_rebalance.py``).

        Raises:
            ValueError: wrong length, or an expert with no or too many replicas.
        """
        if tuple(physical_to_logical.shape) != (self.num_physical_experts,):
            raise ValueError(
                f"placement must have {self.num_physical_experts} entries, got {tuple(physical_to_logical.shape)}"
            )
        l2p, count = logical_maps(physical_to_logical, self.num_experts, self.max_replicas)
        self.physical_to_logical_map.copy_(physical_to_logical)
        self.logical_to_physical_map.copy_(l2p)
        self.logical_replica_count.copy_(count)

    def local_logical_experts(self) -> list[int]:
        """Logical expert held by each local slot, in slot order."""
        return self.physical_to_logical_map[
            self.local_start : self.local_start + self.num_local_experts
        ].tolist()

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str
    ) -> None:
        """Copy logical expert ``expert_id``'s full checkpoint tensor ``loaded`` (``w1``/``w3``:
        (I, H), ``w2``: (H, I), or the scheme's scale / packed weight of that projection) into
        each local slot that holds it, taking this rank's slice of I.

        Raises:
            ValueError: ``shard_id`` not in ``SHARD_IDS`` or ``expert_id`` out of range.
            ShardShapeError: ``loaded`` has another shape.
        """
        if shard_id not in SHARD_IDS:
            raise ValueError(f"shard_id must be one of {SHARD_IDS}, got {shard_id!r}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert_id must be in [0, {self.num_experts}), got {expert_id}")
        expected = checkpoint_shapes_of(param).get((expert_id, shard_id))
        if expected is None or tuple(loaded.shape) != tuple(expected):
            raise ShardShapeError(
                f"FusedMoE expert {expert_id} {shard_id}: checkpoint shape {tuple(loaded.shape)}, expected {expected}"
            )
        slots = [s for s, e in enumerate(self.local_logical_experts()) if e == expert_id]
        load_expert_shard(
            self, param, loaded, shard_id, slots, self.moe_tp_rank, self.intermediate_per_rank
        )

    def forward(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """(T, H), (T, k) weights, (T, k) logical ids -> (T, H), summed over the group unless
        ``reduce_results`` is False (then this rank's partial sum)."""
        if self.identity_placement:
            physical = topk_ids
        else:
            physical = route_to_physical(
                topk_ids, self.logical_to_physical_map, self.logical_replica_count
            )  # (T, k)
        if self.recorder is not None and self.recorder.active:
            self.recorder.record(self.layer_id, physical)
        if self.num_local_experts == self.num_physical_experts:
            local = physical  # every slot is on this rank
        else:
            local = physical - self.local_start
            local = torch.where(
                (local >= 0) & (local < self.num_local_experts), local, -1
            )  # dispatch: keep ours
        slots = None
        if self.quantized and not hidden_states.is_cuda:
            # CPU: dequantize only the slots this batch routes to (a decode step uses few);
            # on CUDA every slot is, to keep the step free of host syncs (CUDA graphs)
            slots, local = active_slots(local, self.num_local_experts)
        w13, w2 = dequantized_experts(
            self,
            self.quant_methods,
            self.intermediate_per_rank,
            self.hidden_size,
            hidden_states.dtype,
            slots,
        )
        out = experts_forward(hidden_states, w13, w2, topk_weights, local)
        return expert_parallel_combine(out) if self.reduce_results else out

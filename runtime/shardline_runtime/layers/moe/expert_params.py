"""The parameters of a ``FusedMoE`` layer, made from the ``LinearMethod`` of its expert
projections (``layers/quantization/``), stacked over the local expert slots.

Each method parameter ``<name>`` of the gate/up projections becomes ``w13_<name>`` and of the
down projection ``w2_<name>``, shaped ``(E_local, *per-expert shape)``. The per-expert shape and
the TP split follow the parameter's ``ShardLayout`` exactly as for a dense layer: ``w13`` is
column-parallel over the intermediate size (shards ``w1`` gate, ``w3`` up, side by side), ``w2``
is row-parallel over it (a per-channel scale, indexed by hidden rows only, is replicated; a
per-tensor scale or a ``weight_shape`` keeps one row per checkpoint tensor). Expert parallelism
picks the slots: a checkpoint tensor of logical expert ``e`` is copied into every local slot
holding ``e`` (the caller passes them), scales with their weights.

Compute reads the weights back through :func:`dequantized_experts`: the method's ``dequantize``
of the stacked parameters (a no-op for unquantized experts), so quantized experts run the
unquantized MoE path on weights in the activation dtype, as transformers' compressed-tensors
integration decompresses MoE experts (``CompressedTensorsDequantize``).
"""

from __future__ import annotations

import torch
from torch import nn

from shardline_runtime.layers.linear_params import param_shapes
from shardline_runtime.layers.parameter import (
    WeightLoader,
    mark_quantize_on_load,
    quantizes_on_load,
    set_shard_layout,
    set_weight_attrs,
    shard_layout_of,
)
from shardline_runtime.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    layer_tensor,
)
from shardline_runtime.layers.quantization.fp8_numerics import quantize_into

# checkpoint module names of one expert's gate (w1), up (w3) and down (w2) projections
DEFAULT_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def expert_methods(
    quant_config: QuantizationConfig | None,
    prefix: str,
    num_experts: int,
    expert_names: dict[str, str] = DEFAULT_EXPERT_NAMES,
) -> tuple[LinearMethod, LinearMethod]:
    """(method of ``w13``, method of ``w2``) of the experts under the checkpoint module
    ``prefix`` (``model.layers.3.mlp.experts``; expert ``e``'s gate is ``<prefix>.<e>.gate_proj``).

    Raises:
        QuantizationError: the experts' gate and up projections are quantized differently.
    """
    if quant_config is None:
        return UnquantizedLinearMethod(), UnquantizedLinearMethod()

    def names(*shards: str) -> list[str]:
        return [f"{prefix}.{e}.{expert_names[s]}" for e in range(num_experts) for s in shards]

    return quant_config.linear_method(names("w1", "w3")), quant_config.linear_method(names("w2"))


def create_expert_params(
    layer: nn.Module,
    methods: tuple[LinearMethod, LinearMethod],
    num_experts: int,
    num_local_experts: int,
    hidden_size: int,
    intermediate_size: int,
    moe_tp_size: int,
    loader: WeightLoader,
) -> None:
    """Register the ``w13_*`` and ``w2_*`` parameters of ``methods`` on ``layer``, each with
    ``loader`` (``loader(param, tensor, expert_id, shard_id)``), its ``shard_layout`` and its
    checkpoint shapes keyed ``(expert_id, "w1" | "w3" | "w2")``.

    Raises:
        QuantizationError: a moe_tp split of the intermediate size would cut a block or pack.
    """
    inter_rank = intermediate_size // moe_tp_size
    fused = (
        ("w13", methods[0], {"w1": intermediate_size, "w3": intermediate_size}, hidden_size),
        ("w2", methods[1], {"w2": hidden_size}, intermediate_size),
    )
    for name, method, shard_sizes, input_size in fused:
        method.check_partition(list(shard_sizes.values()), input_size, moe_tp_size)
        split = "input" if name == "w2" else "output"
        for spec in method.params(sum(shard_sizes.values()), input_size):
            shape, checkpoint = param_shapes(
                spec, shard_sizes, input_size, 2 * inter_rank, inter_rank, split
            )
            dtype = spec.dtype or torch.get_default_dtype()
            param = nn.Parameter(
                torch.empty((num_local_experts, *shape), dtype=dtype), requires_grad=False
            )
            per_expert = {(e, s): shp for e in range(num_experts) for s, shp in checkpoint.items()}
            set_weight_attrs(param, loader, per_expert)
            set_shard_layout(param, spec.layout)
            if spec.online:
                mark_quantize_on_load(param)
            layer.register_parameter(f"{name}_{spec.name}", param)


def load_expert_shard(
    layer: nn.Module,
    param: nn.Parameter,
    loaded: torch.Tensor,
    shard_id: str,
    slots: list[int],
    moe_tp_rank: int,
    inter_rank: int,
) -> None:
    """Copy this rank's slice of one expert's checkpoint tensor ``loaded`` (already checked
    against its checkpoint shape) into ``param[slot]`` for each of ``slots``; an online FP8
    weight is quantized per output row on the way and its ``*_weight_scale`` rows written."""
    layout = shard_layout_of(param)
    fused = "w2" if shard_id == "w2" else "w13"
    rows, offset, dim = 0, 0, 0  # rows of the w13 slice, its offset in the slot, its dim
    if layout.per_shard:
        piece = loaded
    elif fused == "w2":
        if layout.input_dim is None:  # a per-channel scale of the down projection: replicated
            piece = loaded
        else:
            width = inter_rank // layout.input_block
            piece = loaded.narrow(layout.input_dim, moe_tp_rank * width, width)
    else:
        dim, rows = layout.output_dim, inter_rank // layout.output_block
        piece = loaded.narrow(dim, moe_tp_rank * rows, rows)
        offset = 0 if shard_id == "w1" else rows
    for slot in slots:
        if layout.per_shard:
            dest = param.data[slot][1 if shard_id == "w3" else 0]
        elif fused == "w2":
            dest = param.data[slot]
        else:
            dest = param.data[slot].narrow(dim, offset, rows)
        if quantizes_on_load(param):
            scale = layer_tensor(layer, f"{fused}_weight_scale").data[slot]
            quantize_into(piece, dest, scale if fused == "w2" else scale.narrow(0, offset, rows))
        else:
            dest.copy_(piece)


def expert_param_names(layer: nn.Module) -> list[str]:
    """Names of ``layer``'s stacked expert parameters (``w13_weight``, ``w13_weight_scale``...),
    each indexed by local slot on dim 0."""
    return [name for name, _ in layer.named_parameters() if name.startswith(("w13_", "w2_"))]


def active_slots(local_ids: torch.Tensor, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the local slots ``local_ids (T, k)`` route to, sorted (n,), the ids renumbered into
    them, -1 kept); reads the ids on the host."""
    slots = torch.unique(local_ids[local_ids >= 0])
    renumber = torch.full((num_local,), -1, dtype=local_ids.dtype, device=local_ids.device)
    renumber[slots] = torch.arange(slots.numel(), dtype=local_ids.dtype, device=local_ids.device)
    return slots, torch.where(local_ids >= 0, renumber[local_ids.clamp(min=0)], -1)


def dequantized_experts(
    layer: nn.Module,
    methods: tuple[LinearMethod, LinearMethod],
    inter_rank: int,
    hidden_size: int,
    dtype: torch.dtype,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 (E, 2 inter_rank, hidden_size)`` and ``w2 (E, hidden_size, inter_rank)`` in
    ``dtype`` of the local ``slots`` (default: every local slot; the stored tensors themselves
    when unquantized in ``dtype``)."""

    def stacked(name: str) -> torch.Tensor:
        tensor = layer_tensor(layer, name)
        return tensor if slots is None else tensor[slots]

    w13 = methods[0].dequantize(lambda name: stacked(f"w13_{name}"), inter_rank, dtype)
    w2 = methods[1].dequantize(lambda name: stacked(f"w2_{name}"), hidden_size, dtype)
    return w13, w2

"""The parameters of a tensor-parallel linear layer, made from its ``LinearMethod``'s
``QuantParam`` records (``layers/quantization/base.py``): each gets this rank's shape, the
layer's ``weight_loader``, its ``ShardLayout`` and its ``checkpoint_shapes``."""

from __future__ import annotations

import torch
from torch import nn

from shardline_runtime.layers.parameter import (
    WeightLoader,
    mark_quantize_on_load,
    set_shard_layout,
    set_weight_attrs,
)
from shardline_runtime.layers.quantization.base import BIAS_LAYOUT, LinearMethod, QuantParam


def create_params(
    layer: nn.Module,
    method: LinearMethod,
    shard_sizes: dict,
    input_size: int,
    local_out: int,
    local_in: int,
    bias: bool,
    split_dim: str,
    loader: WeightLoader,
) -> None:
    """Register ``method``'s parameters (and the bias) on ``layer``, each with the layer's
    ``weight_loader``, its ``shard_layout`` and its ``checkpoint_shapes`` (shard id -> the full
    shape of the checkpoint tensor ``weight_loader(param, tensor[, shard_id])`` takes, read by
    ``models/weight_loading.py: checkpoint_shapes``).

    ``shard_sizes`` maps each shard id (None for an unfused tensor) to its full output
    features; ``local_out`` / ``local_in`` are this rank's output / input features;
    ``split_dim`` is ``"output"`` (column-parallel) or ``"input"`` (row-parallel);
    ``loader`` is the layer's ``weight_loader``.
    """
    specs = method.params(sum(shard_sizes.values()), input_size)
    if bias:
        specs.append(QuantParam("bias", None, BIAS_LAYOUT, lambda o, i: (o,)))
    for spec in specs:
        shape, checkpoint = param_shapes(
            spec, shard_sizes, input_size, local_out, local_in, split_dim
        )
        dtype = spec.dtype or torch.get_default_dtype()
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        set_weight_attrs(param, loader, checkpoint)
        set_shard_layout(param, spec.layout)
        if spec.online:
            mark_quantize_on_load(param)
        layer.register_parameter(spec.name, param)
    if not bias:
        layer.register_parameter("bias", None)


def param_shapes(
    spec: QuantParam,
    shard_sizes: dict,
    input_size: int,
    local_out: int,
    local_in: int,
    split_dim: str,
) -> tuple[tuple[int, ...], dict]:
    """(this rank's shape of ``spec``'s parameter, its checkpoint shapes: shard id -> full
    shape), arguments as for :func:`create_params` (a parameter without a checkpoint tensor
    has no checkpoint shapes)."""
    layout = spec.layout
    checkpoint = {s: tuple(spec.checkpoint_shape(n, input_size)) for s, n in shard_sizes.items()}
    if layout.per_shard:
        shape = (len(shard_sizes),) + next(iter(checkpoint.values()))
    else:
        shape = tuple(spec.checkpoint_shape(sum(shard_sizes.values()), input_size))
        if layout.output_dim is not None and split_dim == "output":
            shape = _with(shape, layout.output_dim, local_out // layout.output_block)
        if layout.input_dim is not None and split_dim == "input":
            shape = _with(shape, layout.input_dim, local_in // layout.input_block)
    return shape, (checkpoint if spec.in_checkpoint else {})


def _with(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return shape[:dim] + (size,) + shape[dim + 1 :]

"""How a parameter is filled from a checkpoint, declared by the layer that owns it (after vLLM's
``set_weight_attrs``): its ``weight_loader`` (cuts this rank's shard out of a full checkpoint
tensor) and its ``checkpoint_shapes`` (shard id -> full shape of each checkpoint tensor the
loader takes; the shard id is None for an unfused tensor, ``"q"``/``"k"``/``"v"`` or an index
for fused projections, ``(expert_id, "w1"|"w2"|"w3")`` for experts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import torch
from torch import nn

HIGH_PRECISION = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

ShardId: TypeAlias = Any  # None | int | str | tuple[int, str]
WeightLoader: TypeAlias = Callable[..., None]


def set_weight_attrs(
    param: nn.Parameter,
    weight_loader: WeightLoader,
    checkpoint_shapes: dict[ShardId, tuple[int, ...]],
) -> nn.Parameter:
    """Attach the loader and the checkpoint shapes to ``param``; returns ``param``."""
    param.weight_loader = weight_loader  # type: ignore[attr-defined]  # torch allows attributes on tensors
    param.checkpoint_shapes = checkpoint_shapes  # type: ignore[attr-defined]
    return param


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The loader set by :func:`set_weight_attrs`.

    Raises:
        AttributeError: the parameter's layer declares none.
    """
    loader: WeightLoader = param.weight_loader  # type: ignore[attr-defined]
    return loader


def checkpoint_shapes_of(param: nn.Parameter) -> dict[ShardId, tuple[int, ...]]:
    """The checkpoint shapes set by :func:`set_weight_attrs`.

    Raises:
        AttributeError: the parameter's layer declares none.
    """
    shapes: dict[ShardId, tuple[int, ...]] = param.checkpoint_shapes  # type: ignore[attr-defined]
    return shapes


def set_shard_layout(param: nn.Parameter, layout: Any) -> nn.Parameter:
    """Attach how ``param`` is split over TP ranks (``layers/quantization/base.py:
    ShardLayout``); returns ``param``."""
    param.shard_layout = layout  # type: ignore[attr-defined]
    return param


def shard_layout_of(param: nn.Parameter) -> Any:
    """The layout set by :func:`set_shard_layout`.

    Raises:
        AttributeError: the parameter's layer declares none.
    """
    return param.shard_layout  # type: ignore[attr-defined]


def mark_quantize_on_load(param: nn.Parameter) -> nn.Parameter:
    """``param`` (online FP8) takes high-precision tensors and quantizes them as they load."""
    param.quantize_on_load = True  # type: ignore[attr-defined]
    return param


def quantizes_on_load(param: nn.Parameter) -> bool:
    """Whether :func:`mark_quantize_on_load` marked ``param``."""
    return bool(getattr(param, "quantize_on_load", False))


def loadable_dtype_problem(param: nn.Parameter, loaded: torch.dtype) -> str | None:
    """Why a checkpoint tensor of dtype ``loaded`` cannot fill ``param`` (None: it can).

    A parameter in a high-precision float dtype takes any of them (converted on copy); a
    quantized one (FP8, packed integers, integer shapes) takes only its own dtype, since a
    plain cast would drop the scale; an online FP8 weight takes high-precision tensors only.
    """
    if param.dtype in HIGH_PRECISION or quantizes_on_load(param):
        if loaded in HIGH_PRECISION:
            return None
        return f"dtype {loaded}; a floating-point dtype ({', '.join(map(str, HIGH_PRECISION))}) is expected"
    if loaded == param.dtype:
        return None
    return f"dtype {loaded}; the quantized parameter stores {param.dtype}"

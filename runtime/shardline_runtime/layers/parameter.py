"""How a parameter is filled from a checkpoint, declared by the layer that owns it (after vLLM's
``set_weight_attrs``): its ``weight_loader`` (cuts this rank's shard out of a full checkpoint
tensor) and its ``checkpoint_shapes`` (shard id -> full shape of each checkpoint tensor the
loader takes; the shard id is None for an unfused tensor, ``"q"``/``"k"``/``"v"`` or an index
for fused projections, ``(expert_id, "w1"|"w2"|"w3")`` for experts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from torch import nn

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

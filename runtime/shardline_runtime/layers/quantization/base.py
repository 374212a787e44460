"""The quantization contract of the linear layers (after vLLM's ``LinearMethodBase`` and
SGLang's ``QuantizationConfig``).

A ``QuantizationConfig`` is read from a checkpoint's ``quantization_config`` (or asked for with
``--quantization``) and hands each linear layer a ``LinearMethod``. The method decides the
layer's parameter set (``weight``, its scales, packed weights) through :class:`QuantParam`
records, and computes ``y = x W^T + b`` from them. The layer creates the parameters and owns
their ``weight_loader``: every parameter is cut into TP shards by the same rules as the weight,
read off its :class:`ShardLayout` (which dims follow the output and input features, and how many
features one stored element covers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def layer_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` of ``layer`` (a method reads its parameters so)."""
    value = getattr(layer, name)
    assert isinstance(value, torch.Tensor), f"{type(layer).__name__}.{name} is not a tensor"
    return value


class QuantizationError(ValueError):
    """A checkpoint's ``quantization_config`` (or ``--quantization``) cannot be served; the
    message names the field, the value found and what is supported."""


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter follows the layer's output and input features.

    Attributes:
        output_dim: dim indexed by output features (None: not split by output features).
        input_dim: dim indexed by input features (None: not split by input features).
        output_block: output features one stored element covers along ``output_dim`` (a block
            scale's block height).
        input_block: input features one stored element covers along ``input_dim`` (8 for int4
            packed in int32, the group size of a group scale, a block scale's width).
        per_shard: one value per checkpoint tensor (a per-tensor scale, ``weight_shape``): the
            parameter is ``(num_shards, *checkpoint_shape)`` and shard ``i`` lands in row ``i``.
    """

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_block: int = 1
    input_block: int = 1
    per_shard: bool = False


WEIGHT_LAYOUT = ShardLayout()
PER_SHARD = ShardLayout(output_dim=None, input_dim=None, per_shard=True)
BIAS_LAYOUT = ShardLayout(output_dim=0, input_dim=None)


@dataclass(frozen=True)
class QuantParam:
    """One parameter a method asks its layer for.

    Attributes:
        name: attribute and checkpoint suffix (``weight``, ``weight_scale``, ``input_scale``...).
        dtype: storage dtype (``None``: the model's dtype).
        layout: how it is split over TP ranks.
        checkpoint_shape: ``(out, in) -> full checkpoint shape`` of one shard's tensor, given the
            shard's full output features and the layer's full input features.
        in_checkpoint: False for a parameter without a checkpoint tensor (an online FP8 scale,
            written by the weight's loader).
        online: the loader takes a high-precision tensor and quantizes it (online FP8), writing
            the layer's ``weight_scale`` with it.
    """

    name: str
    dtype: torch.dtype | None
    layout: ShardLayout
    checkpoint_shape: Any  # Callable[[int, int], tuple[int, ...]]
    in_checkpoint: bool = True
    online: bool = False


class LinearMethod(ABC):
    """How one linear layer stores and applies its weight.

    ``params(...)`` lists the parameters; ``apply(layer, x, bias)`` computes
    ``x (T, in_per_rank) -> (T, out_per_rank)`` reading them as ``layer.<name>``.
    """

    @property
    def scheme(self) -> str:
        """The scheme's short name (``unquantized``, ``fp8-w8a8-dynamic-channel``...)."""
        return "unquantized"

    @abstractmethod
    def params(self, output_size: int, input_size: int) -> list[QuantParam]:
        """The parameters of a layer whose (full) weight is ``(output_size, input_size)``."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x (T, in_per_rank)`` -> ``(T, out_per_rank)`` in ``x.dtype``."""

    def check_partition(self, output_sizes: list[int], input_size: int, tp_size: int) -> None:
        """Raise :class:`QuantizationError` when a shard boundary would cut a block or a pack
        (schemes without blocks or packs never do)."""
        return None

    @abstractmethod
    def dequantize(
        self, tensor: Callable[[str], torch.Tensor], shard_rows: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The weight ``(..., N, K)`` in ``dtype`` from this method's parameters, read as
        ``tensor(name)`` (leading dims: stacked experts); ``shard_rows`` is the rows of each
        fused checkpoint tensor (one per-tensor scale covers that many rows)."""


@dataclass(frozen=True)
class UnquantizedLinearMethod(LinearMethod):
    """A plain ``weight`` in the model's dtype."""

    def params(self, output_size: int, input_size: int) -> list[QuantParam]:
        return [QuantParam("weight", None, WEIGHT_LAYOUT, lambda o, i: (o, i))]

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        from shardline_runtime.layers.linear import linear

        return linear(x, layer_tensor(layer, "weight"), bias)

    def dequantize(
        self, tensor: Callable[[str], torch.Tensor], shard_rows: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return tensor("weight").to(dtype)


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme, as the runtime serves it.

    Subclasses are frozen dataclasses, so two configs are equal when they describe the same
    scheme (a weight update to another revision of the same scheme passes ``MUST_MATCH_FIELDS``;
    a change of scheme does not).
    """

    @property
    @abstractmethod
    def scheme(self) -> str:
        """A short name reported by ``/get_server_info`` and the digest (``fp8-w8a8-channel``)."""

    @abstractmethod
    def linear_method(self, prefixes: list[str]) -> LinearMethod:
        """The method of a linear layer loading the checkpoint modules ``prefixes`` (one per
        fused shard, e.g. ``model.layers.0.self_attn.q_proj``).

        Raises:
            QuantizationError: the fused modules are quantized differently.
        """

"""Online FP8 (``--quantization fp8``): a bf16 (or float32) checkpoint is quantized to FP8 E4M3
per output channel as each tensor is loaded, at start and at every weight update (from disk,
from tensors, from a trainer's group): the ``weight`` parameter's loader takes a high-precision
tensor, cuts this rank's shard, and writes its FP8 values and the shard rows' scales
(``amax / 448`` of each row of the shard) into ``weight`` and ``weight_scale``.

The scale has no checkpoint tensor of its own (its ``checkpoint_shapes`` is empty). A
row-parallel layer's scale covers this rank's columns of each row. Compute is the per-channel,
dynamic per-token FP8 W8A8 method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardline_runtime.layers.quantization.base import (
    WEIGHT_LAYOUT,
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    QuantParam,
    ShardLayout,
)
from shardline_runtime.layers.quantization.fp8_linear import ACTIVATION_DYNAMIC, Fp8LinearMethod
from shardline_runtime.layers.quantization.fp8_numerics import FP8_DTYPE

ONLINE_CHOICES = ("auto", "fp8")  # --quantization


@dataclass(frozen=True)
class OnlineFp8LinearMethod(Fp8LinearMethod):
    """:class:`Fp8LinearMethod` (per channel, dynamic activations) whose ``weight`` is loaded
    from a high-precision checkpoint tensor (``quantize_on_load``) and whose ``weight_scale``
    is written by that loader, not read from the checkpoint."""

    per_channel: bool = True
    activation: str = ACTIVATION_DYNAMIC

    @property
    def scheme(self) -> str:
        return "fp8-online-channel"

    def params(self, output_size: int, input_size: int) -> list[QuantParam]:
        return [
            QuantParam("weight", FP8_DTYPE, WEIGHT_LAYOUT, lambda o, i: (o, i), online=True),
            QuantParam(
                "weight_scale",
                torch.float32,
                ShardLayout(output_dim=0, input_dim=None),
                lambda o, i: (o, 1),
                in_checkpoint=False,
            ),
        ]


@dataclass(frozen=True)
class OnlineFp8Config(QuantizationConfig):
    """Every linear layer in online FP8 (the LM head and embedding stay in the model dtype)."""

    @property
    def scheme(self) -> str:
        return "fp8-online-channel"

    def linear_method(self, prefixes: list[str]) -> LinearMethod:
        return OnlineFp8LinearMethod()


def requested_quantization(
    requested: str, from_checkpoint: QuantizationConfig | None, source: str
) -> QuantizationConfig | None:
    """The scheme to serve for ``--quantization`` ``requested`` (``auto``: the checkpoint's).

    Raises:
        QuantizationError: an unknown choice, or ``fp8`` on an already quantized checkpoint.
    """
    if requested not in ONLINE_CHOICES:
        raise QuantizationError(
            f"--quantization {requested!r} is not supported; supported: {', '.join(ONLINE_CHOICES)}"
        )
    if requested == "auto":
        return from_checkpoint
    if from_checkpoint is not None:
        raise QuantizationError(
            f"{source}: --quantization fp8 quantizes a bf16 checkpoint at load, but this "
            f"checkpoint is already quantized ({from_checkpoint.scheme}); use --quantization auto"
        )
    return OnlineFp8Config()


def requested_by(served: QuantizationConfig | None) -> str:
    """The ``--quantization`` value a server serving ``served`` was started with (a weight
    update reads the new checkpoint the same way)."""
    return "fp8" if isinstance(served, OnlineFp8Config) else "auto"

"""W4A16: 4-bit integer weights with one scale per group of input features, activations in the
model dtype (compressed-tensors ``pack-quantized``, symmetric, ``strategy: group``).

Storage, as compressed-tensors writes it (``compressors/pack_quantized``): ``weight_packed``
(N, K / 8) int32, eight 4-bit values per word along the input features, value ``i`` of a word
at bits ``4 i .. 4 i + 3`` offset by +8; ``weight_scale`` (N, K / group_size); ``weight_shape``
(2,) int64, the unpacked (N, K). Dequantized ``w = (q - 8) * scale``. Compute: a Triton kernel
on CUDA (``w4a16_kernel.py``), dequantize-then-matmul elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardline_runtime.layers.quantization.base import (
    PER_SHARD,
    LinearMethod,
    QuantizationError,
    QuantParam,
    ShardLayout,
    layer_tensor,
)

PACK_FACTOR = 8  # 4-bit values per int32


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``packed (..., N, K / 8)`` int32 -> (..., N, K) int32 values in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # (..., N, K / 8, 8)
    return nibbles.flatten(start_dim=-2) - 8


def dequantize_w4(
    packed: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``packed (..., N, K / 8)`` int32, ``scale (..., N, K / group_size)`` -> weight
    (..., N, K) ``dtype`` (the product taken in ``scale``'s dtype, as compressed-tensors does;
    leading dims: stacked experts)."""
    q = unpack_int4(packed).to(scale.dtype)
    return (q * scale.repeat_interleave(group_size, dim=-1)).to(dtype)


@dataclass(frozen=True)
class W4A16LinearMethod(LinearMethod):
    """4-bit symmetric weights with group scales (``group_size`` input features per scale)."""

    group_size: int

    @property
    def scheme(self) -> str:
        return f"w4a16-g{self.group_size}"

    def params(self, output_size: int, input_size: int) -> list[QuantParam]:
        g = self.group_size
        return [
            QuantParam(
                "weight_packed",
                torch.int32,
                ShardLayout(output_dim=0, input_dim=1, input_block=PACK_FACTOR),
                lambda o, i: (o, i // PACK_FACTOR),
            ),
            QuantParam(
                "weight_scale",
                None,
                ShardLayout(output_dim=0, input_dim=1, input_block=g),
                lambda o, i: (o, i // g),
            ),
            QuantParam("weight_shape", torch.int64, PER_SHARD, lambda o, i: (2,)),
        ]

    def check_partition(self, output_sizes: list[int], input_size: int, tp_size: int) -> None:
        per_rank = input_size // tp_size
        if input_size % self.group_size or per_rank % self.group_size or per_rank % PACK_FACTOR:
            raise QuantizationError(
                f"quantization_config group_size {self.group_size}: input features "
                f"{input_size} over tp_size {tp_size} cut a group or a packed int32"
            )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.is_cuda:
            from shardline_runtime.layers.quantization.w4a16_kernel import w4a16_matmul

            out = w4a16_matmul(
                x,
                layer_tensor(layer, "weight_packed"),
                layer_tensor(layer, "weight_scale"),
                self.group_size,
            )
            return out if bias is None else out + bias
        w = dequantize_w4(
            layer_tensor(layer, "weight_packed"),
            layer_tensor(layer, "weight_scale"),
            self.group_size,
            x.dtype,
        )
        return torch.nn.functional.linear(x, w, bias)

    def dequantize(
        self, tensor: Callable[[str], torch.Tensor], shard_rows: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return dequantize_w4(
            tensor("weight_packed"), tensor("weight_scale"), self.group_size, dtype
        )

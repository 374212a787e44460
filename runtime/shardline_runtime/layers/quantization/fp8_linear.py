"""FP8 W8A8 linear methods: per-tensor or per-channel weight scales with dynamic per-token or
static per-tensor activation scales (compressed-tensors ``float-quantized``, and the online FP8
of ``--quantization fp8``), and block-wise weight scales with dynamic per-token-group
activations (DeepSeek-V3 / Qwen3-FP8 ``weight_block_size``).

Compute: on CUDA, ``torch._scaled_mm`` (per-tensor, or row-wise scales) for the per-tensor and
per-channel schemes and a Triton kernel (``fp8_block_kernel.py``) for block scales; elsewhere,
dequantize-then-matmul with the activations quantized and dequantized the same way, so the
CPU numerics equal the reference (compressed-tensors' fake quantization in transformers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardline_runtime.layers.quantization.base import (
    PER_SHARD,
    WEIGHT_LAYOUT,
    LinearMethod,
    QuantizationError,
    QuantParam,
    ShardLayout,
    layer_tensor,
)
from shardline_runtime.layers.quantization.fp8_numerics import (
    FP8_DTYPE,
    dequantize_blocks,
    fake_quantize_fp8,
    per_group_scale,
    per_token_scale,
    quantize_fp8,
)

# Which activation scale a W8A8 scheme uses.
ACTIVATION_DYNAMIC = "dynamic"  # per token, computed each step
ACTIVATION_STATIC = "static"  # one calibrated ``input_scale`` per tensor
ACTIVATION_NONE = "none"  # weight-only (W8A16): activations stay in the model dtype


def _rowwise_scale(layer: nn.Module, per_channel: bool) -> torch.Tensor:
    """The weight scale of each output row of this rank: (N, 1) float32 (a per-tensor scale,
    (num_shards, 1), repeated over its fused shard's rows)."""
    return (
        layer_tensor(layer, "weight_scale")
        if per_channel
        else layer_tensor(layer, "weight_scale")[layer_tensor(layer, "shard_of_row")]
    )


@dataclass(frozen=True)
class Fp8LinearMethod(LinearMethod):
    """FP8 E4M3 weights with a per-tensor (``per_channel=False``) or per-channel scale.

    Parameters: ``weight`` (N, K) float8_e4m3fn; ``weight_scale`` (N, 1) float32 per channel or
    (num_shards, 1) per tensor (one per fused checkpoint tensor); with static activations
    ``input_scale`` (num_shards, 1) float32 (the largest of the fused tensors' is used).
    """

    per_channel: bool
    activation: str

    @property
    def scheme(self) -> str:
        weights = "channel" if self.per_channel else "tensor"
        acts = "a16" if self.activation == ACTIVATION_NONE else f"a8-{self.activation}"
        return f"fp8-w8{acts}-{weights}"

    def params(self, output_size: int, input_size: int) -> list[QuantParam]:
        params = [QuantParam("weight", FP8_DTYPE, WEIGHT_LAYOUT, lambda o, i: (o, i))]
        if self.per_channel:
            layout = ShardLayout(output_dim=0, input_dim=None)
            params.append(QuantParam("weight_scale", torch.float32, layout, lambda o, i: (o, 1)))
        else:
            params.append(QuantParam("weight_scale", torch.float32, PER_SHARD, lambda o, i: (1,)))
        if self.activation == ACTIVATION_STATIC:
            params.append(QuantParam("input_scale", torch.float32, PER_SHARD, lambda o, i: (1,)))
        return params

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        w_scale = _rowwise_scale(layer, self.per_channel)  # (N, 1)
        if self.activation == ACTIVATION_NONE:
            w = (layer_tensor(layer, "weight").float() * w_scale).to(x.dtype)
            return torch.nn.functional.linear(x, w, bias)
        if self.activation == ACTIVATION_STATIC:
            x_scale = layer_tensor(layer, "input_scale").max().reshape(1, 1)
        else:
            x_scale = per_token_scale(x)  # (T, 1)
        if _scaled_mm_fits(x, layer_tensor(layer, "weight")):
            return _scaled_mm(x, x_scale, layer_tensor(layer, "weight"), w_scale, bias)
        w = (layer_tensor(layer, "weight").float() * w_scale).to(x.dtype)
        return torch.nn.functional.linear(fake_quantize_fp8(x, x_scale), w, bias)

    def dequantize(
        self, tensor: Callable[[str], torch.Tensor], shard_rows: int, dtype: torch.dtype
    ) -> torch.Tensor:
        scale = tensor("weight_scale")  # (..., N, 1) per channel, (..., num_shards, 1) per tensor
        if not self.per_channel:
            scale = scale.repeat_interleave(shard_rows, dim=-2)
        return (tensor("weight").float() * scale.float()).to(dtype)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.is_cuda and x.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def _scaled_mm(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``torch._scaled_mm`` with row-wise scales: x_scale (T, 1), w_scale (N, 1) float32."""
    t = x.shape[0]
    x_q = quantize_fp8(x, x_scale)
    scale_a = x_scale.expand(t, 1).contiguous()
    scale_b = w_scale.reshape(1, -1).contiguous()
    out = torch._scaled_mm(
        x_q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16
    )
    out = out.to(x.dtype)
    return out if bias is None else out + bias


@dataclass(frozen=True)
class Fp8BlockLinearMethod(LinearMethod):
    """FP8 E4M3 weights with one scale per ``block`` (block_n output x block_k input features)
    and activations quantized per token and group of ``block_k`` input features.

    Parameters: ``weight`` (N, K) float8_e4m3fn; ``<scale_name>`` (N / block_n, K / block_k)
    float32 (``weight_scale`` in compressed-tensors, ``weight_scale_inv`` in DeepSeek-V3 and
    Qwen3-FP8 checkpoints; both multiply the stored value).
    """

    block: tuple[int, int]
    scale_name: str = "weight_scale"

    @property
    def scheme(self) -> str:
        return f"fp8-block-{self.block[0]}x{self.block[1]}"

    def params(self, output_size: int, input_size: int) -> list[QuantParam]:
        bn, bk = self.block
        layout = ShardLayout(output_dim=0, input_dim=1, output_block=bn, input_block=bk)
        return [
            QuantParam("weight", FP8_DTYPE, WEIGHT_LAYOUT, lambda o, i: (o, i)),
            QuantParam(
                self.scale_name, torch.float32, layout, lambda o, i: (-(-o // bn), -(-i // bk))
            ),
        ]

    def check_partition(self, output_sizes: list[int], input_size: int, tp_size: int) -> None:
        bn, bk = self.block
        for size in output_sizes:
            if size % bn or (size // tp_size) % bn:
                raise QuantizationError(
                    f"quantization_config.weight_block_size {list(self.block)}: output features "
                    f"{size} over tp_size {tp_size} cut a {bn}-row block"
                )
        if input_size % bk or (input_size // tp_size) % bk:
            raise QuantizationError(
                f"quantization_config.weight_block_size {list(self.block)}: input features "
                f"{input_size} over tp_size {tp_size} cut a {bk}-column block"
            )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        w_scale = layer_tensor(layer, self.scale_name)
        x_scale = per_group_scale(x, self.block[1])  # (T, K / block_k)
        if x.is_cuda:
            from shardline_runtime.layers.quantization.fp8_block_kernel import fp8_block_matmul

            x_q = quantize_fp8(x, x_scale.repeat_interleave(self.block[1], dim=1))
            out = fp8_block_matmul(
                x_q, x_scale, layer_tensor(layer, "weight"), w_scale, self.block, x.dtype
            )
            return out if bias is None else out + bias
        x_dq = fake_quantize_fp8(x, x_scale.repeat_interleave(self.block[1], dim=1))
        w = dequantize_blocks(layer_tensor(layer, "weight"), w_scale, self.block, x.dtype)
        return torch.nn.functional.linear(x_dq, w, bias)

    def dequantize(
        self, tensor: Callable[[str], torch.Tensor], shard_rows: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return dequantize_blocks(tensor("weight"), tensor(self.scale_name), self.block, dtype)

"""FP8 (E4M3) quantization arithmetic shared by the FP8 methods, in the numerics of
compressed-tensors' ``calculate_qparams`` / ``fake_quantize`` (symmetric, ``scale = amax /
448``, a zero scale replaced by the dtype's eps, round by casting to ``float8_e4m3fn`` after a
clamp to +-448), so the CPU path equals transformers loading the same checkpoint.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` with zeros replaced by eps (float32, shape of ``amax``)."""
    scale = amax.float() / FP8_MAX
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` clamped to +-448 and cast to ``float8_e4m3fn`` (``scale`` broadcasts)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize then dequantize: ``quantize_fp8(x, scale) * scale`` in ``x.dtype``."""
    return (quantize_fp8(x, scale).float() * scale).to(x.dtype)


def per_token_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token scale of ``x (T, K)``: (T, 1) float32."""
    return amax_scale(x.abs().amax(dim=-1, keepdim=True))


def per_group_scale(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic per-token-group scale of ``x (T, K)`` over groups of ``group_size`` input
    features: (T, K / group_size) float32 (DeepSeek-V3's activation scheme)."""
    return amax_scale(x.unflatten(-1, (-1, group_size)).abs().amax(dim=-1))


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online FP8: ``weight (N, K)`` -> (fp8 (N, K), scale (N, 1) float32), one scale per
    output channel (``amax`` of the row / 448)."""
    scale = amax_scale(weight.abs().amax(dim=1, keepdim=True))
    return quantize_fp8(weight, scale), scale


def quantize_into(weight: torch.Tensor, dest: torch.Tensor, dest_scale: torch.Tensor) -> None:
    """Online FP8: write :func:`quantize_weight_per_channel` of ``weight (N, K)`` into ``dest``
    (N, K) fp8 and ``dest_scale`` (N, 1) float32."""
    quantized, scale = quantize_weight_per_channel(weight)
    dest.copy_(quantized)
    dest_scale.copy_(scale)


def dequantize_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``weight (..., N, K)`` fp8 with one scale per ``block`` (``scale`` (..., ceil(N/bn),
    ceil(K/bk))) -> (..., N, K) in ``dtype`` (leading dims: stacked experts)."""
    bn, bk = block
    n, k = weight.shape[-2:]
    rows = scale.repeat_interleave(bn, dim=-2)[..., :n, :]
    full = rows.repeat_interleave(bk, dim=-1)[..., :k]
    return (weight.float() * full.float()).to(dtype)

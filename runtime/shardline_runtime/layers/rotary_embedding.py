"""Rotary position embedding (Su et al. 2021, RoFormer) with the RoPE scaling types of
transformers' ``modeling_rope_utils``: ``default``, ``linear`` (position interpolation),
``dynamic`` (dynamic NTK), ``llama3`` (Llama 3.1 frequency smoothing) and ``yarn``
(Peng et al. 2023). Inverse frequencies are computed with the same float32 operations as
transformers so logits match it; the rotation is transformers' non-interleaved "rotate half".

``dynamic`` depends on the longest position of the step (transformers recomputes it per
forward from ``max(position_ids) + 1``); every other type is a static cos/sin table indexed by
position, which CUDA graphs can replay.

One table per model: :func:`get_rope` hands every attention layer of a model the same
:class:`RotaryEmbedding` module (as nano-vllm's and mini-sglang's ``get_rope`` do), so a model
holds one (max_positions, head_dim) cos/sin pair, not one per layer (at 131,072 positions and
head_dim 128 that pair is 128 MiB).
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch
from torch import nn


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(p: dict[str, Any], dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context_len = p["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(p: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    base, factor = p["rope_theta"], p["factor"]
    original = p["original_max_position_embeddings"]

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor
    return inv_freq, float(attention_factor)


def compute_inv_freq(rope_parameters: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """Static ``(inv_freq (head_dim/2,) float32, attention_scaling)`` of a normalised RoPE config.

    ``dynamic`` returns its short-sequence (unscaled) frequencies.

    Raises:
        ValueError: unknown ``rope_type``.
    """
    rope_type = rope_parameters["rope_type"]
    if rope_type in ("default", "dynamic"):
        return _base_inv_freq(rope_parameters["rope_theta"], head_dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(rope_parameters["rope_theta"], head_dim) / rope_parameters[
            "factor"
        ], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(rope_parameters, head_dim), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rope_parameters, head_dim)
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; supported: default, linear, dynamic, llama3, yarn"
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k.

    Args:
        head_dim: rotary dimension (= head dim).
        rope_parameters: normalised dict from ``ModelConfig.rope_parameters``.
        max_position_embeddings: the model's trained length (``dynamic`` scales beyond it).
        max_positions: table length (longest position + 1 the runtime will use).
    """

    inv_freq: torch.Tensor
    cos_cached: torch.Tensor
    sin_cached: torch.Tensor
    rotate_sign: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        rope_parameters: dict[str, Any],
        max_position_embeddings: int,
        max_positions: int,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rope_parameters = dict(rope_parameters)
        self.rope_type = rope_parameters["rope_type"]
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_scaling = compute_inv_freq(rope_parameters, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        cos, sin = self._cos_sin(torch.arange(max_positions), inv_freq)
        self.register_buffer(
            "cos_cached", cos, persistent=False
        )  # (max_positions, head_dim) float32
        self.register_buffer("sin_cached", sin, persistent=False)
        sign = torch.ones(head_dim)
        sign[: head_dim // 2] = -1.0
        self.register_buffer("rotate_sign", sign, persistent=False)  # (head_dim,) float32
        # off CUDA: sin_cached * rotate_sign, built at the first call and again if sin_cached was
        # replaced (moved); one more table of max_positions x head_dim float32 (64 MiB at 128k
        # positions x 128), so not kept on a GPU, where the fused kernel reads sin_cached
        self._signed_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(
        self, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        seq_len = positions.max() + 1
        if int(seq_len) <= self.max_position_embeddings:
            return self.inv_freq
        p, dim = self.rope_parameters, self.head_dim
        seq_len = torch.maximum(
            seq_len,
            torch.tensor(self.max_position_embeddings, dtype=seq_len.dtype, device=seq_len.device),
        )
        factor = p["factor"]
        base = p["rope_theta"] * (
            (factor * seq_len / self.max_position_embeddings) - (factor - 1)
        ) ** (dim / (dim - 2))
        exponents = (
            torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).to(
                dtype=torch.float
            )
            / dim
        )
        return 1.0 / (base**exponents)

    def _signed_sin_table(self) -> torch.Tensor:
        """``sin_cached`` with the first half of each row negated, (max_positions, head_dim)."""
        if self._signed_sin is None or self._signed_sin[0] is not self.sin_cached:
            self._signed_sin = (self.sin_cached, self.sin_cached * self.rotate_sign)
        return self._signed_sin[1]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int64; q (T, H, head_dim), k (T, H_kv, head_dim) -> rotated q, k."""
        # transformers' rotate_half(x) * sin == roll(x, half) * (sin, first half negated): one
        # roll instead of two slices, a negation and a cat, with bit-identical results.
        if self.rope_type == "dynamic" and positions.numel():
            cos, sin = self._cos_sin(positions, self._dynamic_inv_freq(positions))
            sin = sin * self.rotate_sign
        else:
            cos = torch.index_select(self.cos_cached, 0, positions)  # (T, head_dim)
            if self.sin_cached.is_cuda:  # the unfused path on a GPU: no second table (__init__)
                sin = torch.index_select(self.sin_cached, 0, positions) * self.rotate_sign
            else:
                sin = torch.index_select(self._signed_sin_table(), 0, positions)
        if q.dtype != cos.dtype:
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (T, 1, head_dim)
        half = self.head_dim // 2
        return (
            q * cos + torch.roll(q, half, dims=-1) * sin,
            k * cos + torch.roll(k, half, dims=-1) * sin,
        )


_ROPE_CACHE: weakref.WeakValueDictionary[tuple, RotaryEmbedding] = weakref.WeakValueDictionary()


def get_rope(
    head_dim: int, rope_parameters: dict[str, Any], max_position_embeddings: int, max_positions: int
) -> RotaryEmbedding:
    """The shared :class:`RotaryEmbedding` for these arguments on the current default device.

    Layers of one model (and models alive at the same time with the same RoPE on the same device)
    get the same module, hence one cos/sin table; it is built under the caller's
    ``torch.device`` context like any other module. Kept only while some model holds it.
    """
    device = str(torch.get_default_device())
    key = (
        head_dim,
        json.dumps(rope_parameters, sort_keys=True, default=str),
        max_position_embeddings,
        max_positions,
        device,
    )
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_dim, rope_parameters, max_position_embeddings, max_positions)
        _ROPE_CACHE[key] = rope
    return rope

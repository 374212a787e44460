"""KV cache dtype (``--kv-cache-dtype``) and per-layer fp8 scales (the design notes'
``configure_kv_cache_dtype`` step, run after loading and before sizing the pool).

``auto`` stores K/V in the model dtype. ``fp8_e4m3`` / ``fp8_e5m2`` store ``k / k_scale`` and
``v / v_scale`` in one byte per element (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``), halving
the cache of a bf16 model; the attention backends multiply by the scale after loading. The
scales are 1.0 unless the checkpoint carries them, as vLLM/ModelOpt-style fp8 checkpoints do:
one scalar per layer named ``model.layers.<i>.self_attn.{k,v}_scale`` (or under ``.attn.`` /
``.k_proj.`` / ``.v_proj.`` of it).
"""

from __future__ import annotations

import logging
import re

import torch

from shardline_runtime.model_loader.checkpoint_files import (
    TensorInfo,
    discover_checkpoint,
    iterate_weights,
)

logger = logging.getLogger(__name__)

KV_CACHE_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")
_SCALE_NAME = re.compile(r"layers\.(\d+)\..*\b([kv])_scale$")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the KV cache for ``--kv-cache-dtype name``.

    Raises:
        ValueError: unknown name (lists the allowed ones).
    """
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_TORCH_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_TORCH_DTYPES)}; got {name!r}"
        )
    return KV_CACHE_TORCH_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the one-byte float types."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def read_kv_scales(tensors: dict[str, TensorInfo]) -> dict[int, dict[str, float]]:
    """``{layer: {"k": k_scale, "v": v_scale}}`` from a checkpoint's scalar ``*_scale`` tensors."""
    wanted = {n: info for n, info in tensors.items() if _SCALE_NAME.search(n)}
    scales: dict[int, dict[str, float]] = {}
    for name, tensor in iterate_weights(wanted):
        match = _SCALE_NAME.search(name)
        assert match is not None  # the name was selected by this pattern
        if tensor.numel() != 1:
            raise ValueError(
                f"{name}: a per-layer KV scale must hold one value, got shape {tuple(tensor.shape)}"
            )
        value = float(tensor.float().item())
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name}: a KV scale must be a positive finite number, got {value}")
        scales.setdefault(int(match.group(1)), {})[match.group(2)] = value
    return scales


def configure_kv_cache_dtype(
    model, model_path: str | None, name: str, model_dtype: torch.dtype
) -> torch.dtype:
    """Resolve the cache dtype and, for fp8, set every attention layer's ``k_scale`` / ``v_scale``
    (1.0, or the checkpoint's). Returns the storage dtype."""
    dtype = resolve_kv_cache_dtype(name, model_dtype)
    layers = [m for m in model.modules() if hasattr(m, "k_scale") and hasattr(m, "layer_id")]
    scales = read_kv_scales(discover_checkpoint(model_path)) if is_fp8(dtype) and model_path else {}
    for layer in layers:
        found = scales.get(layer.layer_id, {})
        layer.k_scale = found.get("k", 1.0) if is_fp8(dtype) else 1.0
        layer.v_scale = found.get("v", 1.0) if is_fp8(dtype) else 1.0
    if is_fp8(dtype):
        logger.info(
            "KV cache %s; scales from the checkpoint for %d of %d layers",
            dtype,
            len(scales),
            len(layers),
        )
    return dtype

"""KV cache dtype (``--kv-cache-dtype``) and per-layer fp8 scales (the design notes'
``configure_kv_cache_dtype`` step, run after loading and before sizing the pool).

``auto`` stores K/V in the model dtype. ``fp8_e4m3`` / ``fp8_e5m2`` store ``k / k_scale`` and
``v / v_scale`` in one byte per element (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``), halving
the cache of a bf16 model; the attention backends multiply by the scale after loading. The
scales are 1.0 unless the checkpoint carries them, as vLLM/ModelOpt-style fp8 checkpoints do:
one scalar per layer named ``model.layers.<i>.self_attn.{k,v}_scale`` (or under ``.attn.`` /
``.k_proj.`` / ``.v_proj.`` of it). The scales belong to the checkpoint that serves: a weight
update from disk sets them to the new checkpoint's (``weight_update.py``), and a tensor or
distributed update that names ``*.k_scale`` / ``*.v_scale`` sets those (``weight_sync.py``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

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


def _checked_scale(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise ValueError(
            f"{name}: a per-layer KV scale must hold one value, got shape {tuple(tensor.shape)}"
        )
    value = float(tensor.float().item())
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}: a KV scale must be a positive finite number, got {value}")
    return value


def is_kv_scale_name(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a per-layer KV scale (``layers.<i>....{k,v}_scale``)."""
    return _SCALE_NAME.search(name) is not None


def scales_of_named(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, dict[str, float]]:
    """``{layer: {"k": k_scale, "v": v_scale}}`` from ``(name, scalar tensor)`` pairs whose
    names are KV scales (other names are skipped).

    Raises:
        ValueError: a scale holds more than one value or is not positive and finite (named).
    """
    scales: dict[int, dict[str, float]] = {}
    for name, tensor in named:
        match = _SCALE_NAME.search(name)
        if match is not None:
            scales.setdefault(int(match.group(1)), {})[match.group(2)] = _checked_scale(
                name, tensor
            )
    return scales


def read_kv_scales(tensors: dict[str, TensorInfo]) -> dict[int, dict[str, float]]:
    """``{layer: {"k": k_scale, "v": v_scale}}`` from a checkpoint's scalar ``*_scale`` tensors."""
    wanted = {n: info for n, info in tensors.items() if _SCALE_NAME.search(n)}
    return scales_of_named(iterate_weights(wanted))


def checkpoint_kv_scales(model_path: str | None, dtype: torch.dtype) -> dict[int, dict[str, float]]:
    """The scales a cache of storage ``dtype`` takes from the checkpoint at ``model_path`` (none
    unless the cache is fp8). Raises ValueError for a bad scale (see :func:`scales_of_named`)."""
    if not is_fp8(dtype) or not model_path:
        return {}
    return read_kv_scales(discover_checkpoint(model_path))


def _attention_layers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "k_scale") and hasattr(m, "layer_id")]


def set_kv_scales(model, scales: dict[int, dict[str, float]], dtype: torch.dtype) -> None:
    """Set every attention layer's ``k_scale`` / ``v_scale`` from ``scales`` (1.0 where absent;
    always 1.0 unless ``dtype`` is fp8). Used at start-up and after a weight update from disk,
    so the scales always belong to the checkpoint that serves."""
    for layer in _attention_layers(model):
        found = scales.get(layer.layer_id, {}) if is_fp8(dtype) else {}
        layer.k_scale = found.get("k", 1.0)
        layer.v_scale = found.get("v", 1.0)


def update_kv_scales(model, scales: dict[int, dict[str, float]], dtype: torch.dtype) -> None:
    """Set only the scales named in ``scales`` (a trainer's partial update); no-op unless fp8."""
    if not is_fp8(dtype):
        return
    for layer in _attention_layers(model):
        for kind, value in scales.get(layer.layer_id, {}).items():
            setattr(layer, f"{kind}_scale", value)


def configure_kv_cache_dtype(
    model, model_path: str | None, name: str, model_dtype: torch.dtype
) -> torch.dtype:
    """Resolve the cache dtype and, for fp8, set every attention layer's ``k_scale`` / ``v_scale``
    (1.0, or the checkpoint's). Returns the storage dtype."""
    dtype = resolve_kv_cache_dtype(name, model_dtype)
    scales = checkpoint_kv_scales(model_path, dtype)
    set_kv_scales(model, scales, dtype)
    if is_fp8(dtype):
        logger.info(
            "KV cache %s; scales from the checkpoint for %d of %d layers",
            dtype,
            len(scales),
            len(_attention_layers(model)),
        )
    return dtype

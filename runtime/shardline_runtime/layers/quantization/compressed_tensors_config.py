"""``quant_method: compressed-tensors`` (llm-compressor's checkpoints): which layers a
``config_groups`` entry quantizes (``targets``, ``ignore``; a plain name or ``re:<regex>``
matched against the checkpoint module name, ``Linear`` for every linear layer) and which
:class:`LinearMethod` serves its ``weights`` / ``input_activations`` arguments.

Served: ``float-quantized`` FP8 (8-bit float weights per tensor or per channel, activations
dynamic per token, static per tensor, or none; block weights with dynamic per-group
activations) and ``pack-quantized`` W4A16 (4-bit symmetric integer weights, per group).
Everything else (other bit widths, asymmetric weights, ``kv_cache_scheme``, sparsity,
transforms, output activations, an uncompressed status) is refused naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shardline_runtime.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    UnquantizedLinearMethod,
)
from shardline_runtime.layers.quantization.fp8_linear import (
    ACTIVATION_DYNAMIC,
    ACTIVATION_NONE,
    ACTIVATION_STATIC,
    Fp8BlockLinearMethod,
    Fp8LinearMethod,
)
from shardline_runtime.layers.quantization.w4a16_linear import W4A16LinearMethod

SERVED_FORMATS = ("float-quantized", "pack-quantized")
_FIELD = "quantization_config"


def _refuse(field: str, value: Any, allowed: str) -> QuantizationError:
    return QuantizationError(f"{_FIELD}.{field} {value!r} is not supported; supported: {allowed}")


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or name == pattern or name.endswith("." + pattern)


def _fp8_method(where: str, weights: dict, acts: dict | None) -> LinearMethod:
    strategy = weights.get("strategy")
    if strategy == "block":
        block = weights.get("block_structure") or []
        if len(block) != 2:
            raise _refuse(f"{where}.weights.block_structure", block, "[block_n, block_k]")
        if acts is None or not acts.get("dynamic") or acts.get("strategy") != "group":
            raise _refuse(
                f"{where}.input_activations", acts, "dynamic per-group FP8 with block weights"
            )
        if acts.get("group_size") not in (None, block[1]):
            raise _refuse(
                f"{where}.input_activations.group_size", acts.get("group_size"), str(block[1])
            )
        return Fp8BlockLinearMethod((int(block[0]), int(block[1])))
    if strategy not in ("tensor", "channel"):
        raise _refuse(f"{where}.weights.strategy", strategy, "tensor, channel, block")
    if acts is None:
        activation = ACTIVATION_NONE
    elif acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise _refuse(f"{where}.input_activations", acts, "8-bit float activations")
    elif acts.get("dynamic") and acts.get("strategy") == "token":
        activation = ACTIVATION_DYNAMIC
    elif not acts.get("dynamic") and acts.get("strategy") == "tensor":
        activation = ACTIVATION_STATIC
    else:
        raise _refuse(
            f"{where}.input_activations.strategy",
            acts.get("strategy"),
            "token (dynamic), tensor (static)",
        )
    return Fp8LinearMethod(per_channel=strategy == "channel", activation=activation)


def _group_method(where: str, group: dict, fmt: str | None) -> LinearMethod:
    weights = group.get("weights")
    acts = group.get("input_activations")
    if not weights:
        raise _refuse(f"{where}.weights", weights, "a weights scheme")
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations", group["output_activations"], "null")
    if weights.get("symmetric") is False:
        raise _refuse(f"{where}.weights.symmetric", False, "true")
    fmt = group.get("format") or fmt
    kind = (weights.get("type"), weights.get("num_bits"))
    if kind == ("float", 8) and fmt == "float-quantized":
        return _fp8_method(where, weights, acts)
    if kind == ("int", 4) and fmt == "pack-quantized":
        if acts is not None:
            raise _refuse(f"{where}.input_activations", acts, "null with 4-bit weights")
        if weights.get("strategy") != "group" or not weights.get("group_size"):
            raise _refuse(f"{where}.weights.strategy", weights.get("strategy"), "group")
        return W4A16LinearMethod(int(weights["group_size"]))
    raise _refuse(
        f"{where}.weights",
        f"type {kind[0]}, num_bits {kind[1]}, format {fmt}",
        "float 8-bit (float-quantized), int 4-bit (pack-quantized)",
    )


@dataclass(frozen=True)
class CompressedTensorsConfig(QuantizationConfig):
    """Parsed ``quantization_config``: ``groups`` of (targets, method) in file order, and the
    ``ignore`` patterns (layers left in the model dtype)."""

    groups: tuple[tuple[tuple[str, ...], LinearMethod], ...]
    ignore: tuple[str, ...]

    @classmethod
    def from_config(cls, cfg: dict) -> CompressedTensorsConfig:
        """Read a ``quant_method: compressed-tensors`` block.

        Raises:
            QuantizationError: an unsupported field, naming it and what is supported.
        """
        status = cfg.get("quantization_status", "compressed")
        if status != "compressed":
            raise _refuse("quantization_status", status, "compressed")
        for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if cfg.get(field):
                raise _refuse(field, cfg[field], "null or {}")
        groups = cfg.get("config_groups") or {}
        if not groups:
            raise _refuse("config_groups", groups, "at least one group")
        parsed = tuple(
            (
                tuple(group.get("targets") or ()),
                _group_method(f"config_groups.{name}", group, cfg.get("format")),
            )
            for name, group in groups.items()
        )
        return cls(groups=parsed, ignore=tuple(cfg.get("ignore") or ()))

    @property
    def scheme(self) -> str:
        return "+".join(sorted({method.scheme for _, method in self.groups}))

    def _method_of(self, name: str) -> LinearMethod:
        if any(_matches(p, name) for p in self.ignore):
            return UnquantizedLinearMethod()
        for targets, method in self.groups:
            if any(_matches(t, name) for t in targets):
                return method
        return UnquantizedLinearMethod()

    def linear_method(self, prefixes: list[str]) -> LinearMethod:
        methods = {self._method_of(p) for p in prefixes}
        if len(methods) != 1:
            raise QuantizationError(
                f"{_FIELD}: the fused checkpoint modules {prefixes} are quantized differently "
                f"({sorted(m.scheme for m in methods)}); they must share one scheme"
            )
        return methods.pop()

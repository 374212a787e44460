"""The quantization schemes the runtime serves, chosen from ``config.json``'s
``quantization_config.quant_method``; anything else is refused at load."""

from __future__ import annotations

from dataclasses import dataclass

from shardline_runtime.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
)
from shardline_runtime.layers.quantization.compressed_tensors_config import (
    CompressedTensorsConfig,
)
from shardline_runtime.layers.quantization.fp8_linear import Fp8BlockLinearMethod

# quant_method -> what is served of it (the refusal message lists these).
SUPPORTED_QUANT_METHODS = {
    "compressed-tensors": "FP8 W8A8 per-tensor / per-channel (static or dynamic activations), "
    "FP8 block-wise, W4A16 pack-quantized with group size",
    "fp8": "block-wise FP8 with weight_block_size and weight_scale_inv (DeepSeek-V3, Qwen3-FP8)",
}

# quant_method -> why it is refused although a W4A16 path exists (the message says so)
REFUSED_QUANT_METHODS = {
    "awq": "AWQ checkpoints carry asymmetric zero points (qzeros) and pack eight values per int32 "
    "along the output features in an interleaved order; the W4A16 path serves symmetric "
    "weights only. Convert the checkpoint to compressed-tensors W4A16 with llm-compressor",
    "gptq": "GPTQ checkpoints are not repacked into the W4A16 layout (qweight packed along the "
    "input features, qzeros, g_idx act-order permutations). Convert the checkpoint to "
    "compressed-tensors W4A16 with llm-compressor",
}


@dataclass(frozen=True)
class BlockFp8Config(QuantizationConfig):
    """``quant_method: fp8`` with ``weight_block_size`` (DeepSeek-V3 / Qwen3-FP8): every linear
    layer not in ``modules_to_not_convert`` holds E4M3 weights and ``weight_scale_inv``."""

    block: tuple[int, int]
    not_converted: tuple[str, ...]

    @classmethod
    def from_config(cls, cfg: dict) -> BlockFp8Config:
        """Raises:
        QuantizationError: no ``weight_block_size``, or a static activation scheme."""
        block = cfg.get("weight_block_size")
        if not isinstance(block, list) or len(block) != 2:
            raise QuantizationError(
                f"quantization_config.weight_block_size {block!r} is not supported with "
                "quant_method 'fp8'; supported: [block_n, block_k] (per-tensor FP8 checkpoints "
                "load through quant_method 'compressed-tensors')"
            )
        acts = cfg.get("activation_scheme", "dynamic")
        if acts != "dynamic":
            raise QuantizationError(
                f"quantization_config.activation_scheme {acts!r} is not supported with block-wise "
                "FP8; supported: dynamic"
            )
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantizationError(
                f"quantization_config.fmt {fmt!r} is not supported; supported: e4m3"
            )
        skip = cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or ()
        return cls(block=(int(block[0]), int(block[1])), not_converted=tuple(skip))

    @property
    def scheme(self) -> str:
        return f"fp8-block-{self.block[0]}x{self.block[1]}"

    def linear_method(self, prefixes: list[str]) -> LinearMethod:
        from shardline_runtime.layers.quantization.base import UnquantizedLinearMethod

        skipped = [p for p in prefixes if any(s in p for s in self.not_converted)]
        if skipped and len(skipped) != len(prefixes):
            raise QuantizationError(
                f"quantization_config.modules_to_not_convert: the fused modules {prefixes} are "
                "converted only in part"
            )
        if skipped:
            return UnquantizedLinearMethod()
        return Fp8BlockLinearMethod(self.block, scale_name="weight_scale_inv")


def quantization_config_from(
    hf_config: dict, source: str = "config.json"
) -> QuantizationConfig | None:
    """The scheme of a parsed ``config.json`` (None: not quantized).

    Raises:
        QuantizationError: ``quant_method`` is not one of ``SUPPORTED_QUANT_METHODS`` (the
            message names it and lists those), or a field of a supported one is unsupported.
    """
    cfg = hf_config.get("quantization_config")
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        raise QuantizationError(f"{source}: quantization_config must be an object, got {cfg!r}")
    method = cfg.get("quant_method")
    try:
        if method == "compressed-tensors":
            return CompressedTensorsConfig.from_config(cfg)
        if method == "fp8":
            return BlockFp8Config.from_config(cfg)
    except QuantizationError as e:
        raise QuantizationError(f"{source}: {e}") from None
    supported = "; ".join(f"{name} ({what})" for name, what in SUPPORTED_QUANT_METHODS.items())
    why = f" ({REFUSED_QUANT_METHODS[method]})" if method in REFUSED_QUANT_METHODS else ""
    raise QuantizationError(
        f"{source}: quantization_config.quant_method {method!r} is not supported{why}; "
        f"supported: {supported}"
    )

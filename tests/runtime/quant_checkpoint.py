"""Tiny quantized checkpoints written by the compressed-tensors library itself (the reference
is independent of the runtime's reader): a tiny transformers model, the library's preset
scheme applied (``apply_quantization_config``), weight scales from the library's
``calculate_qparams`` over each weight's min/max in the scheme's strategy, then
``ModelCompressor.compress_model`` + ``save_pretrained`` + ``update_config`` (llm-compressor's
save path, without its calibration).

MoE experts: transformers holds them fused (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)
parameters, not ``Linear`` modules), so before the scheme is applied each fused experts module
is put back into the checkpoint's layout, one ``Linear`` per expert and projection
(``experts.<e>.gate_proj``...), which is what llm-compressor's MoE calibration modules do; the
library then quantizes and compresses them like any other ``Linear``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

STATIC_INPUT_SCALE = 0.02  # the calibrated activation scale written for static FP8 schemes


def _min_max(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    from compressed_tensors.quantization import QuantizationStrategy as S

    if args.strategy == S.TENSOR:
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if args.strategy == S.CHANNEL:
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if args.strategy == S.GROUP:
        grouped = weight.unflatten(1, (-1, args.group_size))
        return grouped.amin(-1), grouped.amax(-1)
    if args.strategy == S.BLOCK:
        bn, bk = args.block_structure
        blocks = weight.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    raise ValueError(f"no min/max for strategy {args.strategy}")


class _Expert(torch.nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        inter, hidden = down.shape[1], down.shape[0]
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        self.gate_proj.weight.data.copy_(gate_up[:inter])
        self.up_proj.weight.data.copy_(gate_up[inter:])
        self.down_proj.weight.data.copy_(down)


def _unfuse_experts(model: torch.nn.Module) -> None:
    """Replace every fused experts module by a ``ModuleList`` of per-expert ``Linear``s."""
    fused = [
        (name, m) for name, m in model.named_modules() if hasattr(m, "gate_up_proj")
    ]
    for name, module in fused:
        experts = torch.nn.ModuleList(
            _Expert(gu, d) for gu, d in zip(module.gate_up_proj.data, module.down_proj.data)
        )
        model.set_submodule(name, experts)


def quantize_checkpoint(
    src: Path, out: Path, preset: str, ignore: tuple[str, ...] = (), **weight_args
) -> Path:
    """Write ``src`` (a float checkpoint with its tokenizer) quantized with the compressed-tensors
    ``preset`` (``FP8``, ``FP8_DYNAMIC``, ``FP8_BLOCK``, ``W4A16``) into ``out``; ``weight_args``
    override the preset's weight arguments (``group_size``, ``block_structure``); the block
    preset's activation group follows the block width. ``lm_head`` and the modules matching
    ``ignore`` (compressed-tensors patterns) stay unquantized."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    _unfuse_experts(model)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weight_args:
        scheme.weights = scheme.weights.model_copy(update=weight_args)
    if "block_structure" in weight_args:
        group = weight_args["block_structure"][1]
        scheme.input_activations = scheme.input_activations.model_copy(update={"group_size": group})
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head", *ignore])
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            scheme_of = getattr(module, "quantization_scheme", None)
            if scheme_of is None:
                continue
            low, high = _min_max(module.weight, scheme_of.weights)
            scale, _ = calculate_qparams(low, high, scheme_of.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "input_scale"):
                module.input_scale.fill_(STATIC_INPUT_SCALE)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    for name in Path(src).iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, out / name.name)
    return out


# test scheme name -> (compressed-tensors preset, weight argument overrides)
SCHEMES = {
    "fp8_dynamic_channel": ("FP8_DYNAMIC", {}),
    "fp8_static_tensor": ("FP8", {}),
    "fp8_block": ("FP8_BLOCK", {"block_structure": [16, 32]}),
    "w4a16": ("W4A16", {"group_size": 32}),
}


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    """``make(name, seed=0, arch="llama", ignore=())`` -> a compressed-tensors checkpoint of the
    tiny ``arch`` model in scheme ``name`` (one of ``SCHEMES``), the modules matching ``ignore``
    left unquantized, built once per module."""
    cache: dict = {}

    def make(name: str, seed: int = 0, arch: str = "llama", ignore: tuple[str, ...] = ()):
        key = (name, seed, arch, ignore)
        if key not in cache:
            preset, args = SCHEMES[name]
            src = tiny_checkpoint(arch, seed=seed)
            out = tmp_path_factory.mktemp(f"{arch}-{name}-{seed}")
            cache[key] = quantize_checkpoint(src, out, preset, ignore=ignore, **args)
        return cache[key]

    return make


def reference(path):
    """transformers' model of the checkpoint ``path`` (float32, eval); compressed-tensors
    decompresses it."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def ref_logits(model, tokens):
    """(T, vocab) logits of ``tokens`` under the reference ``model``."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def assert_scenario_matches(ref, result: dict, prompts: list[list[int]], tol: float, label) -> None:
    """Every step's logits of a ``harness.run_scenario`` ``result`` are within ``tol`` of the
    reference ``ref`` fed the same tokens (the prompt, then the tokens the runtime chose)."""
    for i, prompt in enumerate(prompts):
        tokens = list(prompt)
        for step, logits in enumerate(result["logits"]):
            expect = ref_logits(ref, tokens)[-1]
            assert (logits[i] - expect).abs().max() <= tol, (label, i, step)
            tokens.append(result["tokens"][step][i])

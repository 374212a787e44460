"""Quantized checkpoints written by compressed-tensors itself load and give the logits
transformers gives on the same checkpoint (it decompresses them and fake-quantizes the
activations), at TP1 and TP2 (two gloo processes); unsupported schemes are refused at load
naming ``quant_method`` and listing what is supported.

Tolerance: 1e-4 (float32; the CPU path dequantizes with the reference's numerics, measured
differences are about 1e-6), except dynamic per-token FP8 at TP2: the row-parallel layers
quantize each rank's half of a token's features with its own scale (as vLLM and SGLang do),
so logits differ from the unsharded reference by quantization noise (measured 0.18 on
logits of magnitude ~3; bound 0.3: a wrong shard or scale errs by O(1)).

Each step is compared with the reference fed the same tokens, never with a position of a longer
run: dynamic FP8 activations round each value to one of 8 steps per binade, so a last-bit
difference in a linear's input flips its FP8 code and moves the logits by about 1e-3. The
reference itself does that between lengths: with torch 2.15.0, transformers 5.24.0 and
compressed-tensors 0.20.1, its attention output at position 5 differs by 2.4e-7 between an
11-token and a 6-token run, and through ``fp8_block``'s per-group activations its logits there by
3.7e-3 (the runtime's 6-token chunk is within 3e-7 of the 6-token run)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import harness
from quant_checkpoint import (  # noqa: F401 (fixture)
    SCHEMES,
    assert_scenario_matches,
    quantized,
    ref_logits,
    reference,
)
from shardline_runtime.configs.model_config import ModelConfig, ModelConfigError

pytest.importorskip("compressed_tensors")

PROMPT = [5, 17, 200, 33, 9, 41, 77, 300, 12, 8, 101]
TOL = 1e-4
DYNAMIC_TP2_TOL = 0.3  # logits of this model span about +-3
EXPECTED_SCHEME = {
    "fp8_dynamic_channel": "fp8-w8a8-dynamic-channel",
    "fp8_static_tensor": "fp8-w8a8-static-tensor",
    "fp8_block": "fp8-block-16x32",
    "w4a16": "w4a16-g32",
}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantized_checkpoint_matches_transformers(quantized, name):
    path = quantized(name)
    runner = harness.make_runner(path)
    ref = reference(path)
    seqs = harness.new_seqs(runner, 1)
    first = harness.extend(runner, seqs, [PROMPT[:6]])
    second = harness.extend(runner, seqs, [PROMPT[6:]])
    full = ref_logits(ref, PROMPT)
    assert (first.next_token_logits[0] - ref_logits(ref, PROMPT[:6])[-1]).abs().max() <= TOL
    assert (second.next_token_logits[0] - full[-1]).abs().max() <= TOL
    tokens, nxt = list(PROMPT), int(full[-1].argmax())
    for _ in range(3):
        out = harness.decode(runner, seqs, [nxt])
        tokens.append(nxt)
        expect = ref_logits(ref, tokens)[-1]
        assert (out.next_token_logits[0] - expect).abs().max() <= TOL
        nxt = int(expect.argmax())


@pytest.mark.parametrize("name", list(SCHEMES))
def test_scheme_is_read_from_the_checkpoint(quantized, name):
    config = ModelConfig.from_pretrained(quantized(name), dtype="float32")
    assert config.quantization is not None
    assert config.quantization.scheme == EXPECTED_SCHEME[name]


def test_quantized_weights_are_stored_quantized(quantized):
    runner = harness.make_runner(quantized("fp8_dynamic_channel"))
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    assert qkv.weight_scale.shape == (qkv.output_size_per_partition, 1)


def test_packed_weights_are_int32(quantized):
    runner = harness.make_runner(quantized("w4a16"))
    down = runner.model.model.layers[0].mlp.down_proj
    assert down.weight_packed.dtype == torch.int32
    assert down.weight_packed.shape == (64, 128 // 8)


def _with_quantization_config(src, dst, quantization_config):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_unsupported_quant_method_is_refused_naming_it_and_the_supported(
    tiny_checkpoint, tmp_path, method
):
    path = _with_quantization_config(
        tiny_checkpoint("llama"), tmp_path / "q", {"quant_method": method, "bits": 4}
    )
    with pytest.raises(ModelConfigError) as err:
        ModelConfig.from_pretrained(path, dtype="float32")
    assert f"quant_method {method!r} is not supported" in str(err.value)
    assert "compressed-tensors" in str(err.value)
    assert "fp8" in str(err.value)


def test_unsupported_compressed_tensors_field_is_refused_naming_it(quantized, tmp_path):
    src = quantized("fp8_dynamic_channel")
    cfg = json.loads((src / "config.json").read_text())["quantization_config"]
    cfg["kv_cache_scheme"] = {"num_bits": 8, "type": "float"}
    path = _with_quantization_config(src, tmp_path / "kv", cfg)
    with pytest.raises(ModelConfigError, match="quantization_config.kv_cache_scheme"):
        ModelConfig.from_pretrained(path, dtype="float32")


def test_two_bit_weights_are_refused_naming_the_field(quantized, tmp_path):
    src = quantized("w4a16")
    cfg = json.loads((src / "config.json").read_text())["quantization_config"]
    cfg["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    path = _with_quantization_config(src, tmp_path / "w2", cfg)
    with pytest.raises(ModelConfigError, match=r"config_groups\.group_0\.weights"):
        ModelConfig.from_pretrained(path, dtype="float32")


def test_block_cut_by_tensor_parallel_split_is_refused(quantized):
    from shardline_runtime.layers.linear import QKVParallelLinear
    from shardline_runtime.layers.quantization.base import QuantizationError

    config = ModelConfig.from_pretrained(quantized("fp8_block"), dtype="float32")
    with pytest.raises(QuantizationError, match="weight_block_size"):  # k: 32 rows / 4 ranks
        QKVParallelLinear(
            64, 16, 4, 2, tp_rank=0, tp_size=4, quant_config=config.quantization,
            prefix="model.layers.0.self_attn.qkv_proj",
        )


@pytest.mark.slow
def test_tp2_quantized_logits_match_transformers(quantized, tmp_path):
    prompts = [PROMPT[:8], PROMPT[3:]]
    scenarios = [
        {"name": n, "path": str(quantized(n)), "prompts": prompts, "steps": 3} for n in SCHEMES
    ]
    ranks = harness.run_tp(2, scenarios, tmp_path)
    for name in SCHEMES:
        ref = reference(quantized(name))
        tol = DYNAMIC_TP2_TOL if name == "fp8_dynamic_channel" else TOL
        assert_scenario_matches(ref, ranks[0][name], prompts, tol, name)


def test_lora_on_a_quantized_base_is_refused(quantized):
    from shardline_runtime.lora.lora_config import LoRAAdapterError

    with pytest.raises(LoRAAdapterError, match="quantized base model"):
        harness.make_runner(quantized("fp8_dynamic_channel"), enable_lora=True)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_refusals_say_why_and_how_to_convert(tiny_checkpoint, tmp_path, method):
    path = _with_quantization_config(
        tiny_checkpoint("llama"), tmp_path / "q", {"quant_method": method, "bits": 4}
    )
    with pytest.raises(ModelConfigError, match="llm-compressor"):
        ModelConfig.from_pretrained(path, dtype="float32")

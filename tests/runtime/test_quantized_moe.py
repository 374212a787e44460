"""Quantized MoE experts (Qwen3-MoE) from checkpoints written by compressed-tensors itself:
the logits equal transformers loading the same checkpoint at TP1 and TP2 (two gloo processes,
also with the experts split over two EP ranks); block FP8 experts, which transformers cannot
load (its MoE decompression multiplies each expert by its scale without expanding blocks),
equal the library's own ``decompress`` expert by expert; online FP8 quantizes the experts;
an update in place to another revision of the scheme copies the experts' scales.

Reference numerics: transformers decompresses MoE experts to dense weights and runs them with
activations in the model dtype (``CompressedTensorsDequantize``), and so does the runtime
(dequantize, then the unquantized MoE path). Tolerance 1e-4 in
float32 (measured about 1e-6), at TP2 too: the dynamic per-token FP8 case there quantizes the
experts only (see the test)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import harness
from quant_checkpoint import (  # noqa: F401 (fixture)
    assert_scenario_matches,
    quantized,
    ref_logits,
    reference,
)
from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.layers.moe.expert_params import dequantized_experts
from shardline_runtime.sampling import SamplingParams
from tests.runtime.engine_driver import make_worker, run_engine

pytest.importorskip("compressed_tensors")

ARCH = "qwen3_moe"
PROMPT = [5, 17, 200, 33, 9, 41, 77, 300, 12, 8, 101]
PROMPTS = [[5, 17, 33, 80, 9], [300, 12, 55, 66, 77, 88]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
TOL = 1e-4
REFERENCED = ["fp8_dynamic_channel", "fp8_static_tensor", "w4a16"]


def experts_of(runner, layer: int = 0):
    return runner.model.model.layers[layer].mlp.experts


@pytest.mark.parametrize("name", REFERENCED)
def test_quantized_moe_logits_match_transformers(quantized, name):
    path = quantized(name, arch=ARCH)
    runner = harness.make_runner(path)
    ref = reference(path)
    seqs = harness.new_seqs(runner, 1)
    prefill = harness.extend(runner, seqs, [PROMPT])
    assert (prefill.next_token_logits[0] - ref_logits(ref, PROMPT)[-1]).abs().max() <= TOL
    tokens = list(PROMPT)
    nxt = int(prefill.next_token_logits[0].argmax())
    for _ in range(2):
        out = harness.decode(runner, seqs, [nxt])
        tokens.append(nxt)
        expect = ref_logits(ref, tokens)[-1]
        assert (out.next_token_logits[0] - expect).abs().max() <= TOL
        nxt = int(expect.argmax())


def test_fp8_experts_are_stored_in_fp8_with_their_scales(quantized):
    experts = experts_of(harness.make_runner(quantized("fp8_static_tensor", arch=ARCH)))
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert experts.w13_weight_scale.shape == (8, 2, 1)  # one per-tensor scale per gate / up
    assert experts.w2_input_scale.shape == (8, 1, 1)


def test_w4a16_experts_are_stored_packed(quantized):
    experts = experts_of(harness.make_runner(quantized("w4a16", arch=ARCH)))
    assert experts.w13_weight_packed.dtype == torch.int32
    assert experts.w2_weight_packed.shape == (8, 64, 32 // 8)


def test_block_fp8_experts_equal_the_library_decompression(quantized):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    path = quantized("fp8_block", arch=ARCH)
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(cfg["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(cfg["format"])
    tensors = load_file(str(path / "model.safetensors"))
    runner = harness.make_runner(path)
    experts = experts_of(runner, layer=1)
    w13, w2 = dequantized_experts(experts, experts.quant_methods, 32, 64, torch.float32)

    def library(expert: int, proj: str) -> torch.Tensor:
        prefix = f"model.layers.1.mlp.experts.{expert}.{proj}."
        compressed = {k: tensors[prefix + k] for k in ("weight", "weight_scale")}
        return compressor.decompress(compressed, scheme)["weight"]

    for e in range(8):
        expect13 = torch.cat([library(e, "gate_proj"), library(e, "up_proj")])
        assert torch.equal(w13[e], expect13), f"expert {e} gate/up"
        assert torch.equal(w2[e], library(e, "down_proj")), f"expert {e} down"


def test_block_fp8_moe_serves_the_decompressed_experts(quantized):
    path = quantized("fp8_block", arch=ARCH)
    config = ModelConfig.from_pretrained(path, dtype="float32")
    assert config.quantization.scheme == "fp8-block-16x32"
    tokens = harness.greedy_generate(harness.make_runner(path), [PROMPT], steps=3)
    assert len(tokens[0]) == 3


def test_online_fp8_quantizes_the_experts_as_compressed_tensors_does(quantized, tiny_checkpoint):
    online = harness.make_runner(tiny_checkpoint(ARCH), quantization="fp8")
    offline = harness.make_runner(quantized("fp8_dynamic_channel", arch=ARCH))
    assert experts_of(online).w13_weight.dtype == torch.float8_e4m3fn
    assert torch.equal(experts_of(online).w13_weight_scale, experts_of(offline).w13_weight_scale)
    assert torch.equal(experts_of(online).w2_weight_scale, experts_of(offline).w2_weight_scale)
    got = harness.extend(online, harness.new_seqs(online, 1), [PROMPT]).next_token_logits
    expect = harness.extend(offline, harness.new_seqs(offline, 1), [PROMPT]).next_token_logits
    assert (got - expect).abs().max() <= TOL


def expert_scales(worker):
    return {
        n: p.detach().clone()
        for n, p in worker.model_runner.model.named_parameters()
        if ".experts.w" in n and "scale" in n
    }


def test_update_in_place_to_another_revision_equals_cold_start(quantized):
    a, b = quantized("fp8_static_tensor", arch=ARCH), quantized("fp8_static_tensor", 1, ARCH)
    cold_b = make_worker(b, dtype="float32")
    worker = make_worker(a, dtype="float32")
    before = run_engine(worker, PROMPTS, GREEDY)
    ok, message = worker.update_weights_from_disk(str(b))
    assert ok, message
    fresh = expert_scales(cold_b)
    after = expert_scales(worker)
    assert sorted(after) == sorted(fresh)
    assert all(after[n].equal(fresh[n]) for n in fresh), "expert scales differ from a cold start"
    served = run_engine(worker, PROMPTS, GREEDY)
    assert served != before
    assert served == run_engine(cold_b, PROMPTS, GREEDY)


EXPERTS_ONLY = ("re:.*self_attn.*",)  # attention left in the model dtype


@pytest.mark.slow
def test_tp2_quantized_moe_logits_match_transformers(quantized, tmp_path):
    # moe_tp_size 2 splits the intermediate size 32 into halves of 16: the FP8 scales split
    # with the weights (per channel: w13 rows split, w2 rows replicated; per tensor: one per
    # shard); a W4A16 group of 32 cannot be cut, so W4A16 runs its experts over EP. The dynamic
    # FP8 case quantizes the experts only: at TP2 the row-parallel attention output would add
    # per-rank activation-scale noise, enough to flip a top-k routing choice.
    cases = {
        "fp8_dynamic_channel": ({}, EXPERTS_ONLY),
        "fp8_static_tensor": ({}, ()),
        "w4a16": ({"ep_size": 2}, ()),
    }
    paths = {
        name: quantized(name, arch=ARCH, ignore=ignore) for name, (_, ignore) in cases.items()
    }
    prompts = [PROMPT[:8], PROMPT[3:]]
    scenarios = [
        {
            "name": name,
            "path": str(paths[name]),
            "prompts": prompts,
            "steps": 2,
            "runner_kwargs": kwargs,
        }
        for name, (kwargs, _) in cases.items()
    ]
    ranks = harness.run_tp(2, scenarios, tmp_path)
    for name in cases:
        ref = reference(paths[name])
        assert_scenario_matches(ref, ranks[0][name], prompts, TOL, name)


def test_lora_on_a_quantized_moe_base_is_refused(quantized):
    from shardline_runtime.lora.lora_config import LoRAAdapterError

    with pytest.raises(LoRAAdapterError, match="quantized base model"):
        harness.make_runner(quantized("w4a16", arch=ARCH), enable_lora=True)


def test_expert_replacement_moves_the_scales_with_the_weights(quantized):
    from shardline_runtime.layers.moe.expert_rebalance import rebalance_in_place

    path = quantized("fp8_static_tensor", arch=ARCH)
    runner = harness.make_runner(path, ep_num_redundant_experts=2)
    before = harness.greedy_generate(runner, PROMPTS, steps=4)
    placement = torch.tensor([[7, 6, 5, 4, 3, 2, 1, 0, 0, 1]] * 2)  # (MoE layers, slots)
    assert rebalance_in_place(runner.model, placement) > 0
    fresh = experts_of(harness.make_runner(path, ep_num_redundant_experts=2))  # slot p: p % 8
    moved = experts_of(runner)
    assert torch.equal(moved.w13_weight_scale[0], fresh.w13_weight_scale[7])  # expert 7
    assert torch.equal(moved.w2_weight[8], fresh.w2_weight[0])  # a replica of expert 0
    assert harness.greedy_generate(runner, PROMPTS, steps=4) == before

"""Online FP8 (``--quantization fp8``): a float checkpoint quantized per channel at load serves
the logits of the same checkpoint quantized FP8_DYNAMIC by compressed-tensors (the independent
reference: compressed-tensors' per-channel scales, read back by transformers in
test_quantized_checkpoints.py); every weight update quantizes on the way in."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import harness
from quant_checkpoint import quantize_checkpoint
from shardline_runtime.configs.model_config import ModelConfig, ModelConfigError
from shardline_runtime.model_executor.weight_sync import update_weights_from_safetensors
from shardline_runtime.sampling import SamplingParams
from tests.runtime.engine_driver import make_worker, run_engine

pytest.importorskip("compressed_tensors")

PROMPT = [5, 17, 200, 33, 9, 41, 77, 300, 12, 8, 101]
PROMPTS = [[5, 17, 33, 80, 9], [300, 12, 55, 66, 77, 88]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=0), tiny_checkpoint("llama", seed=1, tokenizer=False)


def scales(worker):
    return {
        n: p.detach().clone()
        for n, p in worker.model_runner.model.named_parameters()
        if n.endswith("weight_scale")
    }


def test_online_fp8_equals_the_compressed_tensors_fp8_checkpoint(ckpts, tmp_path):
    offline = quantize_checkpoint(ckpts[0], tmp_path / "ct", "FP8_DYNAMIC")
    online = harness.make_runner(ckpts[0], quantization="fp8")
    reference = harness.make_runner(offline)
    got = harness.extend(online, harness.new_seqs(online, 1), [PROMPT]).next_token_logits
    expect = harness.extend(reference, harness.new_seqs(reference, 1), [PROMPT]).next_token_logits
    assert (got - expect).abs().max() <= TOL


def test_online_fp8_stores_fp8_weights_and_reports_the_scheme(ckpts):
    runner = harness.make_runner(ckpts[0], quantization="fp8")
    assert runner.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert runner.model_config.quantization.scheme == "fp8-online-channel"


def test_online_fp8_of_a_quantized_checkpoint_is_refused(ckpts, tmp_path):
    offline = quantize_checkpoint(ckpts[0], tmp_path / "ct", "FP8_DYNAMIC")
    with pytest.raises(ModelConfigError, match="already quantized"):
        ModelConfig.from_pretrained(offline, dtype="float32", quantization="fp8")


def test_disk_update_quantizes_the_new_weights_as_a_cold_start_does(ckpts):
    a, b = ckpts
    cold_b = make_worker(b, dtype="float32", quantization="fp8")
    worker = make_worker(a, dtype="float32", quantization="fp8")
    ok, message = worker.update_weights_from_disk(str(b))
    assert ok, message
    fresh = scales(cold_b)
    assert all(scales(worker)[n].equal(fresh[n]) for n in fresh)
    assert run_engine(worker, PROMPTS, GREEDY) == run_engine(cold_b, PROMPTS, GREEDY)


def test_tensor_update_quantizes_on_the_way_in(ckpts):
    a, b = ckpts
    cold_b = make_worker(b, dtype="float32", quantization="fp8")
    worker = make_worker(a, dtype="float32", quantization="fp8")
    blob = (b / "model.safetensors").read_bytes()
    ok, message, names = update_weights_from_safetensors(worker.model_runner, blob)
    assert ok, message
    assert len(names) == len(load_file(str(b / "model.safetensors")))
    fresh = scales(cold_b)
    assert all(scales(worker)[n].equal(fresh[n]) for n in fresh)
    assert run_engine(worker, PROMPTS, GREEDY) == run_engine(cold_b, PROMPTS, GREEDY)

"""Field case G10: fp8 KV scales (``*.k_scale`` / ``*.v_scale``) follow every weight update.

After an update from disk, from a safetensors blob (a trainer's ``update_weights_from_tensor``)
or after a memory release and resume, an fp8-KV worker holds the scales of the checkpoint it
reports and generates what a cold start on that checkpoint generates.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from shardline_runtime.model_executor.weight_sync import update_weights_from_safetensors
from shardline_runtime.sampling import SamplingParams

from tests.runtime.engine_driver import make_worker, run_engine

PROMPTS = [[5, 17, 33, 80, 9, 41, 77, 30], [7, 8, 9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
SCALES_A = {"model.layers.0.self_attn.k_scale": 1.0, "model.layers.1.self_attn.v_scale": 1.0}
# Coarse scales: fp8 keeps ~3 mantissa bits, so dividing K/V by 16 or 64 changes the stored values
SCALES_B = {
    "model.layers.0.self_attn.k_scale": 16.0,
    "model.layers.0.self_attn.v_scale": 64.0,
    "model.layers.1.self_attn.k_scale": 32.0,
    "model.layers.1.self_attn.v_scale": 0.25,
}


def with_scales(src, dst, scales: dict[str, float]):
    shutil.copytree(src, dst)
    save_file({k: torch.tensor(v) for k, v in scales.items()}, str(dst / "kv_scales.safetensors"))
    return dst


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("g10")
    a = with_scales(tiny_checkpoint("llama", seed=4), root / "a", SCALES_A)
    b = with_scales(tiny_checkpoint("llama", seed=4), root / "b", SCALES_B)
    return a, b


def fp8_worker(path, **kwargs):
    return make_worker(path, kv_cache_dtype="fp8_e4m3", **kwargs)


def layer_scales(worker) -> list[tuple[float, float]]:
    return [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in worker.model_runner.model.model.layers]


def test_the_two_checkpoints_generate_differently(ckpts):
    a, b = ckpts
    assert run_engine(fp8_worker(a), PROMPTS, GREEDY) != run_engine(fp8_worker(b), PROMPTS, GREEDY)


def test_a_disk_update_takes_the_new_checkpoints_scales(ckpts):
    a, b = ckpts
    worker = fp8_worker(a)
    ok, message = worker.model_runner.update_weights_from_disk(str(b))
    assert ok, message
    assert layer_scales(worker) == layer_scales(fp8_worker(b))


def test_a_disk_update_generates_as_a_cold_start(ckpts):
    a, b = ckpts
    worker = fp8_worker(a)
    run_engine(worker, PROMPTS, GREEDY)
    ok, message = worker.model_runner.update_weights_from_disk(str(b))
    assert ok, message
    assert run_engine(worker, PROMPTS, GREEDY) == run_engine(fp8_worker(b), PROMPTS, GREEDY)


def test_a_disk_update_to_a_checkpoint_without_scales_resets_them_to_one(ckpts, tiny_checkpoint):
    _, b = ckpts
    worker = fp8_worker(b)
    ok, message = worker.model_runner.update_weights_from_disk(str(tiny_checkpoint("llama", seed=4)))
    assert ok, message
    assert layer_scales(worker) == [(1.0, 1.0), (1.0, 1.0)]


def test_a_bad_scale_on_disk_fails_the_update_and_keeps_the_old_scales(ckpts, tmp_path):
    a, _ = ckpts
    bad = with_scales(a, tmp_path / "bad", {"model.layers.1.self_attn.extra.k_scale": -2.0})
    worker = fp8_worker(a)
    before = layer_scales(worker)
    ok, message = worker.model_runner.update_weights_from_disk(str(bad))
    assert not ok
    assert "model.layers.1.self_attn.extra.k_scale" in message
    assert layer_scales(worker) == before


def test_a_tensor_update_of_the_scales_is_applied(ckpts):
    a, b = ckpts
    worker = fp8_worker(a)
    blob = save({k: torch.tensor(v) for k, v in SCALES_B.items()})
    ok, message, names = update_weights_from_safetensors(worker.model_runner, blob)
    assert ok, message
    assert sorted(names) == sorted(SCALES_B)
    assert layer_scales(worker) == layer_scales(fp8_worker(b))


def test_a_tensor_update_with_weights_and_scales_generates_as_a_cold_start(ckpts, tiny_checkpoint):
    a, b = ckpts
    worker = fp8_worker(a)
    tensors = load_file(str(tiny_checkpoint("llama", seed=4) / "model.safetensors"))
    tensors.update({k: torch.tensor(v) for k, v in SCALES_B.items()})
    ok, message, _ = update_weights_from_safetensors(worker.model_runner, save(tensors))
    assert ok, message
    assert run_engine(worker, PROMPTS, GREEDY) == run_engine(fp8_worker(b), PROMPTS, GREEDY)


def test_a_bad_scale_tensor_is_refused_by_name_and_changes_nothing(ckpts):
    a, _ = ckpts
    worker = fp8_worker(a)
    before = layer_scales(worker)
    blob = save({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)})
    ok, message, _ = update_weights_from_safetensors(worker.model_runner, blob)
    assert not ok
    assert "model.layers.0.self_attn.k_scale" in message
    assert layer_scales(worker) == before


def test_a_scale_tensor_of_more_than_one_value_is_refused(ckpts):
    a, _ = ckpts
    worker = fp8_worker(a)
    blob = save({"model.layers.0.self_attn.v_scale": torch.ones(2)})
    ok, message, _ = update_weights_from_safetensors(worker.model_runner, blob)
    assert not ok
    assert "one value" in message


def test_after_release_and_resume_a_disk_update_takes_the_new_scales(ckpts):
    a, b = ckpts
    worker = fp8_worker(a)
    saver = worker.model_runner.memory_saver
    saver.release(None)
    saver.resume(None)
    ok, message = worker.model_runner.update_weights_from_disk(str(b))
    assert ok, message
    saver.note_loaded(None)
    assert run_engine(worker, PROMPTS, GREEDY) == run_engine(fp8_worker(b), PROMPTS, GREEDY)

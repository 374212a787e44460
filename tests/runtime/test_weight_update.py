"""update_weights_from_disk in place: field cases W1, W2 (CPU part), W3."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner
from shardline_runtime.model_executor.device_graphs import DeviceGraphs
from shardline_runtime.model_executor.weight_update import PhaseClock
from shardline_runtime.sampling import SamplingParams
from shardline_runtime.weights_state import WeightsPhase
from tests.runtime.engine_driver import make_worker, run_engine

PROMPTS = [[5, 17, 33, 80, 9], [7, 8], [300, 12, 55, 66, 77, 88], [42, 43, 44, 45], [1, 2, 3, 4, 5, 6, 7]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def with_static_graphs(worker):
    runner = worker.model_runner
    runner.graphs = DeviceGraphs(runner, decode=CudaGraphRunner(runner, capture=False, batch_sizes=[1, 2, 4]))
    return worker


def edited_copy(src, dst, edit):
    """Copy a single-file checkpoint and rewrite its tensors with ``edit(dict) -> dict``."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(dst / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def ckpt_a(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=0)


@pytest.fixture(scope="module")
def ckpt_b(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=1, tokenizer=False)


def test_w3_update_equals_cold_start_and_keeps_storage(ckpt_a, ckpt_b):
    cold_b = run_engine(make_worker(ckpt_b), PROMPTS, GREEDY)
    worker = with_static_graphs(make_worker(ckpt_a))
    before = run_engine(worker, PROMPTS, GREEDY)
    assert before != cold_b
    ptrs = {name: p.data_ptr() for name, p in worker.model_runner.model.named_parameters()}
    phases: list = []
    ok, message = worker.update_weights_from_disk(str(ckpt_b), on_phase=phases.append)
    assert ok, message
    assert {name: p.data_ptr() for name, p in worker.model_runner.model.named_parameters()} == ptrs
    assert run_engine(worker, PROMPTS, GREEDY) == cold_b
    assert [p.value for p in phases] == ["loading", "recapturing", "serving"]
    assert worker.model_runner.model_config.model_path == str(ckpt_b)


def test_phase_clock_times_loading_and_recapturing(ckpt_a, ckpt_b):
    """The seconds the runtime reports for an update (``load_seconds`` / ``recapture_seconds``)."""
    worker = with_static_graphs(make_worker(ckpt_a))  # a graph runner (eager on CPU) to recapture
    seen: list = []
    clock = PhaseClock(seen.append)
    ok, message = worker.update_weights_from_disk(str(ckpt_b), on_phase=clock)
    assert ok, message
    assert seen == [WeightsPhase.LOADING, WeightsPhase.RECAPTURING, WeightsPhase.SERVING]
    seconds = clock.seconds()
    assert seconds["load_seconds"] > 0 and seconds["recapture_seconds"] >= 0
    # Arithmetic on a scripted clock: each phase lasts until the next begins.
    ticks = iter([10.0, 12.5, 13.0, 99.0])
    clock = PhaseClock(clock=lambda: next(ticks))
    clock(WeightsPhase.LOADING), clock(WeightsPhase.RECAPTURING), clock(WeightsPhase.SERVING)
    assert clock.seconds() == {"load_seconds": 2.5, "recapture_seconds": 0.5}
    ticks = iter([0.0, 4.0, 99.0])  # a failed load: no recapture
    clock = PhaseClock(clock=lambda: next(ticks))
    clock(WeightsPhase.LOADING), clock(WeightsPhase.FAILED)
    assert clock.seconds() == {"load_seconds": 4.0, "recapture_seconds": 0.0}


def test_w2_same_checkpoint_update_is_bit_identical(ckpt_a):
    worker = with_static_graphs(make_worker(ckpt_a))
    batch_1 = run_engine(worker, PROMPTS[:1], GREEDY)
    batch_3 = run_engine(worker, PROMPTS[:3], GREEDY)
    params = {n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters()}
    ok, message = worker.update_weights_from_disk(str(ckpt_a), recapture_cuda_graph=True)
    assert ok, message
    for name, p in worker.model_runner.model.named_parameters():
        assert p.equal(params[name]), name
    assert run_engine(worker, PROMPTS[:1], GREEDY) == batch_1
    assert run_engine(worker, PROMPTS[:3], GREEDY) == batch_3


def bad_checkpoints(tiny_checkpoint, ckpt_a, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    sharded = tiny_checkpoint("llama", seed=0, tokenizer=False, max_shard_size="40KB")
    missing_shard = tmp / "missing_shard"
    shutil.copytree(sharded, missing_shard)
    index = json.loads((missing_shard / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (missing_shard / victim).unlink()

    def drop(t):
        t.pop("model.layers.1.mlp.down_proj.weight")
        return t

    def add(t):
        t["model.layers.1.mlp.extra.weight"] = t["model.norm.weight"].clone()
        return t

    return {
        "hidden": (tiny_checkpoint("llama", seed=0, tokenizer=False, hidden_size=128),
                   ["model.embed_tokens.weight", "(512, 64)", "(512, 128)"]),
        "layers": (tiny_checkpoint("llama", seed=0, tokenizer=False, num_hidden_layers=3),
                   ["unexpected parameter model.layers.2."]),
        "vocab": (tiny_checkpoint("llama", seed=0, tokenizer=False, vocab_size=640),
                  ["model.embed_tokens.weight", "(512, 64)", "(640, 64)"]),
        "missing_param": (edited_copy(ckpt_a, tmp / "missing_param", drop), ["model.layers.1.mlp.down_proj.weight", "absent"]),
        "unexpected_param": (edited_copy(ckpt_a, tmp / "unexpected_param", add), ["unexpected parameter model.layers.1.mlp.extra.weight"]),
        "missing_shard": (missing_shard, [victim]),
        "rope_theta": (tiny_checkpoint("llama", seed=0, tokenizer=False, rope_theta=1234.0), ["config field rope_parameters"]),
        "architecture": (tiny_checkpoint("qwen2", seed=0, tokenizer=False), ["config field architectures"]),
        "not_a_dir": (tmp / "does-not-exist", ["does-not-exist"]),
    }


def test_w1_failed_updates_keep_old_weights(tiny_checkpoint, ckpt_a, tmp_path_factory):
    worker = with_static_graphs(make_worker(ckpt_a))
    reference = run_engine(worker, PROMPTS, GREEDY)
    params = {n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters()}
    for case, (path, expected) in bad_checkpoints(tiny_checkpoint, ckpt_a, tmp_path_factory).items():
        phases: list = []
        ok, message = worker.update_weights_from_disk(str(path), on_phase=phases.append)
        assert not ok, case
        assert all(part in message for part in expected), (case, message)
        assert phases[-1].value == "failed", case
        assert worker.model_runner.model_config.model_path == str(ckpt_a)
        for name, p in worker.model_runner.model.named_parameters():
            assert p.equal(params[name]), (case, name)
    assert run_engine(worker, PROMPTS, GREEDY) == reference
    phases = []
    assert worker.update_weights_from_disk(str(ckpt_a), on_phase=phases.append)[0]
    assert phases[-1].value == "serving"


def test_bad_load_format_is_rejected(ckpt_a):
    worker = make_worker(ckpt_a)
    ok, message = worker.update_weights_from_disk(str(ckpt_a), load_format="pickle")
    assert not ok and "load_format" in message and "safetensors" in message


def test_compare_models_names_first_rank_shard_mismatch(tiny_checkpoint):
    """The second check (after the header check): this rank's loaded shards vs the live ones."""
    from shardline_runtime.configs.model_config import ModelConfig
    from shardline_runtime.model_executor.weight_staging import WeightUpdateError, compare_models
    from shardline_runtime.model_loader.loader import build_model

    small = ModelConfig.from_pretrained(tiny_checkpoint("llama", seed=0))
    wide = ModelConfig.from_pretrained(tiny_checkpoint("llama", seed=0, tokenizer=False, intermediate_size=256))
    with pytest.raises(WeightUpdateError, match=r"model.layers.0.mlp.gate_up_proj.weight: old shape \(256, 64\), new shape \(512, 64\)"):
        compare_models(small, build_model(small, "cpu"), wide, build_model(wide, "cpu"))
    eps = ModelConfig.from_pretrained(tiny_checkpoint("llama", seed=0, tokenizer=False, rms_norm_eps=1e-5))
    with pytest.raises(WeightUpdateError, match="config field rms_norm_eps"):
        compare_models(small, build_model(small, "cpu"), eps, build_model(eps, "cpu"))


@pytest.mark.gpu
def test_w2_w3_with_captured_cuda_graphs(ckpt_a, ckpt_b):
    """W2 and W3 for real: decode graphs captured on CUDA read the updated weights."""
    cold_b = run_engine(make_worker(ckpt_b, device_override="cuda", cuda_graph_max_bs=4), PROMPTS, GREEDY)
    worker = make_worker(ckpt_a, device_override="cuda", cuda_graph_max_bs=4)
    assert worker.model_runner.graphs.decode.graphs
    batch_1, batch_3 = run_engine(worker, PROMPTS[:1], GREEDY), run_engine(worker, PROMPTS[:3], GREEDY)
    ok, message = worker.update_weights_from_disk(str(ckpt_a), recapture_cuda_graph=False)
    assert ok, message
    assert run_engine(worker, PROMPTS[:1], GREEDY) == batch_1
    assert run_engine(worker, PROMPTS[:3], GREEDY) == batch_3
    ok, message = worker.update_weights_from_disk(str(ckpt_b), recapture_cuda_graph=False)
    assert ok, message
    assert run_engine(worker, PROMPTS, GREEDY) == cold_b
    phases: list = []
    clock = PhaseClock(phases.append)
    ok, message = worker.update_weights_from_disk(str(ckpt_b), recapture_cuda_graph=True, on_phase=clock)
    assert ok, message
    assert phases[-1].value == "serving"
    assert clock.seconds()["recapture_seconds"] > 0  # graphs really captured again
    assert run_engine(worker, PROMPTS, GREEDY) == cold_b

"""Weight sync and memory release on one in-process worker (TP=1): the model-side contracts."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save

from shardline_runtime.model_executor.weight_sync import get_weights_by_name, update_weights_from_safetensors
from shardline_runtime.model_executor.weight_staging import WeightUpdateError
from shardline_runtime.sampling import SamplingParams

from tests.runtime.engine_driver import make_worker, run_engine

PROMPTS = [[5, 17, 33, 80, 9], [7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=0), tiny_checkpoint("llama", seed=1, tokenizer=False)


def snapshot(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters()}


def test_a_bad_tensor_in_the_batch_changes_no_weight(ckpts):
    a, b = ckpts
    worker = make_worker(a)
    before = snapshot(worker)
    new = load_file(str(b / "model.safetensors"))
    new["model.layers.1.mlp.down_proj.weight"] = new["model.layers.1.mlp.down_proj.weight"][:, :5].contiguous()
    ok, message, _ = update_weights_from_safetensors(worker.model_runner, save(new))
    assert not ok
    assert "model.layers.1.mlp.down_proj.weight" in message and "shape" in message
    after = snapshot(worker)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_tensor_update_equals_a_cold_start(ckpts):
    a, b = ckpts
    worker = make_worker(a)
    ok, message, names = update_weights_from_safetensors(worker.model_runner, (b / "model.safetensors").read_bytes())
    assert ok, message
    assert len(names) == len(load_file(str(b / "model.safetensors")))
    assert run_engine(worker, PROMPTS, GREEDY) == run_engine(make_worker(b), PROMPTS, GREEDY)


def test_get_weights_by_name_of_a_tied_head_is_the_embedding(tiny_checkpoint):
    path = tiny_checkpoint("qwen3", seed=2, tie_word_embeddings=True)
    worker = make_worker(path)
    embed = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"]
    assert get_weights_by_name(worker.model_runner, "lm_head.weight", 3) == embed[:3].tolist()
    with pytest.raises(WeightUpdateError, match="truncate_size"):
        get_weights_by_name(worker.model_runner, "lm_head.weight", 0)


@pytest.mark.parametrize("cpu_backup", [True, False])
def test_release_and_resume_keep_outputs(ckpts, cpu_backup):
    a, _ = ckpts
    worker = make_worker(a, enable_weights_cpu_backup=cpu_backup)
    expected = run_engine(worker, PROMPTS, GREEDY)
    saver = worker.model_runner.memory_saver
    saver.release(None)
    assert all(p.numel() == 0 for p in worker.model_runner.model.parameters())
    assert saver.blocked_reason() is not None
    saver.resume(None)
    if not cpu_backup:
        assert saver.missing and "weight update" in saver.blocked_reason()
        ok, message, names = update_weights_from_safetensors(worker.model_runner, (a / "model.safetensors").read_bytes())
        assert ok, message
        saver.note_loaded(names)
    assert saver.blocked_reason() is None
    assert run_engine(worker, PROMPTS, GREEDY) == expected


@pytest.mark.gpu
def test_torch_memory_saver_keeps_addresses_and_frees_the_gpu(ckpts):
    if os.environ.get("SHARDLINE_GPU_CHECK") == "1":  # bench/gpu_check.sh: run or fail, never skip
        import torch_memory_saver  # noqa: F401
    else:
        pytest.importorskip("torch_memory_saver")
    a, _ = ckpts
    worker = make_worker(a, device_override="cuda", enable_memory_saver=True, enable_weights_cpu_backup=True,
                         max_total_tokens=1 << 20)
    runner = worker.model_runner
    assert runner.memory_saver.tms is not None
    expected = run_engine(worker, PROMPTS, GREEDY)
    pointers = [p.data_ptr() for p in runner.model.parameters()]
    graphs = runner.graphs.decode
    assert graphs is not None and graphs.graphs
    free_before = torch.cuda.mem_get_info()[0]
    runner.memory_saver.release(["weights", "kv_cache"])
    freed = torch.cuda.mem_get_info()[0] - free_before
    assert freed > 0.8 * runner.token_to_kv_pool.mem_usage_bytes()
    assert runner.graphs.decode is graphs  # same addresses at resume: the graphs stay
    runner.memory_saver.resume(["weights", "kv_cache"])
    assert [p.data_ptr() for p in runner.model.parameters()] == pointers
    assert runner.graphs.decode is graphs
    assert run_engine(worker, PROMPTS, GREEDY) == expected


@pytest.mark.gpu
def test_without_memory_saver_decode_graphs_are_captured_again_at_resume(ckpts):
    a, _ = ckpts
    worker = make_worker(a, device_override="cuda", enable_weights_cpu_backup=True)
    runner = worker.model_runner
    assert runner.memory_saver.tms is None
    assert runner.graphs.decode is not None and runner.graphs.decode.graphs
    expected = run_engine(worker, PROMPTS, GREEDY)
    runner.memory_saver.release(["kv_cache"])
    assert runner.graphs.decode is None  # new KV addresses at resume: the old graphs are dropped
    runner.memory_saver.resume(["kv_cache"])
    assert runner.graphs.decode is not None
    assert runner.graphs.decode.graphs  # captured again
    assert run_engine(worker, PROMPTS, GREEDY) == expected


def test_moe_expert_tensors_sync_and_read_back(tiny_checkpoint):
    a = tiny_checkpoint("qwen3_moe", seed=0)
    b = tiny_checkpoint("qwen3_moe", seed=1, tokenizer=False)
    worker = make_worker(a)
    ok, message, _ = update_weights_from_safetensors(worker.model_runner, (b / "model.safetensors").read_bytes())
    assert ok, message
    assert run_engine(worker, PROMPTS, GREEDY) == run_engine(make_worker(b), PROMPTS, GREEDY)
    weights = load_file(str(b / "model.safetensors"))
    name = next(n for n in weights if ".experts.1.down_proj." in n)
    assert get_weights_by_name(worker.model_runner, name, 4) == weights[name][:4].tolist()

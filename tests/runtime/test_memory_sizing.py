"""KV pool sizing from the memory free *before* loading, and the design notes' init order."""

from __future__ import annotations

import pytest
import torch

import harness
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.lora import lora_manager
from shardline_runtime.mem_cache.memory_pool import TokenToKVPool
from shardline_runtime.model_executor import model_runner as mr
from shardline_runtime.model_executor.device_graphs import DeviceGraphs
from shardline_runtime.model_executor.kv_pools import profile_max_num_token

GIB = 1 << 30
GPU = torch.device("cuda", 0)


@pytest.fixture
def gpu_with_30_gib_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 80 * GIB))


def test_gpu_token_budget_uses_pre_load_free_memory(gpu_with_30_gib_free):
    # 40 GiB were free before loading; weights + KV may take 80% of them: 30 - 40 * 0.2 = 22 GiB
    per_token = TokenToKVPool.bytes_per_token(2, 2, 16, torch.float32)
    assert profile_max_num_token(per_token, GPU, 40 * GIB, 0.8) == int(22 * GIB // per_token)


def test_gpu_token_budget_is_zero_when_nothing_is_left(gpu_with_30_gib_free):
    per_token = TokenToKVPool.bytes_per_token(2, 2, 16, torch.float32)
    assert profile_max_num_token(per_token, GPU, 200 * GIB, 0.8) == 0  # build_kv_pools raises KVCacheMemoryError


def test_gpu_token_budget_follows_the_kv_dtypes_bytes(gpu_with_30_gib_free):
    per_token = TokenToKVPool.bytes_per_token(2, 2, 16, torch.float8_e4m3fn)
    assert profile_max_num_token(per_token, GPU, 40 * GIB, 0.8) == int(22 * GIB // per_token)


def test_cpu_token_budget_is_the_cpu_kv_bytes():
    per_token = TokenToKVPool.bytes_per_token(2, 2, 16, torch.float32)
    assert profile_max_num_token(per_token, torch.device("cpu"), 0, 0.8, 1 << 20) == (1 << 20) // per_token


def test_init_order_follows_the_design_notes(tiny_checkpoint, monkeypatch):
    calls = []

    def spy(owner, name, label):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            calls.append(label)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    spy(mr.ModelRunner, "init_torch_distributed", "distributed")
    spy(mr, "Sampler", "sampler")
    spy(mr.ModelRunner, "load_model", "weights")
    spy(mr, "configure_kv_cache_dtype", "kv dtype")
    spy(lora_manager, "build_lora_manager", "lora")
    spy(mr, "build_kv_pools", "kv pools")
    spy(mr.ModelRunner, "init_attention_backend", "attention backend")
    monkeypatch.setattr(DeviceGraphs, "build", classmethod(
        lambda cls, runner, settings: calls.append("graphs") or cls(runner)))
    harness.make_runner(tiny_checkpoint("llama"))
    assert calls == ["distributed", "sampler", "weights", "kv dtype", "lora", "kv pools", "attention backend", "graphs"]


def test_stage_layers_of_a_pipeline_stage(tiny_checkpoint):
    from shardline_runtime.model_executor.kv_pools import stage_layers

    runner = harness.make_runner(tiny_checkpoint("llama", num_hidden_layers=3))
    assert stage_layers(runner.model_config, PipelineStage.for_rank(3, 1, 2)) == 1

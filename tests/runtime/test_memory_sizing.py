"""KV pool sizing from the memory free *before* loading, and the design notes' init order."""

from __future__ import annotations

import torch

import harness
from shardline_runtime.model_executor import model_runner as mr
from shardline_runtime.mem_cache.memory_pool import TokenToKVPool


def test_gpu_token_budget_uses_pre_load_free_memory(tiny_checkpoint, monkeypatch):
    runner = harness.make_runner(tiny_checkpoint("llama"))  # a real runner; pretend it sits on a GPU
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))
    monkeypatch.setattr(runner, "device", torch.device("cuda", 0))
    runner.config = mr.ModelRunnerConfig(model_path="m", mem_fraction_static=0.8, kv_cache_dtype="auto")
    mc = runner.model_config
    per_token = TokenToKVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, torch.float32)
    # 40 GiB were free before loading; weights + KV may take 80% of them: 30 - 40 * 0.2 = 22 GiB
    assert runner.profile_max_num_token(40 * gib) == int(22 * gib // per_token)
    assert runner.profile_max_num_token(200 * gib) == 0  # nothing left: the caller raises KVCacheMemoryError
    runner.kv_cache_dtype = torch.float8_e4m3fn  # the dtype's bytes per token
    assert runner.profile_max_num_token(40 * gib) == int(22 * gib // (per_token // 4))


def test_init_order_follows_the_design_notes(tiny_checkpoint, monkeypatch):
    calls = []
    for name in ("init_torch_distributed", "_make_sampler", "load_model", "configure_kv_cache_dtype", "init_memory_pool",
                 "init_attention_backend", "init_device_graphs", "init_piecewise_cuda_graphs"):
        original = getattr(mr.ModelRunner, name)

        def wrapped(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(mr.ModelRunner, name, wrapped)
    harness.make_runner(tiny_checkpoint("llama"))
    assert calls == ["init_torch_distributed", "_make_sampler", "load_model", "configure_kv_cache_dtype",
                     "init_memory_pool", "init_attention_backend", "init_device_graphs", "init_piecewise_cuda_graphs"]

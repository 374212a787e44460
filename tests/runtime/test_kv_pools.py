"""build_kv_pools alone: a ModelConfig, a stage, a dtype and the memory section in; KVPools out."""

from __future__ import annotations

import pytest
import torch

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.mem_cache.memory_pool import TokenToKVPool
from shardline_runtime.model_executor.kv_pools import KVCacheMemoryError, build_kv_pools
from shardline_runtime.server_args_sections import MemoryArgs

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def config(tiny_checkpoint) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_checkpoint("llama", num_hidden_layers=3), dtype="float32")


def per_token(config: ModelConfig, layers: int, dtype: torch.dtype) -> int:
    return TokenToKVPool.bytes_per_token(layers, config.num_key_value_heads, config.head_dim, dtype)


def build(config, memory=MemoryArgs(), stage=PipelineStage.for_rank(3, 0, 1), dtype=torch.float32, budget=1 << 20):
    return build_kv_pools(config, stage, dtype, memory, CPU, 1, budget, cpu_kv_cache_bytes=budget)


def test_cpu_tokens_are_the_budget_over_the_bytes_per_token(config):
    assert build(config).max_total_num_tokens == (1 << 20) // per_token(config, 3, torch.float32)


def test_max_total_tokens_sets_the_cpu_pool(config):
    assert build(config, MemoryArgs(max_total_tokens=100)).max_total_num_tokens == 100


def test_the_pool_holds_the_tokens_plus_the_dummy_slot(config):
    pools = build(config, MemoryArgs(max_total_tokens=100))
    assert pools.token_to_kv_pool.mem_usage_bytes() == 101 * per_token(config, 3, torch.float32)


def test_the_allocator_hands_out_every_token(config):
    pools = build(config, MemoryArgs(max_total_tokens=100))
    assert pools.token_to_kv_pool_allocator.available_size() == 100


def test_request_rows_are_max_running_requests_plus_the_padding_row(config):
    pools = build(config, MemoryArgs(max_total_tokens=100, max_running_requests=5))
    assert pools.req_to_token_pool.available_size() == 6


def test_an_fp8_cache_sizes_by_one_byte_per_element(config):
    fp8 = build(config, dtype=torch.float8_e4m3fn).max_total_num_tokens
    assert fp8 == (1 << 20) // (per_token(config, 3, torch.float32) // 4)


def test_the_result_names_the_cache_dtype(config):
    assert build(config, dtype=torch.float8_e5m2).kv_cache_dtype == torch.float8_e5m2


def test_a_later_pipeline_stage_sizes_for_its_own_layers(config):
    stage = PipelineStage.for_rank(3, 1, 2)  # one of the three layers
    pools = build(config, stage=stage)
    assert pools.max_total_num_tokens == (1 << 20) // per_token(config, 1, torch.float32)


def test_no_room_for_one_token_names_the_flags(config):
    with pytest.raises(KVCacheMemoryError, match="--mem-fraction-static .* or set --max-total-tokens"):
        build(config, budget=8)

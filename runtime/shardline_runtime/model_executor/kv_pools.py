"""The KV cache of one rank: its dtype, how many tokens fit, and the pools, built by one function
(after SGLang's ``kv_cache_builder.build_kv_cache(...)``, which returns a result object).

Sizing: on a GPU the KV cache gets what ``mem_fraction_static`` of the memory free *before* the
weights were loaded leaves after them; on the CPU ``--max-total-tokens`` or the
``cpu_kv_cache_bytes`` budget. Every rank takes the minimum over all ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from shardline_runtime import distributed
from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.mem_cache.memory_pool import (
    ReqToTokenPool,
    TokenToKVPool,
    TokenToKVPoolAllocator,
)
from shardline_runtime.server_args_sections import MemoryArgs

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 256 << 20  # the CPU budget without --max-total-tokens


class KVCacheMemoryError(RuntimeError):
    """There is no room for a KV cache of at least one request (names the knob to change)."""


@dataclass(frozen=True)
class KVPools:
    """What :func:`build_kv_pools` made: ``max_total_num_tokens`` KV slots (plus the dummy slot
    0) in ``token_to_kv_pool`` (``kv_cache_dtype``), their allocator, and ``req_to_token_pool``
    (``max_running_requests + 1`` rows; the extra one is the decode graphs' padding row)."""

    kv_cache_dtype: torch.dtype
    max_total_num_tokens: int
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator


def stage_layers(model_config: ModelConfig, stage: PipelineStage) -> int:
    """Decoder layers ``stage`` runs (all of them without pipeline parallelism)."""
    return stage.end(model_config.num_hidden_layers) - stage.start_layer


def memory_available(device: torch.device, cpu_kv_cache_bytes: int = CPU_KV_CACHE_BYTES) -> int:
    """Bytes free on ``device`` now (the GPU's free memory; on the CPU the KV budget)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return cpu_kv_cache_bytes


def profile_max_num_token(
    per_token_bytes: int,
    device: torch.device,
    pre_model_load_memory: int,
    mem_fraction_static: float,
    cpu_kv_cache_bytes: int = CPU_KV_CACHE_BYTES,
) -> int:
    """KV-cache tokens that fit on this rank (minimum over every rank of every stage: the
    schedulers of all ranks hand out the same slots, so every pool has the same size).

    GPU: ``free_now - pre_model_load_memory * (1 - mem_fraction_static)`` bytes, where
    ``pre_model_load_memory`` is the free memory measured before loading (SGLang's
    ``profile_max_num_token``): weights + KV cache take ``mem_fraction_static`` of what was
    free, whatever else shares the GPU. CPU: ``cpu_kv_cache_bytes``. Either is divided by
    ``per_token_bytes`` (one token of this stage's layers in the KV cache dtype).
    """
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        rest = free - pre_model_load_memory * (1.0 - mem_fraction_static)
    else:
        rest = cpu_kv_cache_bytes
    tokens = int(max(rest, 0) // per_token_bytes)
    return distributed.all_reduce_min_int(tokens)


def build_kv_pools(
    model_config: ModelConfig,
    stage: PipelineStage,
    kv_cache_dtype: torch.dtype,
    memory: MemoryArgs,
    device: torch.device,
    tp_size: int,
    pre_model_load_memory: int,
    *,
    cpu_kv_cache_bytes: int = CPU_KV_CACHE_BYTES,
    weight_bytes: int = 0,
    ranks: tuple[int, int] = (0, 0),
) -> KVPools:
    """Size and allocate the KV pools of one rank (every rank calls it together: the size is
    the minimum over all ranks).

    Args:
        kv_cache_dtype: the storage dtype (``kv_cache_dtype.resolve_kv_cache_dtype``).
        memory: ``mem_fraction_static``, ``max_total_tokens`` (caps the profiled size on a GPU;
            the size on the CPU) and ``max_running_requests``.
        pre_model_load_memory: bytes free before the weights were loaded.
        weight_bytes, ranks: this rank's weight bytes and (tp_rank, pp_rank), for the messages.

    Raises:
        KVCacheMemoryError: fewer than 1 token fits (names ``--mem-fraction-static`` /
            ``--max-total-tokens``).
    """
    per_token = TokenToKVPool.bytes_per_token(
        stage_layers(model_config, stage),
        model_config.get_num_kv_heads(tp_size),
        model_config.head_dim,
        kv_cache_dtype,
    )

    def profiled() -> int:
        return profile_max_num_token(
            per_token,
            device,
            pre_model_load_memory,
            memory.mem_fraction_static,
            cpu_kv_cache_bytes,
        )

    tokens = memory.max_total_tokens
    if tokens is None:
        tokens = profiled()
    elif device.type == "cuda":
        tokens = min(tokens, profiled())
    if tokens < 1:
        raise KVCacheMemoryError(
            f"no memory left for the KV cache after loading {weight_bytes / 2**20:.1f} MiB of weights "
            f"on tp rank {ranks[0]} (pp rank {ranks[1]}): raise --mem-fraction-static "
            f"(now {memory.mem_fraction_static}) or set --max-total-tokens"
        )
    kv_pool = TokenToKVPool(
        tokens,
        stage_layers(model_config, stage),
        model_config.get_num_kv_heads(tp_size),
        model_config.head_dim,
        kv_cache_dtype,
        device,
        start_layer=stage.start_layer,
    )
    logger.info(
        "[tp %d] KV cache: %d tokens, %s, %.1f MiB",
        ranks[0],
        tokens,
        kv_cache_dtype,
        kv_pool.mem_usage_bytes() / 2**20,
    )
    return KVPools(
        kv_cache_dtype=kv_cache_dtype,
        max_total_num_tokens=tokens,
        req_to_token_pool=ReqToTokenPool(
            size=memory.max_running_requests + 1,
            max_context_len=model_config.context_len + 4,
            device=device,
        ),
        token_to_kv_pool=kv_pool,
        token_to_kv_pool_allocator=TokenToKVPoolAllocator(tokens, device=device),
    )

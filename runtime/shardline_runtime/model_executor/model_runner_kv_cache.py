"""KV cache of a ModelRunner: its dtype, how many tokens fit, and the pools (SGLang's
``ModelRunnerKVCacheMixin``, which the design notes show ``ModelRunner`` built from).

Sizing: on a GPU the KV cache gets what ``mem_fraction_static`` of the memory free *before* the
weights were loaded leaves after them; on the CPU ``--max-total-tokens`` or the
``cpu_kv_cache_bytes`` budget. Every rank takes the minimum over the TP ranks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from shardline_runtime import distributed
from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.mem_cache.memory_pool import (
    ReqToTokenPool,
    TokenToKVPool,
    TokenToKVPoolAllocator,
)

if TYPE_CHECKING:
    from shardline_runtime.model_executor.model_runner_config import ModelRunnerConfig
    from shardline_runtime.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class KVCacheMemoryError(RuntimeError):
    """There is no room for a KV cache of at least one request (names the knob to change)."""


class ModelRunnerKVCacheMixin:
    """KV-cache methods of :class:`~shardline_runtime.model_executor.model_runner.ModelRunner`
    (reads ``config``, ``device``, ``model``, ``model_config``, ``tp_rank``, ``tp_size``,
    ``dtype``, ``weight_bytes``; sets ``kv_cache_dtype``, ``max_total_num_tokens`` and the pools)."""

    # Set by ModelRunner (declared here for the type checker).
    config: ModelRunnerConfig
    device: torch.device
    dtype: torch.dtype
    model: LlamaForCausalLM
    model_config: ModelConfig
    tp_rank: int
    tp_size: int
    pp_rank: int
    pipeline_stage: PipelineStage
    weight_bytes: int

    @property
    def num_stage_layers(self) -> int:
        """Decoder layers this rank runs (all of them without pipeline parallelism)."""
        return (
            self.pipeline_stage.end(self.model_config.num_hidden_layers)
            - self.pipeline_stage.start_layer
        )

    def _memory_available(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return self.config.cpu_kv_cache_bytes

    def configure_kv_cache_dtype(self) -> None:
        """Set ``kv_cache_dtype`` (``--kv-cache-dtype``) and, for fp8, each layer's K/V scales."""
        from shardline_runtime.model_executor.kv_cache_dtype import configure_kv_cache_dtype

        self.kv_cache_dtype = configure_kv_cache_dtype(
            self.model, self.model_config.model_path, self.config.kv_cache_dtype, self.dtype
        )

    def profile_max_num_token(self, pre_model_load_memory: int) -> int:
        """KV-cache tokens that fit on this rank (minimum over every rank of every stage: the
        schedulers of all ranks hand out the same slots, so every pool has the same size).

        GPU: ``free_now - pre_model_load_memory * (1 - mem_fraction_static)`` bytes, where
        ``pre_model_load_memory`` is the free memory measured before loading (SGLang's
        ``profile_max_num_token``): weights + KV cache take ``mem_fraction_static`` of what was
        free, whatever else shares the GPU. CPU: ``cpu_kv_cache_bytes``. Either is divided by the
        bytes one token takes on a rank in the KV cache dtype (this stage's layers only).
        """
        mc = self.model_config
        per_token = TokenToKVPool.bytes_per_token(
            self.num_stage_layers,
            mc.get_num_kv_heads(self.tp_size),
            mc.head_dim,
            self.kv_cache_dtype,
        )
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            rest = free - pre_model_load_memory * (1.0 - self.config.mem_fraction_static)
        else:
            rest = self.config.cpu_kv_cache_bytes
        tokens = int(max(rest, 0) // per_token)
        return distributed.all_reduce_min_int(tokens)

    def init_memory_pool(self, pre_model_load_memory: int) -> None:
        """Create ``req_to_token_pool``, ``token_to_kv_pool`` (in ``kv_cache_dtype``) and its allocator.

        Raises:
            KVCacheMemoryError: fewer than 1 token fits (names ``--mem-fraction-static`` /
                ``--max-total-tokens``).
        """
        mc = self.model_config
        if self.config.max_total_tokens is not None:
            tokens = self.config.max_total_tokens
            if self.device.type == "cuda":
                tokens = min(tokens, self.profile_max_num_token(pre_model_load_memory))
        else:
            tokens = self.profile_max_num_token(pre_model_load_memory)
        if tokens < 1:
            raise KVCacheMemoryError(
                f"no memory left for the KV cache after loading {self.weight_bytes / 2**20:.1f} MiB of weights "
                f"on tp rank {self.tp_rank} (pp rank {self.pp_rank}): raise --mem-fraction-static (now {self.config.mem_fraction_static}) "
                "or set --max-total-tokens"
            )
        self.max_total_num_tokens = tokens
        self.req_to_token_pool = ReqToTokenPool(
            size=self.config.max_running_requests + 1,
            max_context_len=mc.context_len + 4,
            device=self.device,
        )
        self.token_to_kv_pool = TokenToKVPool(
            tokens,
            self.num_stage_layers,
            mc.get_num_kv_heads(self.tp_size),
            mc.head_dim,
            self.kv_cache_dtype,
            self.device,
            start_layer=self.pipeline_stage.start_layer,
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(tokens, device=self.device)
        logger.info(
            "[tp %d] KV cache: %d tokens, %s, %.1f MiB",
            self.tp_rank,
            tokens,
            self.kv_cache_dtype,
            self.token_to_kv_pool.mem_usage_bytes() / 2**20,
        )

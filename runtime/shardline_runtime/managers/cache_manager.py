"""CacheManager: the KV a scheduler hands out (free pool slots, the prefix cache, request rows).

One object over the three pools the batching policy reads, so the policy takes one collaborator
instead of reaching into the scheduler: ``TokenToKVPoolAllocator`` (free KV slots),
``RadixCache`` (computed prefixes; unlocked entries can be evicted for room) and
``ReqToTokenPool`` (one row of KV slot indices per running request).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from shardline_runtime.mem_cache.radix_cache import RadixCache, TreeNode

if TYPE_CHECKING:
    from shardline_runtime.managers.req import Req


class CacheManager:
    """KV accounting for one scheduler rank.

    Args:
        allocator: the rank's KV slot allocator.
        req_to_token_pool: the rank's request rows.
        tree_cache: the prefix cache (a disabled one matches nothing and holds nothing).
        max_total_num_tokens: KV slots in the pool (for :meth:`used_tokens`).

    Attributes:
        on_release: called with a request's id and the row it held (None: it held none) each
            time :meth:`release` gives its KV back (finish, abort, retraction): a speculative
            proposer's per-request state goes with it.
    """

    def __init__(
        self,
        allocator: TokenToKVPoolAllocator,
        req_to_token_pool: ReqToTokenPool,
        tree_cache: RadixCache,
        max_total_num_tokens: int,
    ):
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.tree_cache = tree_cache
        self.max_total_num_tokens = max_total_num_tokens
        self.on_release: Callable[[str, int | None], None] | None = None

    def available_size(self) -> int:
        """KV slots a new step can get: free slots plus unlocked prefix-cache slots."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def free_rows(self) -> int:
        """Request rows not held by any request."""
        return self.req_to_token_pool.available_size()

    def used_tokens(self) -> int:
        """KV slots held by requests: everything not free and not reclaimable from the cache."""
        return self.max_total_num_tokens - self.available_size()

    def ensure_free(self, need: int) -> bool:
        """Evict prefix-cache entries until ``need`` slots are free; False if impossible."""
        short = need - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        return self.allocator.available_size() >= need

    def match_prefix(self, req: Req) -> tuple[torch.Tensor, TreeNode]:
        """The longest cached prefix ``req`` may reuse: (cached_len,) int64 KV slots and the
        node to lock. Prompt logprobs need their positions computed, so the key stops at
        ``logprob_start_len``; caller-given embeddings are not identified by their (placeholder)
        token ids, so such requests match nothing."""
        key = req.origin_input_ids + req.output_ids
        if req.return_logprob and req.logprob_start_len >= 0:
            key = key[: req.logprob_start_len]
        if req.input_embeds_positions is not None:
            key = []
        return self.tree_cache.match_prefix(key)

    def lock(self, req: Req, node: TreeNode) -> int:
        """Lock ``node`` (and its ancestors) for ``req``; returns how many slots stopped being
        evictable, which the caller must count as used."""
        evictable_before = self.tree_cache.evictable_size()
        self.tree_cache.inc_lock_ref(node)
        req.last_node = node
        req.tree_prefix_len = len(req.prefix_indices)
        return evictable_before - self.tree_cache.evictable_size()

    def release(self, req: Req) -> None:
        """Give back ``req``'s KV: insert its computed tokens into the prefix cache (the cache
        keeps one copy of each prefix, duplicates are freed), free its row, unlock its prefix."""
        held_row = req.req_pool_idx
        if req.req_pool_idx is not None:
            row, kv_len = req.req_pool_idx, req.kv_len
            tokens = (req.origin_input_ids + req.output_ids)[:kv_len]
            slots = self.req_to_token_pool.slots(row, 0, kv_len)  # host copy: no device read
            # KV of caller-given embeddings is not keyed by its (placeholder) token ids
            existing = (
                self.tree_cache.insert(tokens, slots)
                if req.input_embeds_positions is None
                else kv_len
            )
            if existing > req.tree_prefix_len:
                self.allocator.free(slots[req.tree_prefix_len : existing])
            self.req_to_token_pool.free(row)
            req.req_pool_idx, req.kv_len = None, 0
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
            req.last_node = None
        req.tree_prefix_len = 0
        req.prefix_indices = torch.zeros(0, dtype=torch.int64)
        if self.on_release is not None:
            self.on_release(req.rid, held_row)

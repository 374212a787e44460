"""SpeculativeDecoding: the scheduler's part of speculative decoding (``--speculative-algorithm``).

Each DECODE step of the running batch becomes, when drafts exist, a TARGET_VERIFY step:

1. :meth:`SpeculativeDecoding.prepare` asks the proposer for each request's drafts (at most
   ``num_draft_tokens - 1``, and never past ``max_new_tokens`` or the request length limit),
   allocates ``1 + k_i`` KV slots per request and lays the batch out as an EXTEND after each
   request's cached sequence: its last token, then its drafts (:func:`prepare_for_verify`).
2. The worker runs one target forward over every token and keeps the accepted ones
   (``model_executor/verify_step.py``).
3. ``ResultProcessor`` appends the kept tokens one at a time (stopping at a finish), then
   :meth:`SpeculativeDecoding.free_rejected` frees the KV slots of rejected drafts (and of the
   tokens after a finish), so ``kv_len`` is again ``len(tokens) - 1`` as after a DECODE step.

A step stays a plain DECODE when no request got a draft, when a request has penalties (their
counts change inside the chain), when a request has a grammar (constrained decoding: drafts are
not checked against it, and a verify step applies no token mask), or when the KV slots for the drafts cannot be had (DECODE's own
retraction then applies). The overlap scheduler is off with speculation: the next step's inputs
depend on how many tokens this step kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shardline_runtime.managers.cache_manager import CacheManager
from shardline_runtime.managers.req import Req
from shardline_runtime.managers.schedule_batch import KVCacheFullError, ScheduleBatch
from shardline_runtime.model_executor.forward_batch_info import ForwardMode
from shardline_runtime.speculative.proposer import Proposer


@dataclass
class SpeculativeStats:
    """Cumulative counts since start.

    Attributes:
        verify_steps: TARGET_VERIFY forwards run.
        verify_rows: request rows verified (a request in one verify step counts once).
        draft_tokens: draft tokens proposed and scored.
        accepted_tokens: draft tokens kept.
    """

    verify_steps: int = 0
    verify_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def snapshot(self) -> SpeculativeStats:
        """A copy (the scheduler sends one with its stats; this one keeps counting)."""
        return replace(self)

    @property
    def acceptance_rate(self) -> float:
        """Kept draft tokens / proposed draft tokens, in [0, 1] (0 before any draft)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gains per verify step (kept drafts + 1; SGLang's accept length)."""
        return (
            (self.accepted_tokens + self.verify_rows) / self.verify_rows
            if self.verify_rows
            else 0.0
        )


def prepare_for_verify(batch: ScheduleBatch, drafts: list[list[int]]) -> None:
    """Lay ``batch`` out as TARGET_VERIFY: per request its last token then ``drafts[i]``,
    ``1 + len(drafts[i])`` new KV slots written at ``kv_len ..``; advances ``kv_len``.

    Raises:
        KVCacheFullError: fewer free KV slots than tokens (nothing is allocated then).
        ValueError: a request whose last token's KV is already written (not a decode row).
    """
    reqs = batch.reqs
    counts = [1 + len(d) for d in drafts]
    allocator = batch.token_to_kv_pool_allocator
    slots = allocator.alloc(sum(counts))
    if slots is None:
        raise KVCacheFullError(f"need {sum(counts)} KV slots, {allocator.available_size()} free")
    slots = slots.cpu()
    input_ids: list[int] = []
    prefix_lens: list[int] = []
    offset = 0
    for req, draft, n in zip(reqs, drafts, counts):
        tokens = req.origin_input_ids + req.output_ids
        if req.kv_len != len(tokens) - 1:
            raise ValueError(f"request {req.rid}: kv_len {req.kv_len}, {len(tokens)} tokens")
        input_ids += [tokens[-1], *draft]
        batch.req_to_token_pool.write(
            (req.row, slice(req.kv_len, req.kv_len + n)), slots[offset : offset + n]
        )
        prefix_lens.append(req.kv_len)
        req.kv_len += n
        offset += n
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    batch.input_ids = input_ids
    batch.out_cache_loc = slots
    batch.req_pool_indices = [r.row for r in reqs]
    batch.seq_lens = [r.kv_len for r in reqs]
    batch.prefix_lens = prefix_lens
    batch.extend_lens = counts


class SpeculativeDecoding:
    """Drafts for the running batch, and the KV bookkeeping of verify steps.

    Args:
        proposer: the algorithm's :class:`Proposer`.
        max_draft_tokens: drafts per request per step (``num_draft_tokens - 1``).
        max_req_len: the worker's limit on prompt + output tokens.
        cache: the rank's :class:`CacheManager`.
    """

    def __init__(
        self, proposer: Proposer, max_draft_tokens: int, max_req_len: int, cache: CacheManager
    ):
        self.proposer = proposer
        self.max_draft_tokens = max_draft_tokens
        self.max_req_len = max_req_len
        self.cache = cache
        cache.on_release = proposer.release
        self.stats = SpeculativeStats()

    def draft_budget(self, req: Req) -> int:
        """The most drafts ``req`` may verify this step: its kept tokens (up to ``k + 1``) must
        stay within ``max_new_tokens`` and ``max_req_len``."""
        length = len(req.origin_input_ids) + len(req.output_ids)
        budget = min(self.max_draft_tokens, self.max_req_len - length - 1)
        limit = req.sampling_params.max_new_tokens
        if limit is not None:
            budget = min(budget, limit - len(req.output_ids) - 1)
        return max(budget, 0)

    def prepare(self, batch: ScheduleBatch) -> bool:
        """Make ``batch`` a TARGET_VERIFY step when it is worth it; False leaves it to DECODE."""
        reqs = batch.reqs
        rids = [r.rid for r in reqs]
        if batch.sampling_info is None or batch.sampling_info.penalties is not None:
            return False
        if any(r.grammar is not None for r in reqs):
            return False
        budgets = [self.draft_budget(r) for r in reqs]
        proposal = self.proposer.propose(
            [r.origin_input_ids + r.output_ids for r in reqs], budgets, rids, [r.row for r in reqs]
        )
        drafts = [list(d[:b]) for d, b in zip(proposal.draft_ids, budgets)]
        if not any(drafts) or not self.cache.ensure_free(sum(1 + len(d) for d in drafts)):
            return False
        prepare_for_verify(batch, drafts)
        return True

    def free_rejected(self, batch: ScheduleBatch, kept: list[list[int]]) -> None:
        """After the kept tokens were appended: free each request's KV slots past
        ``len(tokens) - 1`` (rejected drafts; tokens after a finish) and count the step."""
        stats = self.stats
        stats.verify_steps += 1
        for req, prefix, n, ids in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, kept):
            stats.verify_rows += 1
            stats.draft_tokens += n - 1
            stats.accepted_tokens += len(ids) - 1
            if req.req_pool_idx is None:
                continue
            self.proposer.keep(req.rid, req.origin_input_ids + req.output_ids)
            keep = min(req.kv_len, len(req.origin_input_ids) + len(req.output_ids) - 1)
            if keep < req.kv_len:
                slots = self.cache.req_to_token_pool.req_to_token[req.row, keep : req.kv_len]
                self.cache.allocator.free(torch.as_tensor(slots).clone())
                req.kv_len = keep
            assert keep >= prefix, "a verify step keeps at least the last token's KV"

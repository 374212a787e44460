"""Scheduler result handling: append sampled tokens, finish requests, stream outputs, push stats.

After a step every rank appends the same sampled ids (identical on every rank by construction of
the sampler), checks the finish conditions, returns finished requests' KV (to the prefix cache)
and moves a finished EXTEND batch into the running batch. With overlap scheduling
(``managers/overlap.py``) this runs one step late: the in-flight bookkeeping is here too. Rank 0 then sends one
``BatchTokenOut`` (``token_out.build_token_outs``): a ``TokenOut`` per request that advanced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardline_runtime.managers.io_struct import (
    BatchTokenOut,
    SchedulerStats,
    TokenizedGenerateReqInput,
)
from shardline_runtime.managers.token_out import build_token_outs, unscheduled_token_out

if TYPE_CHECKING:
    from shardline_runtime.managers.cache_manager import CacheManager
    from shardline_runtime.managers.decode_manager import DecodeManager
    from shardline_runtime.managers.overlap import InFlightStep
    from shardline_runtime.managers.prefill_manager import PrefillManager
    from shardline_runtime.managers.schedule_batch import ScheduleBatch
    from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from shardline_runtime.mem_cache.radix_cache import RadixCache

logger = logging.getLogger(__name__)


class SchedulerOutputMixin:
    """Result processing for :class:`~shardline_runtime.managers.scheduler.Scheduler`."""

    # Set by Scheduler.__init__ (declared here for the type checker).
    tp_rank: int
    max_req_len: int
    max_total_num_tokens: int
    cache: CacheManager
    tree_cache: RadixCache
    prefill_manager: PrefillManager
    decode_manager: DecodeManager
    send_socket: Any
    last_stats: tuple | None
    send: Callable[[Any], None]
    allocator: TokenToKVPoolAllocator
    req_to_token_pool: ReqToTokenPool
    in_flight: InFlightStep | None
    running_batches: Callable[[], list[ScheduleBatch]]

    def process_batch_result(self, batch, result, snapshot: bool = False) -> None:
        """Append the step's tokens, finish requests, move an EXTEND batch into the running batch
        and stream the news.

        Args:
            batch: the batch that ran.
            result: its ``GenerationBatchResult``, on the host (``wait()`` done).
            snapshot: (overlap) ``batch`` is a copy of the rows as launched, whose requests are
                in the running batch already (``join_in_flight_extend``); finished ones are
                dropped from the running batch instead.

        Requests finished before this result (aborted while a pipeline micro-batch was in flight,
        or, with overlap, finished by the step before, this row's token then being discarded)
        are skipped. With overlap ``self.in_flight`` is the step launched after this one.
        """
        next_ids = result.next_token_ids.tolist()
        done_before = {id(req) for req in batch.reqs if req.finished()}
        if batch.forward_mode.is_extend():
            self._collect_prompt_logprobs(batch, result)
        for i, req in enumerate(batch.reqs):
            if req is batch.chunked_req or id(req) in done_before:
                continue  # an intermediate chunk samples nothing
            if req.wants_token and next_ids[i] >= 0:
                top = result.next_token_top_logprobs[i] if req.top_logprobs_num else None
                req.append_output(
                    next_ids[i], result.next_token_logprobs[i] if req.return_logprob else None, top
                )
            req.check_finished(self.max_req_len)
        finished = [r for r in batch.reqs if r.finished() and id(r) not in done_before]
        for req in finished:
            self._release_finished(req)
        streamed = [r for r in batch.reqs if id(r) not in done_before]
        if snapshot:
            if self.decode_manager.running_batch is not None:
                self.decode_manager.running_batch.filter_batch()
        elif batch.forward_mode.is_extend():
            keep = [
                i
                for i, r in enumerate(batch.reqs)
                if not r.finished() and r is not batch.chunked_req
            ]
            batch.filter_batch(keep)
            batch.chunked_req = None  # it now decodes; the chunked request stayed out of it
            self.decode_manager.add(batch)
        else:
            batch.filter_batch()  # a decode step's batch is the running batch (of its micro-batch slot)
        self.stream_output(streamed)

    def _release_finished(self, req) -> None:
        """Release a finished request. When the step in flight (overlap) computes one more
        (discarded) token for it, that token's KV slot stays out of the prefix cache and is
        freed once that step has completed."""
        step = getattr(self, "in_flight", None)
        if step is not None and req.req_pool_idx is not None and step.holds(req):
            req.kv_len -= 1
            step.deferred_free.append(
                self.req_to_token_pool.req_to_token[
                    req.req_pool_idx, req.kv_len : req.kv_len + 1
                ].clone()
            )
        self.cache.release(req)

    def drain_in_flight(self) -> bool:
        """(Overlap) Wait for the step in flight and process its result; False when none is."""
        step, self.in_flight = getattr(self, "in_flight", None), None
        if step is None:
            return False
        self._process_step(step)
        return True

    def _process_step(self, step) -> None:
        result = step.result.wait()
        self.join_extend(step)
        self.process_batch_result(step.rows, result, snapshot=True)
        for slots in step.deferred_free:
            self.allocator.free(slots)

    def join_in_flight_extend(self) -> None:
        """(Overlap) Requests of the EXTEND step in flight that will decode join the running
        batch now, before their first token is known (their next input is a placeholder)."""
        if self.in_flight is not None:
            self.join_extend(self.in_flight)

    def join_extend(self, step) -> None:
        """Move the requests of ``step``'s EXTEND batch that will decode into the running batch
        (once): not the chunked request, not prefill-only ones, not finished ones (a mixed step
        can hold requests the step before finished)."""
        batch = step.batch
        if step.joined_running or not batch.forward_mode.is_extend():
            return
        step.joined_running = True
        batch.filter_batch(
            [
                i
                for i, r in enumerate(batch.reqs)
                if r is not batch.chunked_req
                and r.sampling_params.max_new_tokens != 0
                and not r.finished()
            ]
        )
        batch.chunked_req = None
        self.decode_manager.add(batch)

    def _collect_prompt_logprobs(self, batch, result) -> None:
        out = result.logits_output
        fb = result.forward_batch
        starts = fb.extend_logprob_start_lens_cpu
        for i, req in enumerate(batch.reqs):
            if not req.return_logprob or req.logprob_start_len < 0 or req.input_logprobs_sent:
                continue
            prefix, extend = batch.prefix_lens[i], batch.extend_lens[i]
            full = req.origin_input_ids
            if prefix >= len(full):
                continue  # a decode row of a mixed batch
            s = starts[i] if starts else 0
            if out.input_token_logprobs is not None:
                values = out.input_token_logprobs[i].tolist()
                tops = None
                if (
                    out.input_top_logprobs_val is not None
                    and out.input_top_logprobs_idx is not None
                    and req.top_logprobs_num
                ):
                    tops = list(
                        zip(
                            out.input_top_logprobs_val[i].tolist(),
                            out.input_top_logprobs_idx[i].tolist(),
                        )
                    )
                for j, value in enumerate(values):
                    pos = prefix + s + 1 + j
                    top = list(zip(*tops[j])) if tops else []
                    req.prompt_logprobs.append((pos, value, top))
            end = prefix + extend
            if req is batch.chunked_req and end < len(full):
                logprobs = torch.log_softmax(out.next_token_logits[i].float(), dim=-1)
                top = []
                if req.top_logprobs_num:
                    v, idx = logprobs.topk(req.top_logprobs_num)
                    top = list(zip(v.tolist(), idx.tolist()))
                req.prompt_logprobs.append((end, float(logprobs[full[end]]), top))

    def stream_output(self, reqs) -> None:
        """Rank 0: send new tokens / finish reasons of ``reqs`` to the HTTP process."""
        if self.send_socket is None:
            return
        outs = build_token_outs(reqs)
        if outs:
            self.send(BatchTokenOut(outs))

    def finish_unscheduled(self, msg: TokenizedGenerateReqInput, n: int, message: str) -> None:
        """Answer a request that can never run (the HTTP process validates first; defensive)."""
        logger.warning("[tp %d] rejecting %s: %s", self.tp_rank, msg.rid, message)
        self.send(BatchTokenOut([unscheduled_token_out(msg, message)]))

    def kv_used_tokens(self) -> int:
        """KV slots held by requests: everything not free and not reclaimable from the cache."""
        return self.cache.used_tokens()

    def send_stats(self) -> None:
        """Rank 0: push ``SchedulerStats`` to the HTTP process when they changed."""
        if self.send_socket is None:
            return
        running = sum(sum(not r.finished() for r in batch.reqs) for batch in self.running_batches())
        queued = len(self.prefill_manager.waiting_queue) + (
            1 if self.prefill_manager.chunked_req is not None else 0
        )
        stats = (running, queued, self.kv_used_tokens(), self.tree_cache.evictable_size())
        if stats != self.last_stats:
            self.last_stats = stats
            self.send(SchedulerStats(*stats, self.max_total_num_tokens))

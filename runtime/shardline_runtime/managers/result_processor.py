"""Result handling: append sampled tokens, finish requests, free their KV, stream the news.

After a step every rank appends the same sampled ids (identical on every rank by construction of
the sampler), checks the finish conditions, returns finished requests' KV (to the prefix cache)
and moves a finished EXTEND batch into the running batch of its :class:`DecodeManager`. Rank 0
then sends the new tokens through the :class:`OutputSender`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardline_runtime.configs.pooling_config import PoolingConfig
from shardline_runtime.layers.pooler import PoolingAccumulator
from shardline_runtime.managers.cache_manager import CacheManager
from shardline_runtime.managers.decode_manager import DecodeManager
from shardline_runtime.managers.req import Req
from shardline_runtime.managers.schedule_batch import ScheduleBatch
from shardline_runtime.managers.scheduler_output import OutputSender
from shardline_runtime.managers.speculative_step import SpeculativeDecoding
from shardline_runtime.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    from shardline_runtime.managers.overlap import InFlightStep
    from shardline_runtime.model_executor.generation_result import GenerationBatchResult


class ResultProcessor:
    """Turns a step's result into request progress.

    Args:
        cache: the rank's :class:`CacheManager` (finished requests' KV goes back through it).
        decode_manager: where a finished EXTEND batch's requests go to decode (a pipeline loop
            passes its micro-batch slot's manager to :meth:`process` instead).
        max_req_len: the worker's limit on prompt + output tokens (a finish condition).
        sender: rank 0's :class:`OutputSender`.
        speculative: with speculation, frees the KV of rejected drafts after a TARGET_VERIFY
            step (whose requests gain one or more tokens each).
        pooling: an embedding model's pooling: each EXTEND step's pooled partials are folded
            into their requests, whose ``embedding`` is set after the last chunk.
    """

    def __init__(
        self,
        cache: CacheManager,
        decode_manager: DecodeManager,
        max_req_len: int,
        sender: OutputSender,
        speculative: SpeculativeDecoding | None = None,
        pooling: PoolingConfig | None = None,
    ):
        self.speculative = speculative
        self.pooling = pooling
        self.cache = cache
        self.decode_manager = decode_manager
        self.max_req_len = max_req_len
        self.sender = sender

    def process(
        self,
        batch: ScheduleBatch,
        result: GenerationBatchResult,
        decode: DecodeManager | None = None,
        snapshot: bool = False,
        in_flight: InFlightStep | None = None,
    ) -> None:
        """Append the step's tokens, finish requests, move an EXTEND batch into the running batch
        and stream the news.

        Args:
            batch: the batch that ran.
            result: its ``GenerationBatchResult``, on the host (``wait()`` done).
            decode: the decode manager of the batch's micro-batch slot (default: the one given
                at construction).
            snapshot: (overlap) ``batch`` is a copy of the rows as launched, whose requests are
                in the running batch already (``OverlapSteps.join``); finished ones are dropped
                from the running batch instead.
            in_flight: (overlap) the step launched after this one, which may be computing one
                more (discarded) token for a request finished here.

        Requests finished before this result (aborted while a pipeline micro-batch was in flight,
        or, with overlap, finished by the step before, this row's token then being discarded)
        are skipped.
        """
        decode = decode or self.decode_manager
        next_ids = result.next_ids_list()
        # finished_reason read directly in the per-request loops: no call per request per step
        done_before = {id(req) for req in batch.reqs if req.finished_reason is not None}
        mode = batch.forward_mode
        verify = mode is ForwardMode.TARGET_VERIFY
        extend = mode.is_extend() and not verify
        if extend:
            collect_prompt_logprobs(batch, result)
        if result.pooled is not None and self.pooling is not None:
            collect_pooled(batch, result.pooled, self.pooling, done_before)
        for i, req in enumerate(batch.reqs):
            if req is batch.chunked_req or id(req) in done_before:
                continue  # an intermediate chunk samples nothing
            if verify:
                append_kept_tokens(req, i, result, self.max_req_len)
                continue
            if req.wants_token and next_ids[i] >= 0:
                top = result.next_token_top_logprobs[i] if req.top_logprobs_num else None
                req.append_output(
                    next_ids[i], result.next_token_logprobs[i] if req.return_logprob else None, top
                )
                if req.grammar is not None:
                    req.advance_grammar(next_ids[i])
            req.check_finished(self.max_req_len)
        if verify and self.speculative is not None:
            self.speculative.free_rejected(batch, result.accepted_ids or [])
        for req in batch.reqs:
            if req.finished_reason is not None and id(req) not in done_before:
                self.release_finished(req, in_flight)
        streamed = [r for r in batch.reqs if id(r) not in done_before]
        if snapshot:
            if decode.running_batch is not None:
                decode.running_batch.filter_batch()
        elif extend:
            keep = [
                i
                for i, r in enumerate(batch.reqs)
                if not r.finished() and r is not batch.chunked_req
            ]
            batch.filter_batch(keep)
            batch.chunked_req = None  # it now decodes; the chunked request stayed out of it
            decode.add(batch)
        else:
            batch.filter_batch()  # a decode step's batch is its slot's running batch
        self.sender.stream(streamed)

    def release_finished(self, req: Req, in_flight: InFlightStep | None = None) -> None:
        """Release a finished request. When ``in_flight`` (overlap) computes one more (discarded)
        token for it, that token's KV slot stays out of the prefix cache and is freed once that
        step has completed."""
        if in_flight is not None and req.req_pool_idx is not None and in_flight.holds(req):
            req.kv_len -= 1
            in_flight.deferred_free.append(
                self.cache.req_to_token_pool.slots(req.req_pool_idx, req.kv_len, req.kv_len + 1)
            )
        self.cache.release(req)


def append_kept_tokens(req: Req, row: int, result: GenerationBatchResult, max_req_len: int) -> None:
    """Append the tokens a TARGET_VERIFY step kept for batch row ``row``, one at a time,
    stopping at the first that finishes the request (EOS, stop token, a length limit)."""
    ids = (result.accepted_ids or [])[row]
    logprobs = result.accepted_logprobs[row] if result.accepted_logprobs else []
    tops = result.accepted_top_logprobs[row] if result.accepted_top_logprobs else []
    for j, token in enumerate(ids):
        logprob = logprobs[j] if req.return_logprob and j < len(logprobs) else None
        top = tops[j] if req.top_logprobs_num and j < len(tops) else None
        req.append_output(token, logprob, top)
        req.check_finished(max_req_len)
        if req.finished():
            return


def collect_prompt_logprobs(batch: ScheduleBatch, result: GenerationBatchResult) -> None:
    """Append the prompt logprobs an EXTEND step computed to each asking request's
    ``prompt_logprobs`` as ``(position, logprob, top)``."""
    if not any(r.return_logprob and r.logprob_start_len >= 0 for r in batch.reqs):
        return
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


def collect_pooled(
    batch: ScheduleBatch, pooled: torch.Tensor, pooling: PoolingConfig, done_before: set[int]
) -> None:
    """Fold an EXTEND step's pooled partials ((bs, hidden) float32, host) into each request's
    accumulator (intermediate chunks included); a request whose last chunk ran gets its
    ``embedding``."""
    for i, req in enumerate(batch.reqs):
        if id(req) in done_before:
            continue
        if req.pooling is None:
            req.pooling = PoolingAccumulator(pooling.pooling_type, pooling.normalize)
        req.pooling.add(pooled[i], batch.extend_lens[i])
        if req is not batch.chunked_req:
            req.embedding = req.pooling.embedding()

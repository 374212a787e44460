"""Batching policy of the Scheduler: admission, chunked prefill, prefix cache, KV budget, retraction.

Policy (first come, first served, as SGLang's default ``fcfs``):

- A step runs an EXTEND batch when requests wait (the continuing chunk of a chunked prefill
  first), else a DECODE step of the running batch; a finished EXTEND joins the running batch,
  so new requests enter decoding while others are mid-generation (continuous batching).
- Admission stops at ``max_running_requests`` (all pipeline micro-batch slots together, and
  ``max(max_running_requests // slots, 1)`` per slot), at ``max_prefill_tokens`` prompt tokens per
  step, and when the KV pool (free + evictable prefix-cache slots) cannot hold the new tokens
  plus a reserve for the running requests' future tokens (``new_token_ratio`` x their remaining
  ``max_new_tokens``, as SGLang estimates it; the ratio rises after a retraction and decays).
- A prompt longer than ``chunked_prefill_size`` is prefilled one chunk per step; only the last
  chunk samples a token.
- The prefix cache is matched at admission (``cached_len``); a request's tokens are inserted when
  it finishes, so later requests with the same prefix reuse the KV.
- With ``--enable-mixed-chunk`` the running requests decode in the same forward as a prefill
  (each as an extend of one token), as SGLang's mixed chunk.
- When a DECODE step cannot get one slot per request even after evicting the cache, the most
  recently admitted requests are retracted: their KV freed, they go back to the front of the
  queue keeping their output tokens, and are re-prefilled later (exact continuation).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_MIN_NEW_TOKEN_RATIO = 0.1
_NEW_TOKEN_RATIO_DECAY = 0.002


def _is_partial(req) -> bool:
    """Before ``prepare_for_extend``: this round computes only part of the sequence (a chunk)."""
    return len(req.fill_ids) < len(req.origin_input_ids) + len(req.output_ids)


class SchedulerPolicyMixin:
    """Batch selection for :class:`~shardline_runtime.managers.scheduler.Scheduler`."""

    # ------------------------------------------------------------------ KV accounting

    def available_kv(self) -> int:
        """KV slots a new step can get: free slots plus unlocked prefix-cache slots."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def ensure_free_slots(self, need: int) -> bool:
        """Evict prefix-cache entries until ``need`` slots are free; False if impossible."""
        short = need - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        return self.allocator.available_size() >= need

    def release_req(self, req) -> None:
        """Give back ``req``'s KV: insert its computed tokens into the prefix cache (the cache
        keeps one copy of each prefix, duplicates are freed), free its row, unlock its prefix."""
        if req.req_pool_idx is not None:
            row, kv_len = req.req_pool_idx, req.kv_len
            tokens = (req.origin_input_ids + req.output_ids)[:kv_len]
            slots = self.req_to_token_pool.req_to_token[row, :kv_len].clone().cpu()
            # KV of caller-given embeddings is not keyed by its (placeholder) token ids
            existing = self.tree_cache.insert(tokens, slots) if req.input_embeds_positions is None else kv_len
            if existing > req.tree_prefix_len:
                self.allocator.free(slots[req.tree_prefix_len : existing])
            self.req_to_token_pool.free(row)
            req.req_pool_idx, req.kv_len = None, 0
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
            req.last_node = None
        req.tree_prefix_len = 0
        req.prefix_indices = torch.zeros(0, dtype=torch.int64)

    # ------------------------------------------------------------------ next batch

    def get_next_batch_to_run(self):
        if self.generation_blocked():  # paused, or memory released: no forward at all
            return None
        # A pending weight update pauses admission, but a started chunked prefill must finish,
        # and so must requests retracted after they began generating on the old weights (else
        # they would end on the new ones: one response, two revisions).
        batch = self.get_new_batch_prefill(started_only=self.pending_update is not None)
        if batch is not None:
            running = self.running_batch
            if (self.server_args.enable_mixed_chunk and running is not None and not running.is_empty()
                    and self.ensure_free_slots(running.batch_size)):
                # the running requests decode inside this EXTEND; the mixed batch replaces them
                batch.mix_with_running(running)
                self.running_batch = None
            return batch
        return self.update_running_batch()

    def _reserved_tokens(self) -> int:
        reqs = [req for batch in self.running_batches() for req in batch.reqs if not req.finished()]
        return sum(
            int(min(r.sampling_params.max_new_tokens - len(r.output_ids), self.max_req_len) * self.new_token_ratio)
            for r in reqs
        )

    def get_new_batch_prefill(self, admit_new: bool = True, started_only: bool = False):
        """Form an EXTEND batch from the chunked request and (when ``admit_new``) the waiting
        queue, or None. ``started_only`` admits only requests that already have output tokens
        (retracted ones), in queue order."""
        # --max-running-requests caps every running batch together: with pipeline parallelism the
        # other micro-batch slots' and the batches still in flight through the stages count too.
        # Each slot also takes at most max(max_running_requests // slots, 1), as SGLang's
        # pp_max_micro_batch_size, so one slot cannot take them all and leave the stages idle.
        running = len({id(r) for b in self.running_batches() for r in b.reqs if r is not self.chunked_req})
        slot_running = 0 if self.running_batch is None else self.running_batch.batch_size
        per_slot = max(self.max_running_requests // len(self.running_mbs or [None]), 1)
        if self.chunked_req is None and (not self.waiting_queue or not admit_new):
            return None
        budget_tokens = self.max_prefill_tokens
        kv_left = self.available_kv() - self._reserved_tokens()
        chunk = min(self.chunked_prefill_size or budget_tokens, budget_tokens)
        admitted = []
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            req.init_next_round_input(None, chunk)
            budget_tokens -= req.extend_input_len
            kv_left -= req.extend_input_len
            admitted.append(req)
            if _is_partial(req):
                self.chunked_req = req
        while admit_new and self.waiting_queue and self.chunked_req is None:
            if (running + len(admitted) >= self.max_running_requests or slot_running + len(admitted) >= per_slot
                    or budget_tokens <= 0):
                break
            if len(admitted) >= self.req_to_token_pool.available_size():
                break
            req = self.waiting_queue[0]
            if started_only and not req.output_ids:
                break
            full = req.origin_input_ids + req.output_ids
            key = full
            if req.return_logprob and req.logprob_start_len >= 0:
                key = full[: req.logprob_start_len]  # prompt logprobs need those positions computed
            if req.input_embeds_positions is not None:
                key = []  # caller-given embeddings: the token ids do not identify the KV
            prefix, node = self.tree_cache.match_prefix(key)
            req.init_next_round_input(prefix, min(chunk, budget_tokens))
            remaining_out = req.sampling_params.max_new_tokens - len(req.output_ids)
            need = req.extend_input_len + int(min(remaining_out, self.max_req_len) * self.new_token_ratio)
            if need > kv_left and admitted:
                break
            if req.extend_input_len > kv_left + (0 if admitted else self._reserved_tokens()):
                break  # not even the prompt fits now: wait for running requests to finish
            self.waiting_queue.popleft()
            evictable_before = self.tree_cache.evictable_size()
            self.tree_cache.inc_lock_ref(node)
            req.last_node = node
            req.tree_prefix_len = len(req.prefix_indices)
            if not req.output_ids:  # first admission (a retracted request keeps its count)
                req.cached_tokens = req.tree_prefix_len
            budget_tokens -= req.extend_input_len
            kv_left -= need + (evictable_before - self.tree_cache.evictable_size())
            admitted.append(req)
            if _is_partial(req):
                self.chunked_req = req
        if not admitted:
            return None
        total = sum(r.extend_input_len for r in admitted)
        if not self.ensure_free_slots(total):
            # Put them back untouched (locks released) and let decode free memory first.
            for req in reversed(admitted):
                if req is self.chunked_req:
                    self.chunked_req = None
                if req.req_pool_idx is None:
                    self.release_req(req)
                    self.waiting_queue.appendleft(req)
                else:
                    self.chunked_req = req
            return None
        batch = self.new_batch(admitted)
        batch.chunked_req = self.chunked_req
        batch.prepare_for_extend()
        return batch

    def update_running_batch(self):
        """Prepare a DECODE step of the running batch (retracting requests if KV is short)."""
        batch = self.running_batch
        if batch is None or batch.is_empty():
            return None
        self.new_token_ratio = max(_MIN_NEW_TOKEN_RATIO, self.new_token_ratio - _NEW_TOKEN_RATIO_DECAY)
        while not self.ensure_free_slots(batch.batch_size):
            if self.drain_in_flight():
                continue  # overlap: the step in flight may finish requests (and retraction needs settled state)
            if batch.batch_size == 1:
                # One request alone cannot grow: it is at the pool size (max_req_len clips it
                # before that, so this is defensive).
                req = batch.reqs[0]
                req.finished_reason = self._length_reason()
                self.release_req(req)
                batch.filter_batch()
                self.stream_output([req])
                return None
            self.retract_one(batch)
        if batch.is_empty():
            return None
        batch.prepare_for_decode()
        return batch

    def retract_one(self, batch) -> None:
        """Preempt the most recently admitted request: free its KV and requeue it first."""
        victim = len(batch.reqs) - 1
        req = batch.reqs[victim]
        self.release_req(req)
        batch.filter_batch([i for i in range(batch.batch_size) if i != victim])
        self.waiting_queue.appendleft(req)
        self.num_retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.info("[tp %d] retracted request %s (%d output tokens kept)", self.tp_rank, req.rid, len(req.output_ids))

    def _length_reason(self):
        from shardline_runtime.managers.req import FinishReason

        return FinishReason("length", self.max_req_len)

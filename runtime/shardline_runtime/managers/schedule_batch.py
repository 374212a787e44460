"""ScheduleBatch: the scheduler-side (CPU) view of a batch, after SGLang (``Req`` is in ``req.py``).

A ``ScheduleBatch`` owns the bookkeeping of one step: it takes request rows from
``ReqToTokenPool`` and KV slots from ``TokenToKVPoolAllocator``, writes ``req_to_token`` and then
produces the ``ModelWorkerBatch`` the worker runs (:meth:`ScheduleBatch.get_model_worker_batch`).

Life of a batch:
  1. ``ScheduleBatch.init_new(reqs, worker)`` then ``prepare_for_extend()``: each request's new
     tokens ``fill_ids[cached_len:]`` get KV slots; a cached prefix (``req.prefix_indices``, from
     the prefix cache or an earlier chunk) is reused, not recomputed.
  2. Optionally ``mix_with_running(running_batch)``: the running requests join this EXTEND step
     with one new token each (an extend of length 1 after their whole sequence), so prefill and
     decode share one forward.  The mixed batch then *is* the running batch.
  3. After sampling, the caller appends tokens (``Req.append_output``), calls
     ``Req.check_finished``, frees finished requests (:meth:`release_kv`) and drops them
     (:meth:`filter_batch`); ``merge_batch`` adds a freshly prefilled batch to the running one.
  4. ``prepare_for_decode()`` each later step: one slot per request, ``seq_lens += 1``. With
     overlap scheduling (``future_tokens``) a request whose last token is still being sampled by
     the step in flight gets a placeholder input id (``managers/overlap.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardline_runtime.constrained.xgrammar_backend import allow_all_bitmask
from shardline_runtime.managers.decode_record import DecodeRecord
from shardline_runtime.managers.model_worker_batch import ModelWorkerBatch
from shardline_runtime.managers.overlap import future_placeholder
from shardline_runtime.managers.req import FinishReason, Req
from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from shardline_runtime.model_executor.forward_batch_info import ForwardMode
from shardline_runtime.sampling.sampling_batch_info import SamplingBatchInfo


class KVCacheFullError(RuntimeError):
    """The pool has fewer free request rows or KV slots than a step needs; the scheduler should
    have checked ``available_size()`` first (or retract requests)."""


__all__ = ["FinishReason", "KVCacheFullError", "Req", "ScheduleBatch"]

# the per-token state of a batch with no prepared step (shared, never written in place)
_NO_SLOTS = torch.zeros(0, dtype=torch.int64)


class ScheduleBatch:
    """Requests that run one step together, and the KV bookkeeping for that step.

    Per-row state (``len == batch_size``): ``reqs``, ``req_pool_indices``, ``seq_lens``,
    ``prefix_lens`` / ``extend_lens`` (EXTEND), and ``sampling_info`` (prepared once when the batch
    is formed, then filtered and merged with it). Per-token state: ``input_ids``,
    ``out_cache_loc``.

    Args:
        reqs: the requests.
        req_to_token_pool / token_to_kv_pool_allocator: the runner's pools.
        vocab_size: real vocabulary size (for sampling).
        device: where sampling tensors live (the model device).
    """

    def __init__(
        self,
        reqs: list[Req],
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        vocab_size: int,
        device: torch.device | str = "cpu",
    ):
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.vocab_size = vocab_size
        self.device = device if isinstance(device, torch.device) else torch.device(device)
        self.forward_mode = ForwardMode.IDLE
        self.input_ids: list[int] = []
        self.out_cache_loc = _NO_SLOTS
        self.req_pool_indices: list[int] = []
        self.seq_lens: list[int] = []
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.sampling_info: SamplingBatchInfo | None = None
        # overlap scheduling: a decode input may be the token the step in flight samples
        self.future_tokens = False
        self._future_ids_cache: tuple[list[int], torch.Tensor] = ([], _NO_SLOTS)
        self._decode_record: DecodeRecord | None = None  # decode_record.py
        # The request of this EXTEND whose prefill continues in a later step (set when formed):
        # with pipeline micro-batches or overlap scheduling the scheduler's own ``chunked_req``
        # may have moved on by the time this batch's result is processed.
        self.chunked_req: Req | None = None

    @classmethod
    def init_new(cls, reqs: list[Req], worker) -> ScheduleBatch:
        """A batch of ``reqs`` over ``worker``'s pools, vocabulary size and device."""
        return cls(
            reqs,
            worker.req_to_token_pool,
            worker.token_to_kv_pool_allocator,
            worker.model_config.vocab_size,
            worker.device,
        )

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def return_logprob(self) -> bool:
        return any(r.return_logprob for r in self.reqs)

    def _alloc_slots(self, n: int) -> torch.Tensor:
        slots = self.token_to_kv_pool_allocator.alloc(n)
        if slots is None:
            raise KVCacheFullError(
                f"need {n} KV slots, {self.token_to_kv_pool_allocator.available_size()} free"
            )
        return slots  # host indices: the allocator's free list is on the host

    def _alloc_rows(self, reqs: list[Req]) -> None:
        new = [r for r in reqs if r.req_pool_idx is None]
        rows = self.req_to_token_pool.alloc(len(new))
        if rows is None:
            raise KVCacheFullError(
                f"need {len(new)} request rows, {self.req_to_token_pool.available_size()} free"
            )
        for req, row in zip(new, rows):
            cached = req.cached_len
            self.req_to_token_pool.write((row, slice(0, cached)), req.prefix_indices)
            req.req_pool_idx, req.kv_len = row, cached

    def prepare_for_extend(self) -> None:
        """Allocate rows and KV slots for each request's ``fill_ids[cached_len:]`` (EXTEND).

        Raises:
            KVCacheFullError: not enough request rows or KV slots (nothing is allocated then).
            ValueError: a request has nothing new to compute.
        """
        self.forward_mode = ForwardMode.EXTEND
        prefix_lens = [r.cached_len for r in self.reqs]
        extend_lens = [len(r.fill_ids) - p for r, p in zip(self.reqs, prefix_lens)]
        for req, n in zip(self.reqs, extend_lens):
            if n <= 0:
                raise ValueError(
                    f"request {req.rid}: nothing to extend (fill {len(req.fill_ids)}, cached {req.cached_len})"
                )
        if sum(extend_lens) > self.token_to_kv_pool_allocator.available_size():
            raise KVCacheFullError(
                f"need {sum(extend_lens)} KV slots, {self.token_to_kv_pool_allocator.available_size()} free"
            )
        self._alloc_rows(self.reqs)
        out_cache_loc = self._alloc_slots(sum(extend_lens))
        offset = 0
        for req, prefix, n in zip(self.reqs, prefix_lens, extend_lens):
            self.req_to_token_pool.write(
                (req.req_pool_idx, slice(prefix, prefix + n)), out_cache_loc[offset : offset + n]
            )
            req.kv_len = prefix + n
            offset += n
        self.input_ids = [t for r, p in zip(self.reqs, prefix_lens) for t in r.fill_ids[p:]]
        self.out_cache_loc = out_cache_loc
        self.req_pool_indices = [r.row for r in self.reqs]
        self.seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        self.prefix_lens = prefix_lens
        self.extend_lens = extend_lens
        self.sampling_info = SamplingBatchInfo.from_reqs(self.reqs, self.vocab_size, self.device)

    def _decode_input_id(self, req: Req, row: int) -> int:
        """The token at position ``kv_len`` (the one this step computes the KV of): known on
        the host, or (overlap scheduling) still being sampled by the step in flight, then a
        :func:`future_placeholder` resolved on the device."""
        prompt_len, pos = len(req.origin_input_ids), req.kv_len
        known = prompt_len + len(req.output_ids)
        if pos < known:  # indexed, not concatenated: this runs per request per step
            return (
                req.origin_input_ids[pos] if pos < prompt_len else req.output_ids[pos - prompt_len]
            )
        if self.future_tokens and pos == known:
            return future_placeholder(row)
        raise ValueError(f"request {req.rid} has no output token to decode from")

    def _next_decode_slots(self, reqs: list[Req]) -> tuple[torch.Tensor, list[int], list[int]]:
        """One new KV slot per request, written at position ``kv_len``; advances ``kv_len``.
        Returns the slots, each request's input id and each request's row."""
        rows = [r.row for r in reqs]
        input_ids = [self._decode_input_id(r, row) for r, row in zip(reqs, rows)]
        slots = self.token_to_kv_pool_allocator.alloc_host(len(reqs))  # NumPy: no torch call
        if slots is None:
            raise KVCacheFullError(
                f"need {len(reqs)} KV slots, {self.token_to_kv_pool_allocator.available_size()} free"
            )
        self.req_to_token_pool.write_tokens(rows, [r.kv_len for r in reqs], slots)
        for req in reqs:
            req.kv_len += 1
        return torch.from_numpy(slots), input_ids, rows

    def prepare_for_decode(self) -> None:
        """One new token per request: the last output id, at position ``kv_len`` (DECODE).

        Raises:
            KVCacheFullError: fewer free KV slots than requests (nothing is allocated then).
        """
        self.forward_mode = ForwardMode.DECODE
        self.out_cache_loc, self.input_ids, self.req_pool_indices = self._next_decode_slots(
            self.reqs
        )
        self.seq_lens = [r.kv_len for r in self.reqs]
        self.prefix_lens = []
        self.extend_lens = []

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Append the running (decoding) requests to this prepared EXTEND batch, each as an
        extend of one token after its cached sequence. ``running``'s sampling state moves here.

        Raises:
            KVCacheFullError: fewer free KV slots than running requests.
        """
        if not self.forward_mode.is_extend():
            raise ValueError("mix_with_running needs a batch prepared with prepare_for_extend()")
        prefix_lens = [r.kv_len for r in running.reqs]
        slots, input_ids, rows = self._next_decode_slots(running.reqs)
        self.input_ids += input_ids
        self.out_cache_loc = torch.cat([self.out_cache_loc, slots])
        self.req_pool_indices += rows
        self.seq_lens += [r.kv_len for r in running.reqs]
        self.prefix_lens += prefix_lens
        self.extend_lens += [1] * len(running.reqs)
        self.reqs = self.reqs + running.reqs
        if self.sampling_info is None or running.sampling_info is None:
            raise ValueError("mix_with_running needs both batches prepared (sampling_info set)")
        self.sampling_info.merge_batch(running.sampling_info)

    def snapshot(self) -> ScheduleBatch:
        """:meth:`copy` for the overlap loop, which only reads it: consecutive DECODE steps of
        the same rows share one (its per-row lengths are those of the first of them; processing
        a DECODE step's result reads only the requests, the mode and the chunked request)."""
        record = self._decode_record
        if record is None or record.reqs is not self.reqs or not self.forward_mode.is_decode():
            return self.copy()
        if record.snapshot is None:
            record.snapshot = self.copy()
        return record.snapshot

    def copy(self) -> ScheduleBatch:
        """A snapshot of the rows as they are now (requests, mode, lengths, the chunked request;
        no sampling state, which stays with this batch), for processing a step's result after
        this batch has moved on (overlap scheduling)."""
        other = ScheduleBatch(
            list(self.reqs),
            self.req_to_token_pool,
            self.token_to_kv_pool_allocator,
            self.vocab_size,
            self.device,
        )
        other.forward_mode, other.future_tokens, other.chunked_req = (
            self.forward_mode,
            self.future_tokens,
            self.chunked_req,
        )
        other.req_pool_indices, other.seq_lens = list(self.req_pool_indices), list(self.seq_lens)
        other.prefix_lens, other.extend_lens = list(self.prefix_lens), list(self.extend_lens)
        return other

    def filter_batch(self, keep_indices: Sequence[int] | None = None) -> None:
        """Keep rows ``keep_indices`` (default: unfinished requests), in order; per-token state
        is cleared (the next step prepares it again)."""
        if keep_indices is None:  # finished_reason, not finished(): no call per request
            keep_indices = [i for i, r in enumerate(self.reqs) if r.finished_reason is None]
        keep_indices = list(keep_indices)
        if keep_indices == list(range(self.batch_size)):
            return
        self.reqs = [self.reqs[i] for i in keep_indices]
        self.req_pool_indices = [r.row for r in self.reqs]
        self.seq_lens = [r.kv_len for r in self.reqs]
        self.input_ids, self.prefix_lens, self.extend_lens = [], [], []
        self.out_cache_loc = _NO_SLOTS
        if self.sampling_info is not None:
            self.sampling_info.filter_batch(keep_indices)

    def merge_batch(self, other: ScheduleBatch) -> None:
        """Append ``other``'s requests (e.g. a finished prefill joining the running batch)."""
        if other.is_empty():
            return
        if self.is_empty() or self.sampling_info is None:
            self.reqs, self.sampling_info = list(other.reqs), other.sampling_info
        else:
            if other.sampling_info is None:
                raise ValueError("merge_batch needs a prepared batch (sampling_info set)")
            self.reqs = self.reqs + other.reqs
            self.sampling_info.merge_batch(other.sampling_info)
        self.req_pool_indices = [r.row for r in self.reqs]
        self.seq_lens = [r.kv_len for r in self.reqs]

    def release_kv(self, req: Req, keep_prefix_len: int = 0) -> None:
        """Free ``req``'s KV slots from ``keep_prefix_len`` on and its request row.

        Args:
            keep_prefix_len: leading tokens whose slots another owner keeps (the prefix cache).
        """
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        slots = self.req_to_token_pool.slots(row, keep_prefix_len, req.kv_len)
        self.token_to_kv_pool_allocator.free(slots)
        self.req_to_token_pool.free(row)
        req.req_pool_idx, req.kv_len = None, 0
        req.prefix_indices = torch.zeros(0, dtype=torch.int64)

    def get_model_worker_batch(self) -> ModelWorkerBatch:
        """The prepared step as the worker sees it (per-request flags read now, after
        ``prepare_for_extend`` / ``prepare_for_decode``). A DECODE step of the same rows as
        the last one updates that step's batch in place (:class:`DecodeRecord`)."""
        reqs = self.reqs
        decode = self.forward_mode is ForwardMode.DECODE
        # all(i < 0) as one C call: the largest id is a placeholder
        futures = decode and self.future_tokens and bool(self.input_ids) and max(self.input_ids) < 0
        record = self._decode_record
        if decode and record is not None and record.reqs is reqs:
            return record.advance(self, futures)
        extend = self.forward_mode.is_extend()
        logprob = self.return_logprob
        logprob_starts = None
        if extend and logprob and not self.forward_mode.is_target_verify():
            logprob_starts = [
                min(max(r.logprob_start_len - p, 0), n)
                if r.return_logprob and r.logprob_start_len >= 0
                else n
                for r, p, n in zip(reqs, self.prefix_lens, self.extend_lens)
            ]
        batch = ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=self.future_ids()
            if futures
            else torch.as_tensor(self.input_ids, dtype=torch.int64),
            req_pool_indices=list(self.req_pool_indices),
            seq_lens=list(self.seq_lens),
            out_cache_loc=self.out_cache_loc,
            wants_token=[r.wants_token for r in reqs],
            sampling_info=self.sampling_info,
            extend_prefix_lens=list(self.prefix_lens) if extend else None,
            extend_logprob_start_lens=logprob_starts,
            return_logprob=logprob,
            return_logprobs=[r.return_logprob for r in reqs] if logprob else None,
            top_logprobs_nums=[r.top_logprobs_num for r in reqs] if logprob else None,
        )
        if any(r.lora_name is not None for r in reqs):
            batch.lora_names = [r.lora_name for r in reqs]
        if extend and any(r.input_embeds_positions is not None for r in reqs):
            self._attach_input_embeds(batch)
        if any(r.grammar is not None for r in reqs):
            batch.grammar_bitmask = self.grammar_bitmask()
        if futures:
            batch.future_rows = batch.req_pool_indices  # every input is the step in flight's token
        self._decode_record = DecodeRecord(reqs, batch) if decode else None
        return batch

    def future_ids(self) -> torch.Tensor:
        """(bs,) int64 host tensor of this decode step's input ids, every one a placeholder; the
        same rows as the last call (decoding step after step) give the same tensor back."""
        if self.input_ids != self._future_ids_cache[0]:
            self._future_ids_cache = (
                self.input_ids,
                torch.tensor(self.input_ids, dtype=torch.int64),
            )
        return self._future_ids_cache[1]

    def grammar_bitmask(self) -> torch.Tensor:
        """(bs, ceil(vocab / 32)) int32: each constrained row that samples this step gets its
        matcher's allowed tokens (the matcher holds every token accepted so far: with overlap
        the scheduler settles the step in flight first, see ``OverlapSteps.holds_grammar``)."""
        bitmask = allow_all_bitmask(len(self.reqs), self.vocab_size)
        for i, req in enumerate(self.reqs):
            if req.grammar is not None and req.wants_token:
                req.grammar.fill_bitmask(bitmask, i)
        return bitmask

    def _attach_input_embeds(self, batch: ModelWorkerBatch) -> None:
        """Rows of this step's packed tokens whose embedding the request gave (prompt
        positions in ``[prefix, prefix + extend_len)``) and their vectors."""
        rows, values, start = [], [], 0
        for req, prefix, n in zip(self.reqs, self.prefix_lens, self.extend_lens):
            if req.input_embeds_positions is not None and req.input_embeds_values is not None:
                for j, pos in enumerate(req.input_embeds_positions):
                    if prefix <= pos < prefix + n:
                        rows.append(start + pos - prefix)
                        values.append(req.input_embeds_values[j])
            start += n
        if rows:
            batch.input_embeds_indices = torch.tensor(rows, dtype=torch.int64)
            batch.input_embeds_values = torch.stack(values)

"""ModelWorkerBatch: what the Scheduler hands the TpModelWorker for one step (SGLang's name).

The scheduler keeps its ``ScheduleBatch`` (requests, pools, bookkeeping) to itself; the worker sees
only this plain record of the prepared step, made by ``ScheduleBatch.get_model_worker_batch()``.
The worker turns it into the ``ForwardBatch`` the runner and the model read
(:meth:`ModelWorkerBatch.to_forward_batch`; SGLang writes this as
``ForwardBatch.init_new(model_worker_batch, model_runner)``, which here would make
``model_executor`` import ``managers``).

The overlap scheduler prepares step N+1 before step N's tokens are known: a decode row's input id
is then ``-future_index`` (negative), resolved on the device from the ``FutureMap`` just before
the step runs (``managers/overlap.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode


@dataclass
class ModelWorkerBatch:
    """One prepared step (``bs`` requests, ``T`` tokens).

    Attributes:
        forward_mode: EXTEND / DECODE (/ IDLE).
        input_ids: (T,) int64 on the CPU; negative ids are future placeholders.
        req_pool_indices / seq_lens: per request, its ``req_to_token`` row and length after
            the step (cached + new).
        out_cache_loc: (T,) int64 KV slots the step writes.
        extend_prefix_lens: per request, the cached prefix (``cached_len``), EXTEND only.
        extend_logprob_start_lens: per request, prompt logprobs from this offset of the step's
            new tokens (EXTEND with logprobs only).
        return_logprob: some request wants logprobs; ``return_logprobs`` per request;
            ``top_logprobs_nums`` per request (0 = none).
        wants_token: per request, whether the step samples a token for it.
        sampling_info: the batch's ``SamplingBatchInfo`` (shared with the ``ScheduleBatch``;
            sampling updates its penalty counts).
        lora_names: adapter per request, or None when no request uses one.
        input_embeds_indices / input_embeds_values: (K,) packed token rows and (K, hidden)
            caller-given embeddings, or None.
        grammar_bitmask: (bs, ceil(vocab / 32)) int32 on the CPU, the tokens each row may
            sample (constrained decoding; free rows all ones), or None when no row is constrained.
        future_rows: (overlap) every input id is a future placeholder: the request rows, in
            order (``req_pool_indices``); None otherwise. ``FutureMap.resolve`` then hands over
            the previous step's sampled ids when that step ran the same rows.
        host_forward_batch: (a CPU DECODE step) the ``ForwardBatch`` this batch was last turned
            into, and the runner's ``HostDecodeInputs``; a batch advanced in place for the next
            step of the same rows (``decode_record.py``) updates it in place too.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    req_pool_indices: list[int]
    seq_lens: list[int]
    out_cache_loc: torch.Tensor
    wants_token: list[bool]
    sampling_info: Any
    extend_prefix_lens: list[int] | None = None
    extend_logprob_start_lens: list[int] | None = None
    return_logprob: bool = False
    return_logprobs: list[bool] | None = None
    top_logprobs_nums: list[int] | None = None
    lora_names: list[str | None] | None = None
    input_embeds_indices: torch.Tensor | None = None
    input_embeds_values: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    future_rows: list[int] | None = None
    host_forward_batch: tuple[Any, ForwardBatch] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)

    def to_forward_batch(
        self, model_runner: Any = None, device: torch.device | str | None = None
    ) -> ForwardBatch:
        """The ``ForwardBatch`` of this step, on ``model_runner``'s device with its pools and
        attention backend (``ForwardBatch.init_new`` checks the lengths)."""
        host = getattr(model_runner, "host_decode_inputs", None)
        if host is not None and device is None and self.forward_mode is ForwardMode.DECODE:
            # a CPU decode step: index tensors from the runner's preallocated buffers
            last = self.host_forward_batch
            if last is not None and last[0] is host:
                forward_batch = last[1]
                forward_batch.advance_host_decode(
                    host, self.input_ids, self.req_pool_indices, self.seq_lens, self.out_cache_loc
                )
                forward_batch.sampling_info = self.sampling_info
                forward_batch.wants_token = self.wants_token
                forward_batch.grammar_bitmask = self.grammar_bitmask
                return forward_batch
            forward_batch = ForwardBatch.host_decode(
                host,
                model_runner,
                self.input_ids,
                self.req_pool_indices,
                self.seq_lens,
                self.out_cache_loc,
                return_logprob=self.return_logprob,
                top_logprobs_nums=self.top_logprobs_nums,
                sampling_info=self.sampling_info,
                wants_token=self.wants_token,
                return_logprobs=self.return_logprobs,
            )
            forward_batch.lora_names = self.lora_names
            forward_batch.grammar_bitmask = self.grammar_bitmask
            self.host_forward_batch = (host, forward_batch)
            return forward_batch
        forward_batch = ForwardBatch.init_new(
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            out_cache_loc=self.out_cache_loc,
            model_runner=model_runner,
            extend_prefix_lens=self.extend_prefix_lens,
            return_logprob=self.return_logprob,
            top_logprobs_nums=self.top_logprobs_nums,
            extend_logprob_start_lens=self.extend_logprob_start_lens,
            sampling_info=self.sampling_info,
            wants_token=self.wants_token,
            return_logprobs=self.return_logprobs,
            device=device,
        )
        forward_batch.lora_names = self.lora_names
        forward_batch.input_embeds_indices = self.input_embeds_indices
        forward_batch.input_embeds_values = self.input_embeds_values
        forward_batch.grammar_bitmask = self.grammar_bitmask
        return forward_batch

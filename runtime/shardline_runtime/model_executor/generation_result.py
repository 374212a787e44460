"""GenerationBatchResult: what one step of ``ModelRunner.forward_and_sample`` hands back.

Sampling leaves its results on the model's device; :meth:`GenerationBatchResult.copy_to_cpu`
starts the device-to-host copies (non-blocking on CUDA, with an event recorded after them) and
:meth:`GenerationBatchResult.wait` finishes them and builds the Python lists the scheduler reads.
Between the two the scheduler can prepare the next batch (the overlap scheduler, as SGLang's
``copy_done`` event).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from shardline_runtime.model_executor.forward_batch_info import ForwardBatch


@dataclass
class GenerationBatchResult:
    """Outcome of one step for a batch of ``bs`` requests.

    Attributes:
        logits_output: the model's ``LogitsProcessorOutput`` (``next_token_logits`` (bs, vocab)
            float32; prompt logprobs when asked).
        forward_batch: the ``ForwardBatch`` that ran.
        next_token_ids: (bs,) int64; -1 for rows that sampled nothing (intermediate chunks,
            ``max_new_tokens == 0``). On the device after sampling, on the CPU after :meth:`wait`.
        next_token_logprobs: per row, the raw logprob (float) of the sampled token, or ``None``
            (filled by :meth:`wait`).
        next_token_top_logprobs: per row, ``(values, token_ids)`` or ``None`` (filled by :meth:`wait`).
        sampled_rows: rows that drew a token, in order.
        logprob_rows / top_logprobs_nums: indices into ``sampled_rows`` that asked for logprobs,
            and how many top logprobs each asked for.
        sampled_logprobs: (len(sampled_rows),) float32 on the device, or ``None``.
        top_values / top_indices: per sampled row, the top logprobs and their token ids (Python
            lists: the sampler reads them on the host), or ``None``.
        copy_done: CUDA event recorded after the device-to-host copies (``None`` on CPU).
        accepted_ids: (TARGET_VERIFY) per request, the kept draft tokens and the target's next
            token, on the host; None for other steps.
        accepted_logprobs / accepted_top_logprobs: (TARGET_VERIFY with logprobs) per request,
            one raw logprob and one ``(values, token_ids)`` per kept token (empty lists for
            requests that did not ask).
        pp_hidden_states_proxy_tensors: on a pipeline stage that is not the last, what it sent
            on; nothing is sampled there (``TpModelWorker.resolve_stage_outputs`` fills the ids
            from the last stage).
        pooled: (embedding models) (bs, hidden_size) float32, each request's pooled partial of
            this step (``layers/pooler.py``); None for generation models.
        host_ids: (a greedy CPU step) ``next_token_ids`` as a NumPy view of the same memory, or
            None; :meth:`next_ids_list` reads it (cheaper than the tensor's ``tolist``).
    """

    logits_output: Any
    forward_batch: ForwardBatch
    next_token_ids: torch.Tensor | None = None
    next_token_logprobs: list[float | None] = field(default_factory=list)
    next_token_top_logprobs: list[tuple[list[float], list[int]] | None] = field(
        default_factory=list
    )
    sampled_rows: list[int] = field(default_factory=list)
    logprob_rows: list[bool] = field(default_factory=list)
    top_logprobs_nums: list[int] = field(default_factory=list)
    sampled_logprobs: torch.Tensor | None = None
    top_values: list[list[float]] | None = None
    top_indices: list[list[int]] | None = None
    copy_done: Any = None
    pp_hidden_states_proxy_tensors: Any = None
    accepted_ids: list[list[int]] | None = None
    accepted_logprobs: list[list[float]] | None = None
    accepted_top_logprobs: list[list[tuple[list[float], list[int]]]] | None = None
    pooled: torch.Tensor | None = None
    host_ids: np.ndarray | None = None
    # A step on the CPU keeps its result tensors as they are (they are on the host): no copy.
    # tests/serving/device_read_guard.py turns this off, modelling a device on the CPU.
    host_results_as_is: ClassVar[bool] = True

    def copy_to_cpu(self) -> GenerationBatchResult:
        """Start copying the sampled ids and logprobs (an embedding model's ``pooled``) to the
        host (non-blocking on CUDA), and,
        for an EXTEND step that returns prompt logprobs, the logits output the result processor
        reads (so processing this step never reads the device while the next one runs)."""
        ids = self.next_token_ids
        on_host = ids is not None and ids.is_cpu and self.host_results_as_is
        cuda = not on_host and ids is not None and ids.is_cuda
        if not on_host:  # on the CPU every result tensor is on the host already
            self.host_ids = None
            for name in ("next_token_ids", "sampled_logprobs", "pooled"):
                value = getattr(self, name)
                if value is not None:
                    setattr(self, name, value.to("cpu", non_blocking=cuda))
        batch = self.forward_batch
        if self.logits_output is not None and batch is not None and batch.return_logprob:
            if batch.forward_mode.is_extend():
                self.logits_output = logits_output_to_cpu(self.logits_output, cuda)
        if cuda:
            self.copy_done = torch.cuda.Event()
            self.copy_done.record()
        return self

    def next_ids_list(self) -> list[int]:
        """``next_token_ids`` as a Python list (after :meth:`wait`)."""
        if self.host_ids is not None:
            return self.host_ids.tolist()
        assert self.next_token_ids is not None, "the result of a step that sampled nothing"
        return self.next_token_ids.tolist()

    def wait(self) -> GenerationBatchResult:
        """Block until the copies are done; fill ``next_token_logprobs`` / ``_top_logprobs``."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
            self.copy_done = None
        bs = 0 if self.next_token_ids is None else int(self.next_token_ids.shape[0])
        self.next_token_logprobs = [None] * bs
        self.next_token_top_logprobs = [None] * bs
        if self.sampled_logprobs is None and self.top_values is None:
            return self  # no row asked for logprobs (the common case)
        logprobs = self.sampled_logprobs.tolist() if self.sampled_logprobs is not None else None
        for j, row in enumerate(self.sampled_rows):
            if logprobs is not None and self.logprob_rows[j]:
                self.next_token_logprobs[row] = logprobs[j]
            if (
                self.top_values is not None
                and self.top_indices is not None
                and self.top_logprobs_nums[j]
            ):
                self.next_token_top_logprobs[row] = (self.top_values[j], self.top_indices[j])
        return self


def logits_output_to_cpu(logits_output: Any, non_blocking: bool = False) -> Any:
    """A copy of a ``LogitsProcessorOutput`` whose tensors (and lists of tensors) are on the host
    (``non_blocking``: queued copies, valid after the step's ``copy_done`` event)."""

    def host(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to("cpu", non_blocking=non_blocking)
        if isinstance(value, list):
            return [host(v) for v in value]
        return value

    return type(logits_output)(**{k: host(v) for k, v in vars(logits_output).items()})

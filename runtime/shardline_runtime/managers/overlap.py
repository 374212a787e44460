"""Overlap scheduling: prepare step N+1 on the CPU while step N runs (after SGLang's overlap
scheduler and its ``FutureMap``).

The loop (``Scheduler.event_loop``) launches step N+1 before it processes step N's result. A
request decoding in N+1 may still wait for its token from N: the scheduler writes the placeholder
``-(req_pool_idx + 1)`` as its input id, and just before N+1 runs :meth:`FutureMap.resolve`
replaces it on the device by the token N sampled for that request row (:meth:`FutureMap.store`
wrote it there after N's sampling; both run on the forward stream, so N's write comes first).
Nothing waits for the device between the two launches.

On CUDA a step runs on the runner's ``forward_stream`` and its sampled ids are copied to the host
without blocking (``GenerationBatchResult.copy_to_cpu`` records an event). The host waits for the
device only in ``GenerationBatchResult.wait`` (that event), when it processes a step: slot
indices, sequence lengths, finish checks, the prefix cache and sampling flags are host state, and
copies to the device are non-blocking (``device_copy.to_device``); a CPU test marks device tensors
and fails on any host read of them while a step is in flight
(``tests/serving/test_overlap_never_waits.py``). On the CPU the same loop runs; the forward is
synchronous there, so only the order of the work changes.

Why a placeholder is keyed by the request row: a row holds one request at a time and each step
samples at most one token per row, so "the latest token sampled for row r" is exactly the token
the next step of that request needs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from shardline_runtime.device_copy import to_device
from shardline_runtime.managers.model_worker_batch import ModelWorkerBatch
from shardline_runtime.model_executor.generation_result import GenerationBatchResult


def future_placeholder(req_pool_idx: int) -> int:
    """The input id standing for the token an in-flight step samples for request row
    ``req_pool_idx`` (always negative)."""
    return -(req_pool_idx + 1)


class FutureMap:
    """Per request row, the latest sampled token, on the model's device.

    Args:
        num_rows: rows of the ``req_to_token`` pool.
        device: the model's device.
    """

    def __init__(self, num_rows: int, device: torch.device):
        self.device = device
        # zeros, not garbage: a row that never sampled still resolves to a valid id
        self.token_ids = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) int64 ids on the device with every placeholder replaced by its row's token.

        Args:
            input_ids: (T,) int64 on the host (which ids are placeholders is known there, so a
                step of placeholders only, a decode step after another, is one gather).
        """
        if input_ids.shape[0] <= 256:  # a decode step: Python over a short list is cheaper
            ids_list = input_ids.tolist()
            rows_list = [-i - 1 for i in ids_list if i < 0]
            if not rows_list:
                return to_device(input_ids, self.device)
            if len(rows_list) == len(ids_list):
                return self.token_ids[to_device(rows_list, self.device, torch.int64)]
        placeholders = input_ids < 0
        if not bool(placeholders.any()):
            return to_device(input_ids, self.device)
        rows = to_device((-input_ids - 1).clamp(min=0), self.device)
        ids = to_device(input_ids, self.device)
        return torch.where(to_device(placeholders, self.device), self.token_ids[rows], ids)

    def store(
        self, req_pool_indices: torch.Tensor, next_token_ids: torch.Tensor, every_row: bool = False
    ) -> None:
        """Record each row's sampled token ((bs,) int64 on the device; -1 rows keep theirs, unless
        ``every_row`` says, from the host, that every row sampled). Device ops only: no host
        synchronisation."""
        if every_row:
            self.token_ids[req_pool_indices] = next_token_ids
            return
        old = self.token_ids[req_pool_indices]
        self.token_ids[req_pool_indices] = torch.where(next_token_ids >= 0, next_token_ids, old)


@dataclass
class InFlightStep:
    """A launched step whose result is not processed yet.

    Attributes:
        batch: the ``ScheduleBatch`` that ran (an EXTEND batch joins the running batch from here).
        rows: a copy of its rows as launched, for processing the result (the running batch may
            have been filtered or extended since).
        result: its result (ids possibly still being copied to the host).
        joined_running: its EXTEND requests already joined the running batch (they join the next
            decode before their first token is known).
        deferred_free: KV slots of requests that finished while this step was computing their
            next (discarded) token; freed once the step has completed.
    """

    batch: Any
    rows: Any
    result: GenerationBatchResult
    joined_running: bool = False
    deferred_free: list[torch.Tensor] = field(default_factory=list)

    def holds(self, req: Any) -> bool:
        return any(r is req for r in self.rows.reqs)


def launch_step(
    worker: Any, batch: ModelWorkerBatch, future_map: FutureMap | None
) -> GenerationBatchResult:
    """Run ``batch`` on the worker without waiting for it: resolve placeholders, forward, sample,
    store the sampled tokens for the next step and start the copy of the result to the host.

    On CUDA this runs on the runner's forward stream (after the work already queued on the
    current stream, e.g. the ``req_to_token`` writes of this step).
    """
    stream = getattr(worker.model_runner, "forward_stream", None)
    context: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        context = torch.cuda.stream(stream)
    with context:
        if future_map is not None:
            batch.input_ids = future_map.resolve(batch.input_ids)
        result = worker.forward_batch_generation(batch)
        if future_map is not None:
            rows = result.forward_batch.req_pool_indices  # on the device already
            future_map.store(rows, result.next_token_ids, every_row=all(batch.wants_token))
        result.copy_to_cpu()
    return result

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
        self._last_rows: list[int] = []
        # a deferred store: (rows on the host, rows on the device, their sampled ids)
        self._pending: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
        self._last_rows_device = torch.zeros(0, dtype=torch.int64, device=device)

    def resolve(
        self, input_ids: torch.Tensor, future_rows: list[int] | None = None
    ) -> torch.Tensor:
        """(T,) int64 ids on the device with every placeholder replaced by its row's token.

        Args:
            input_ids: (T,) int64 on the host (which ids are placeholders is known there, so a
                step of placeholders only, a decode step after another, is one gather).
            future_rows: set when every id is a placeholder, the request rows in order (the
                host knows it). When they are the rows of the last :meth:`store`, in the same
                order (a running batch decoding step after step), that step's sampled ids are
                this step's inputs as they are: no gather, and that store was never written.
        """
        pending = self._pending
        if pending is not None:
            if future_rows is not None and future_rows == pending[0]:
                return pending[2]
            self._write_pending()
        if input_ids.shape[0] <= 256:  # a decode step: Python over a short list is cheaper
            ids_list = input_ids.tolist()
            rows_list = [-i - 1 for i in ids_list if i < 0]
            if not rows_list:
                return to_device(input_ids, self.device)
            if len(rows_list) == len(ids_list):
                return self.token_ids[self._rows_on_device(rows_list)]
        placeholders = input_ids < 0
        if not bool(placeholders.any()):
            return to_device(input_ids, self.device)
        rows = to_device((-input_ids - 1).clamp(min=0), self.device)
        ids = to_device(input_ids, self.device)
        return torch.where(to_device(placeholders, self.device), self.token_ids[rows], ids)

    def _write_pending(self) -> None:
        """Write the deferred store (device ops only)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.token_ids[pending[1]] = pending[2]

    def _rows_on_device(self, rows: list[int]) -> torch.Tensor:
        """``rows`` as an int64 device tensor; the same rows as the last call (a running batch
        decoding step after step) reuse that call's tensor: no new host tensor, no copy."""
        if rows != self._last_rows:
            self._last_rows, self._last_rows_device = (
                rows,
                to_device(rows, self.device, torch.int64),
            )
        return self._last_rows_device

    def store(
        self,
        req_pool_indices: torch.Tensor,
        next_token_ids: torch.Tensor,
        every_row: bool = False,
        rows: list[int] | None = None,
    ) -> None:
        """Record each row's sampled token ((bs,) int64 on the device; -1 rows keep theirs, unless
        ``every_row`` says, from the host, that every row sampled). Device ops only: no host
        synchronisation.

        With ``every_row`` and ``rows`` (``req_pool_indices`` on the host) the write is deferred:
        the next :meth:`resolve` of exactly these rows takes the ids as they are, any other
        resolve or store writes them first. A later store of the same rows replaces a deferred
        one (every row then holds a newer token)."""
        pending = self._pending
        if pending is not None and not (every_row and rows == pending[0]):
            self._write_pending()
        if every_row and rows is not None:
            self._pending = (rows, req_pool_indices, next_token_ids)
            return
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
            have been filtered or extended since); read only (``ScheduleBatch.snapshot``).
        result: its result (ids possibly still being copied to the host).
        joined_running: its EXTEND requests already joined the running batch (they join the next
            decode before their first token is known).
        deferred_free: KV slots of requests that finished while this step was computing their
            next (discarded) token; freed once the step has completed.
        constrained: some request of the step has a grammar (its rows are then checked by
            ``OverlapSteps.holds_grammar``; the others are not, every step).
    """

    batch: Any
    rows: Any
    result: GenerationBatchResult
    joined_running: bool = False
    deferred_free: list[torch.Tensor] = field(default_factory=list)
    constrained: bool = False

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
    if stream is None:  # the CPU: no stream to enter
        return _launch(worker, batch, future_map)
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        return _launch(worker, batch, future_map)


def _launch(
    worker: Any, batch: ModelWorkerBatch, future_map: FutureMap | None
) -> GenerationBatchResult:
    """:func:`launch_step`'s work, on the current stream."""
    if future_map is not None:
        batch.input_ids = future_map.resolve(batch.input_ids, batch.future_rows)
    result = worker.forward_batch_generation(batch)
    if future_map is not None:
        rows = result.forward_batch.req_pool_indices  # on the device already
        every_row = all(batch.wants_token)
        future_map.store(rows, result.next_token_ids, every_row, batch.req_pool_indices)
    return result.copy_to_cpu()

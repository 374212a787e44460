"""The overlap loop's step in flight (``Scheduler.run_step`` with overlap scheduling).

``overlap.py`` holds the mechanism (``FutureMap``, ``InFlightStep``, ``launch_step``); this module
holds the one step in flight and what must happen around it: an EXTEND step's requests join the
running batch before their first token is known, a completed step's result is processed by the
:class:`ResultProcessor`, and the KV slots of its discarded tokens are freed.
"""

from __future__ import annotations

from typing import Any

import torch

from shardline_runtime.managers.decode_manager import DecodeManager
from shardline_runtime.managers.overlap import FutureMap, InFlightStep, launch_step
from shardline_runtime.managers.result_processor import ResultProcessor
from shardline_runtime.managers.schedule_batch import ScheduleBatch


class OverlapSteps:
    """The step in flight of the overlap loop, and the bookkeeping around it.

    Off (``enabled`` False) nothing is ever in flight and every method is a no-op that the loop
    may still call.

    Args:
        worker: the rank's ``TpModelWorker``.
        enabled: overlap scheduling is on (a :class:`FutureMap` over the worker's request rows
            is built, and on CUDA the runner's forward stream becomes the current stream).
        results: the :class:`ResultProcessor` that processes a step once it completed.
        decode: the :class:`DecodeManager` the EXTEND steps' requests join.

    Attributes:
        in_flight: the step launched and not processed yet, or None.
    """

    def __init__(
        self,
        worker: Any,
        enabled: bool,
        results: ResultProcessor,
        decode: DecodeManager,
    ):
        self.worker = worker
        self.future_map: FutureMap | None = None
        if enabled:
            self.future_map = FutureMap(worker.req_to_token_pool.size, worker.device)
            use_forward_stream(worker)
        self.results = results
        self.decode = decode
        self.in_flight: InFlightStep | None = None

    @property
    def enabled(self) -> bool:
        return self.future_map is not None

    def launch(self, batch: ScheduleBatch) -> None:
        """Launch ``batch`` without waiting, then process the step launched before it."""
        worker_batch = batch.get_model_worker_batch()
        constrained = worker_batch.grammar_bitmask is not None  # a request has a grammar
        result = launch_step(self.worker, worker_batch, self.future_map)
        step = InFlightStep(batch, batch.snapshot(), result, constrained=constrained)
        previous, self.in_flight = self.in_flight, step
        if previous is not None:
            self.process(previous)

    def holds_grammar(self) -> bool:
        """The step in flight samples a token for a constrained request that goes on.

        The sync point of constrained decoding: the bitmask of that request's next step needs
        the grammar advanced with this token, so the loop settles the step first (batches
        without a constrained request keep the full overlap). SGLang instead computes the mask
        in its forward thread after the result is processed; on CPU the forward is synchronous
        and both orders cost the same.
        """
        step = self.in_flight
        return (
            step is not None
            and step.constrained
            and any(r.grammar is not None and not r.finished() for r in step.rows.reqs)
        )

    def drain(self) -> bool:
        """Wait for the step in flight and process its result; False when none is."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return False
        self.process(step)
        return True

    def process(self, step: InFlightStep) -> None:
        result = step.result.wait()
        self.join(step)
        self.results.process(
            step.rows, result, self.decode, snapshot=True, in_flight=self.in_flight
        )
        for slots in step.deferred_free:
            self.results.cache.allocator.free(slots)

    def join_in_flight_extend(self) -> None:
        """Requests of the EXTEND step in flight that will decode join the running batch now,
        before their first token is known (their next input is a placeholder)."""
        if self.in_flight is not None:
            self.join(self.in_flight)

    def join(self, step: InFlightStep) -> None:
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
        self.decode.add(batch)


def use_forward_stream(worker: Any) -> None:
    """(Overlap, CUDA) Queue every device op of this process (batch preparation, merges, the
    steps) on the runner's forward stream, in program order; the host waits only when it reads a
    result. No-op without a forward stream (CPU)."""
    stream = getattr(worker.model_runner, "forward_stream", None)
    if stream is not None:
        torch.cuda.set_stream(stream)

"""RequestStreams: the HTTP process's sockets to the rank-0 scheduler and one queue per request.

Sends requests, aborts and control messages (ZMQ PUSH, from the event loop). Every scheduler
output arrives on a ZMQ PULL socket owned by the :class:`OutputReceiver` thread, which
unpickles it and detokenizes a ``BatchTokenOut`` per step; on the event loop each request's
:class:`GenerateChunk` goes to its queue and any other message to the ``on_message`` callback
(state, replies), in arrival order. A stop string matched by the detokenizer finishes the
request here and tells the scheduler to free it (``AbortReq`` with a ``stop`` reason).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from shardline_runtime.managers.detokenizer import IncrementalDetokenizer
from shardline_runtime.managers.io_struct import (
    AbortReq,
    FinishReason,
    TokenizedGenerateReqInput,
    Usage,
)
from shardline_runtime.managers.output_receiver import OutputReceiver, StepRecord
from shardline_runtime.managers.step_detokenizer import GenerateChunk, StepDetokenizer
from shardline_runtime.weights_state import WeightsState

logger = logging.getLogger(__name__)


@dataclass
class ReqStream:
    """One in-flight request: its detokenizer, its chunk queue, and what was sent so far
    (``usage``: prompt tokens, completion tokens delivered, cached tokens)."""

    detok: IncrementalDetokenizer
    usage: Usage
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    created: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None


class RequestStreams:
    """Sockets, per-request queues and the receive loop (see the module docstring).

    Args:
        tokenizer: HuggingFace tokenizer of the model (copied for the receiver thread).
        scheduler_input_addr: ZMQ address the rank-0 scheduler PULLs requests from.
        output_addr: ZMQ address this process PULLs scheduler outputs on (bound here).
        on_message: called on the event loop with every message that is not a step's tokens.
        weights: returns the ``WeightsState`` serving now; its ``weight_version`` and ``revision``
            are stamped on each chunk (the schedulers send a new state before any output of
            new weights, on the same socket, so the stamp names the weights that ran).
        metrics: a ``ServingMetrics`` (or None).
    """

    def __init__(
        self,
        tokenizer: Any,
        scheduler_input_addr: str,
        output_addr: str,
        on_message: Callable[[Any], None],
        weights: Callable[[], WeightsState],
        metrics: Any = None,
    ):
        self.context = zmq.asyncio.Context()
        self.send_socket = self.context.socket(zmq.PUSH)
        self.send_socket.connect(scheduler_input_addr)
        self._recv_context = zmq.Context()  # a plain context: the receiver thread blocks on it
        recv_socket = self._recv_context.socket(zmq.PULL)
        recv_socket.bind(output_addr)
        self.detokenizer = StepDetokenizer(tokenizer)
        self.states: dict[str, ReqStream] = {}
        self._on_message = on_message
        self._weights = weights
        self.metrics = metrics
        self.receiver = OutputReceiver(
            recv_socket, self.detokenizer, self._live_stream, self._deliver_step, self._handle
        )

    def start(self) -> None:
        """Start the receiver thread (call from inside the running event loop)."""
        self.receiver.start(asyncio.get_running_loop())

    def close(self) -> None:
        """Stop receiving (the receiver thread ends within 0.1 s) and close the sockets."""
        self.receiver.close()
        self.send_socket.close(0)

    async def send(self, msg: Any) -> None:
        await self.send_socket.send_pyobj(msg)

    # ---------------------------------------------------------------- requests

    async def open(self, req: TokenizedGenerateReqInput) -> ReqStream:
        """Register ``req`` and send it; its chunks arrive in the returned stream's queue.

        Raises:
            ValueError: ``req.rid`` is in use.
        """
        if req.rid in self.states:
            raise ValueError(f"request id {req.rid!r} is already in use")
        params = req.sampling_params
        detok = self.detokenizer.new_request(
            req.input_ids, params.stop, params.skip_special_tokens, req.include_stop_str_in_output
        )
        stream = ReqStream(detok, Usage(len(req.input_ids), 0, 0))
        self.states[req.rid] = stream
        await self.send(req)
        return stream

    async def release(self, rid: str, abort_message: str) -> None:
        """Forget ``rid``; when it has not finished, abort it in the scheduler."""
        stream = self.states.pop(rid, None)
        if stream is not None and not stream.finished:
            stream.finished = True
            await self.send_abort(rid, {"type": "abort", "message": abort_message})

    async def send_abort(self, rid: str | None, reason: dict) -> None:
        try:
            await self.send(AbortReq(rid, reason))
        except zmq.ZMQError as exc:
            logger.warning("could not send abort for %s: %s", rid, exc)

    def abort_all_local(self, message: str) -> None:
        """Finish every in-flight request here with an abort (the scheduler is gone, or the
        drain timed out); each answer's usage counts the prompt and the tokens already sent."""
        for stream in list(self.states.values()):
            if not stream.finished:
                stream.finished = True
                stream.queue.put_nowait(
                    GenerateChunk(
                        text="",
                        token_ids=[],
                        usage=stream.usage,
                        finish=FinishReason("abort", message=message),
                        weight_version=self._weights().weight_version,
                        revision=self._weights().revision,
                    )
                )

    # ---------------------------------------------------------------- receive (see OutputReceiver)

    def _live_stream(self, rid: str) -> ReqStream | None:
        """The receiver thread's lookup: the stream of ``rid`` while it is in flight."""
        stream = self.states.get(rid)
        return None if stream is None or stream.finished else stream

    def _handle(self, msg: Any) -> None:
        try:
            self._on_message(msg)
        except Exception:  # a bug in one message must not stop every request
            logger.exception("failed to handle scheduler output %s", type(msg).__name__)

    def _deliver_step(self, step: list[StepRecord]) -> None:
        """On the event loop: each chunk of a detokenized step to its request's queue."""
        try:
            now = time.monotonic()
            served = self._weights()
            for stream, out, chunk, stopped_here in step:
                if stream.finished:  # aborted here while the thread decoded
                    continue
                if stopped_here:
                    reason = {"type": "stop", "matched": chunk.finish and chunk.finish.matched}
                    asyncio.get_running_loop().create_task(self.send_abort(out.rid, reason))
                chunk.weight_version, chunk.revision = served.weight_version, served.revision
                stream.usage = chunk.usage
                stream.finished = chunk.finish is not None
                if self.metrics and chunk.token_ids:
                    self.metrics.observe_tokens(stream, now, len(chunk.token_ids))
                if self.metrics and chunk.finish is not None:
                    self.metrics.observe_finish(stream, now, chunk)
                stream.queue.put_nowait(chunk)
        except Exception:
            logger.exception("failed to deliver a step's outputs")

"""OutputReceiver: the HTTP process's thread that receives every scheduler output.

One daemon thread owns the ZMQ PULL socket the rank-0 scheduler pushes to. For each message it
does the per-step work that used to run on the event loop or hop to a worker pool: the blocking
receive (the GIL is released while it waits), the unpickling, and for a ``BatchTokenOut`` the
detokenization of every request's ``TokenOut`` (:class:`StepDetokenizer`). It then hands the
result to the event loop with one ``call_soon_threadsafe`` per message, in arrival order, so a
``WeightsState`` sent before a step's tokens is applied before their chunks are stamped.

At concurrency 1 this is one thread wake-up and one loop wake-up per step, where a
``zmq.asyncio`` receive followed by ``run_in_executor`` took two of each. After SGLang's
``DetokenizerManager`` (a process that receives, detokenizes per step and forwards); here a
thread, so the step's chunks need no second pickling.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from shardline_runtime.managers.io_struct import BatchTokenOut, TokenOut
from shardline_runtime.managers.step_detokenizer import GenerateChunk, StepDetokenizer

logger = logging.getLogger(__name__)

# (stream, the request's TokenOut, its chunk, whether a stop string matched in this step)
StepRecord = tuple[Any, TokenOut, GenerateChunk, bool]

# How often (ms) the receive wakes up with nothing to read, to notice close().
_POLL_MS = 100


class OutputReceiver:
    """The receive thread (module docstring).

    Args:
        socket: a bound ZMQ PULL socket of a plain (not asyncio) context; the thread owns it
            from :meth:`start` on and closes it when it ends.
        detokenizer: the :class:`StepDetokenizer` (used only by this thread).
        lookup: ``rid ->`` the stream of a request in flight (anything with a ``detok``, its
            :class:`IncrementalDetokenizer`), None for one unknown or finished (called from this
            thread: it only reads a dict under the GIL).
        deliver_step: called on the event loop with a step's ``(stream, TokenOut, chunk,
            stopped_here)`` records (requests unknown or finished when the step arrived left out).
        on_message: called on the event loop with every message that is not a step's tokens.
    """

    def __init__(
        self,
        socket: zmq.Socket,
        detokenizer: StepDetokenizer,
        lookup: Callable[[str], Any],
        deliver_step: Callable[[list[StepRecord]], None],
        on_message: Callable[[Any], None],
    ):
        self.socket = socket
        self.detokenizer = detokenizer
        self._lookup = lookup
        self._deliver_step = deliver_step
        self._on_message = on_message
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the thread; it hands everything to ``loop``."""
        self._loop = loop
        self.socket.setsockopt(zmq.RCVTIMEO, _POLL_MS)
        self._thread = threading.Thread(target=self._run, name="output-receiver", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (it closes the socket within ``_POLL_MS``); the socket is closed here
        when the thread never started."""
        self._stop.set()
        if self._thread is None:
            self.socket.close(0)

    def _run(self) -> None:
        assert self._loop is not None
        try:
            while not self._stop.is_set():
                try:
                    msg = self.socket.recv_pyobj()
                except zmq.Again:
                    continue
                try:
                    if isinstance(msg, BatchTokenOut):
                        step = self.step(msg)
                        if step:
                            self._loop.call_soon_threadsafe(self._deliver_step, step)
                    else:
                        self._loop.call_soon_threadsafe(self._on_message, msg)
                except Exception:  # a bug in one message must not stop every request
                    if self._loop.is_closed():  # the server is ending
                        return
                    logger.exception("failed to handle scheduler output %s", type(msg).__name__)
        finally:
            self.socket.close(0)

    def step(self, batch: BatchTokenOut) -> list[StepRecord]:
        """Detokenize one step (in this thread): a ``(stream, TokenOut, chunk, stopped_here)``
        per request still in flight, in batch order."""
        out = []
        for record in batch.outs:
            stream = self._lookup(record.rid)
            if stream is not None:
                chunk, stopped_here = self.detokenizer.detokenize(stream.detok, record)
                out.append((stream, record, chunk, stopped_here))
        return out
